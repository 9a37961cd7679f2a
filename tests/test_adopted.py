"""Adopted children: a subreaper's Popen-like handle for a grandchild, and reaping orphans
without taking the exit status of a child some handle waits for."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from launcher.workers.adopted import AdoptedChild, reap_orphans, set_subreaper


def _orphan(code: int, sleep: float) -> int:
    """Double fork: a session leader A forks B (sleeps, exits `code`) and exits at once; B is
    then our child (we are a subreaper). Returns B's pid once A is reaped."""
    r, w = os.pipe()
    a = os.fork()
    if a == 0:  # pragma: no cover - child
        os.close(r)
        os.setsid()
        b = os.fork()
        if b == 0:
            time.sleep(sleep)
            os._exit(code)
        os.write(w, b.to_bytes(4, "little"))
        os._exit(0)
    os.close(w)
    pid = int.from_bytes(os.read(r, 4), "little")
    os.close(r)
    os.waitpid(a, 0)
    return pid


@pytest.fixture
def subreaper():
    assert set_subreaper(True)
    try:
        yield
    finally:
        set_subreaper(False)


def test_adopted_child_waits_with_a_timeout_and_reports_the_signal_that_killed_it(
    subreaper,
) -> None:
    pid = _orphan(0, 30)
    child = AdoptedChild(pid)
    assert child.poll() is None
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.1)
    assert time.monotonic() - t0 < 1.0
    child.terminate()
    assert child.wait(timeout=5) == -signal.SIGTERM and child.returncode == -15
    child.kill()  # already reaped: nothing is signalled (its pid may belong to another process now)


def test_adopted_child_exit_code(subreaper) -> None:
    child = AdoptedChild(_orphan(7, 0.0))
    assert child.wait(timeout=5) == 7 and child.poll() == 7


def test_reap_orphans_reaps_only_orphans_and_never_a_handled_child(subreaper) -> None:
    orphan = _orphan(3, 0.0)  # a dead worker's child: session of its dead parent
    plain = subprocess.Popen(["sh", "-c", "exit 5"])  # the agent's session
    leader = subprocess.Popen(["sh", "-c", "exit 6"], start_new_session=True)  # like a worker
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        states = {}
        for pid in (orphan, plain.pid, leader.pid):
            with open(f"/proc/{pid}/stat") as f:
                states[pid] = f.read().rsplit(")", 1)[1].split()[0]
        if set(states.values()) == {"Z"}:
            break
        time.sleep(0.01)
    assert reap_orphans() == [(orphan, 3)]
    assert plain.wait(timeout=5) == 5 and leader.wait(timeout=5) == 6  # their status is intact
    assert reap_orphans() == []
