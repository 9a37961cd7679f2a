"""The exit guard: a process past its limit leaves with the given code and every thread's stack;
a cancelled guard does nothing."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.helpers_launch import env_with


def _run(body: str) -> tuple[subprocess.CompletedProcess, float]:
    code = "import sys, threading, time\nfrom launcher.agent.exit_guard import ExitGuard\n" + body
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env_with()
    )
    return res, time.monotonic() - t0


def test_a_guard_past_its_limit_ends_the_process_with_its_code_and_the_stacks() -> None:
    res, took = _run(
        "threading.Thread(target=time.sleep, args=(30,), name='held-up').start()\n"
        "ExitGuard(7, 0.3, 'shutdown')\n"
        "def waiting_for_a_lock():\n"
        "    time.sleep(30)\n"
        "waiting_for_a_lock()\n"
    )
    assert res.returncode == 7 and took < 15, (took, res.stderr)
    first = res.stderr.splitlines()[0]
    assert first.startswith("ftrun: shutdown took longer than 0.3 s (threads still running: ")
    assert "held-up" in first and first.endswith("exiting with code 7; their stacks:")
    assert "waiting_for_a_lock" in res.stderr


def test_a_cancelled_guard_does_nothing() -> None:
    res, took = _run(
        "g = ExitGuard(7, 0.3, 'shutdown', last_resort=0.2)\n"
        "g.cancel()\n"
        "time.sleep(1.0)\n"
        "print('still here')\n"
        "sys.exit(3)\n"
    )
    assert res.returncode == 3 and res.stdout == "still here\n", res.stderr
    assert res.stderr == ""
