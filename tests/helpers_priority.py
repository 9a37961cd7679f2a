"""Helpers for tests of the spare pool's CPU priorities."""

from __future__ import annotations

import os


def nice_and_policy(pid: int) -> tuple[int, int] | None:
    """(niceness, scheduling policy) of process `pid`'s main thread; None once it is gone."""
    try:
        return os.getpriority(os.PRIO_PROCESS, pid), os.sched_getscheduler(pid)
    except OSError:
        return None
