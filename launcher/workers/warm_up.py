"""The warm-up priorities of a spare pool's processes.

Owns: `WarmUps`, owned by the spare pool (`launcher.workers.spare.SparePool`): which of its
processes (spares that import torch, forked spares that prepare, the fork server) still run at
the idle warm-up priority and the agent's niceness each returns to; `escalate` moves one that
warmed up longer than the pool's idle limit to the agent's priority (on a node whose training
keeps every CPU busy SCHED_IDLE may never get time: a spare still importing torch at the next
fault makes it start cold, 0.8-2.5 s lost), `hurry` moves them all at once.
"""

from __future__ import annotations

import time
from typing import Protocol

from launcher.workers.priority import run_priority


class Proc(Protocol):
    pid: int

    def poll(self) -> int | None: ...


class WarmUps:
    """pid -> (start of its warm-up, the agent's niceness to return to; None: returned)."""

    def __init__(self, idle_limit: float) -> None:
        if idle_limit < 0:
            raise ValueError(f"idle_limit {idle_limit} must be >= 0")
        self.idle_limit = idle_limit
        self._born: dict[int, tuple[float, int | None]] = {}

    def add(self, pid: int, base: int | None) -> None:
        """Process `pid` starts warming up now, to return to niceness `base` (None: it runs at
        the agent's priority already)."""
        self._born[pid] = (time.monotonic(), base)

    def pop(self, pid: int) -> int | None:
        """Forget `pid`: the niceness it was to return to (None: it has already)."""
        return self._born.pop(pid, (0.0, None))[1]

    def escalate(self, procs: list, now: float | None = None) -> None:
        """Each of `procs` alive and warming up for `idle_limit` s goes on at the agent's
        priority."""
        now = time.monotonic() if now is None else now
        for proc in procs:
            born, base = self._born.get(proc.pid, (now, None))
            if base is not None and now - born >= self.idle_limit and proc.poll() is None:
                run_priority(base, proc.pid)
                self._born[proc.pid] = (born, None)

    def hurry(self, procs: list) -> None:
        """Each of `procs` alive and warming up goes on at the agent's priority now."""
        self.escalate(procs, now=float("inf"))

    def clear(self) -> None:
        self._born.clear()
