"""Freezing a cold replacement while the agent decides whether a spare takes its rank."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from launcher.workers.overtake import all_stopped, freeze, kill_frozen, thaw


def _session_child(tmp_path) -> subprocess.Popen:
    """A process in its own session (as a worker is) that counts in a file."""
    counter = tmp_path / "count"
    code = (
        "import threading, time\n"
        "def tick():\n"
        "    n = 0\n"
        "    while True:\n"
        f"        n += 1; open({str(counter)!r}, 'w').write(str(n)); time.sleep(0.01)\n"
        "threading.Thread(target=tick, daemon=True).start()\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 30
    while not counter.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc


def test_a_frozen_process_stops_every_thread_until_thawed_and_dies_of_a_kill(tmp_path) -> None:
    proc = _session_child(tmp_path)
    counter = tmp_path / "count"
    try:
        assert freeze(proc.pid) and all_stopped(proc.pid)
        before = counter.read_text()
        time.sleep(0.1)
        assert counter.read_text() == before  # its other thread stopped too
        thaw(proc.pid)
        deadline = time.monotonic() + 5
        while counter.read_text() == before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert counter.read_text() != before and not all_stopped(proc.pid)
        assert freeze(proc.pid)
        kill_frozen(proc.pid)
        assert proc.wait(timeout=5) == -9
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_process_that_is_gone_cannot_be_frozen() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait(timeout=30)
    assert not freeze(proc.pid) and not all_stopped(proc.pid)
    assert not os.path.exists(f"/proc/{proc.pid}/task") or not all_stopped(proc.pid)
