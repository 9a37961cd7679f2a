"""Helpers for tests that watch a process's state in /proc (stopped, zombie, gone)."""

from __future__ import annotations

import time


def proc_state(pid: int) -> str | None:
    """A process's state letter (R, S, T, Z, ...), None once it is gone (reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def settles(pid: int, stopped: bool, timeout: float = 10.0) -> bool:
    """Whether the process is (or is no longer) stopped within `timeout` s: a signal's delivery
    is asynchronous."""
    deadline = time.monotonic() + timeout
    while (proc_state(pid) == "T") != stopped:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
