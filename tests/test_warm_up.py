"""Warm-up priorities: a process warming up longer than the idle limit, or hurried, goes on at
the agent's priority; one already there, or gone, is left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from launcher.workers.priority import may_return_to
from launcher.workers.warm_up import WarmUps


def _idle_child() -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )


def test_a_negative_idle_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="idle_limit -1"):
        WarmUps(-1)


def test_escalate_after_the_idle_limit_and_hurry_at_once() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if not may_return_to(base) or base >= 19:
        pytest.skip("this user may not lower a process's niceness again")
    procs = [_idle_child(), _idle_child()]
    try:
        for p in procs:
            os.setpriority(os.PRIO_PROCESS, p.pid, base + 1)
        warm = WarmUps(idle_limit=0.2)
        warm.add(procs[0].pid, base)
        warm.add(procs[1].pid, base)
        warm.escalate(procs)
        assert [os.getpriority(os.PRIO_PROCESS, p.pid) for p in procs] == [base + 1] * 2
        time.sleep(0.25)
        warm.escalate(procs[:1])
        assert os.getpriority(os.PRIO_PROCESS, procs[0].pid) == base
        assert warm.pop(procs[0].pid) is None  # returned: nothing left to return to
        warm.add(procs[1].pid, base)  # a fresh warm-up: not yet past the limit ...
        warm.hurry(procs[1:])  # ... but hurried
        assert os.getpriority(os.PRIO_PROCESS, procs[1].pid) == base
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
