"""The agent's handle on its node's spare fork server: the priority a forked spare is born with."""

from __future__ import annotations

import os
import sys
import time

import pytest
from helpers_priority import nice_and_policy

from launcher.workers.fork_server import ForkServer
from launcher.workers.priority import may_return_to, run_priority


def test_a_forked_spare_escalated_at_once_never_returns_to_idle_priority() -> None:
    """Issue 32: a forked spare set its own warm-up priority (SCHED_IDLE) after it became the
    agent's child. When the pool escalated it first (its idle limit passed while it was not yet
    scheduled, on a node whose ranks kept every CPU busy) the spare demoted itself afterwards and
    stayed at idle priority for good: not ready 6 s into a job, so the replacement received its
    state into unprepared memory (34 ms instead of 13). The spare is now born at the warm-up
    priority (set by its parent before its pid is known), so an escalation is final."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    warm = min(19, base + 10)
    if warm == base or not may_return_to(base) or not hasattr(os, "SCHED_IDLE"):
        pytest.skip("this user may not lower a process's niceness again")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    server = ForkServer(sys.executable, env, (warm, base))
    spares = []
    try:
        assert server.wait_ready(120)
        for _ in range(4):
            proc, ready_fd = server.fork(heap_bytes=128 << 20)
            spares.append((proc, ready_fd))
            os.set_blocking(ready_fd, False)
            assert nice_and_policy(proc.pid) == (warm, os.SCHED_IDLE)  # born warming up
            run_priority(base, proc.pid)  # the pool's escalation, before the spare ran at all
            seen = set()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                got = nice_and_policy(proc.pid)
                if got is not None:
                    seen.add(got)
                try:
                    if os.read(ready_fd, 1):
                        break  # prepared
                except BlockingIOError:
                    pass
                time.sleep(0.001)
            else:
                pytest.fail("the spare did not prepare within 60 s")
            assert seen == {(base, os.SCHED_OTHER)}, seen
    finally:
        for proc, ready_fd in spares:
            proc.kill()
            proc.wait(timeout=30)
            os.close(ready_fd)
        server.stop(lambda m: None, 30)
