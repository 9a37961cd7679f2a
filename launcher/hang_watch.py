"""Hang detection for runtime-aware ranks: a progress clock per rank, fed by its heartbeats.

Owns: for each local rank, when its heartbeat last showed progress (a new step, phase or committed
step; mere liveness does not count), whether it says it waits on its peers inside a collective,
the phases that are not timed (start-up, recovery and checkpoint writes are bounded by the
runtime's own timeouts), `overdue()`: the ranks whose clock ran past the timeout, and the ranks
it had killed, so that their exit is reported as a hang. The agent acts on what it returns
(stack dump, kill); `--hang-timeout 0` turns the check off.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from launcher.messages import Heartbeat

UNTIMED_PHASES = frozenset({"init", "recovering", "checkpoint", "done"})


@dataclass
class HangWatch:
    timeout: float  # seconds without progress; <= 0: off
    _last_progress: dict[int, float] = field(default_factory=dict)  # rank -> time.time()
    _progress: dict[int, tuple] = field(default_factory=dict)  # rank -> its last progress mark
    _waiting: dict[int, bool] = field(default_factory=dict)  # rank -> blocked on its peers
    _killed: set[int] = field(default_factory=set)

    @property
    def enabled(self) -> bool:
        return self.timeout > 0

    def on_heartbeat(self, hb: Heartbeat, now: float | None = None) -> None:
        rank = hb.rank
        self._waiting[rank] = hb.waiting
        mark = hb.progress()
        if self._progress.get(rank) != mark:  # progress, not mere liveness, resets the clock
            self._progress[rank] = mark
            self._last_progress[rank] = time.time() if now is None else now
        if hb.phase in UNTIMED_PHASES:
            self._last_progress.pop(rank, None)  # the clock only runs while the worker trains

    def stop_clock(self, rank: int) -> None:
        """The rank said goodbye: it is not training any more."""
        self._last_progress.pop(rank, None)

    def forget(self, rank: int) -> None:
        """The rank got a new process: its clock starts with that process's first heartbeat."""
        self._last_progress.pop(rank, None)
        self._progress.pop(rank, None)
        self._waiting.pop(rank, None)

    def overdue(self, ranks: list[int], now: float | None = None) -> list[tuple[int, float]]:
        """(rank, seconds idle) for every rank of `ranks` past the timeout. A rank blocked in a
        collective waits on a peer (a hung one, or one still recovering): not hung itself; the
        collective's own timeout (FTRUN_STORE_TIMEOUT) bounds that wait."""
        if not self.enabled:
            return []
        now = time.time() if now is None else now
        out = []
        for rank in ranks:
            last = self._last_progress.get(rank)
            if last is None or self._waiting.get(rank):
                continue
            if now - last > self.timeout:
                out.append((rank, now - last))
        return out

    def killed(self, rank: int) -> None:
        """The agent kills `rank` for hanging: its exit is a hang, not a signal."""
        self._killed.add(rank)
        self._last_progress.pop(rank, None)

    def take_killed(self, rank: int) -> bool:
        """Whether the exit of `rank` is the hang kill (asked once per exit)."""
        if rank in self._killed:
            self._killed.discard(rank)
            return True
        return False
