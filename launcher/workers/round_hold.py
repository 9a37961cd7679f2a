"""A recovery round's hold on the node's warm spares.

Owns: `RoundHold`, owned by the spare pool (`launcher.workers.spare.SparePool`): while a
recovery round of a generation runs on this node, and until its ranks all finished it and
committed the step they resumed at (or a timeout passed), the pool starts no spare and lets
none leave its idle warm-up priority, so no `import torch` or spare preparation runs beside the
state transfer and the redone step on the node's CPUs.
"""

from __future__ import annotations

import time


class RoundHold:
    """The hold of the latest round on this node (none at first)."""

    def __init__(self) -> None:
        self._hold: tuple[int, set[int], float] | None = None  # (generation, ranks, until)
        self._resume: dict[int, int] = {}  # held rank -> the step it must commit to count

    def hold(self, generation: int, ranks: set[int], timeout: float) -> None:
        """Round `generation` runs on this node with `ranks` (none: no hold); `timeout` s."""
        self._hold = (generation, set(ranks), time.monotonic() + timeout) if ranks else None
        self._resume = {}

    def recovered(self, rank: int, generation: int, resume_step: int | None = None) -> None:
        """Rank `rank` finished the round of `generation` (or a later one); with `resume_step`,
        it counts as done once it committed that step (`progressed`)."""
        if self._hold is not None and generation >= self._hold[0] and rank in self._hold[1]:
            if resume_step is None:
                self._done(rank)
            else:
                self._resume[rank] = resume_step

    def progressed(self, rank: int, committed_step: int) -> None:
        """Rank `rank` reports its last committed step."""
        if rank in self._resume and committed_step >= self._resume[rank]:
            self._done(rank)

    def _done(self, rank: int) -> None:
        self._resume.pop(rank, None)
        if self._hold is None:
            return
        self._hold[1].discard(rank)
        if not self._hold[1]:
            self._hold = None

    def held(self) -> bool:
        """Whether a round holds the pool now (a hold past its timeout ends here)."""
        if self._hold is not None and time.monotonic() >= self._hold[2]:
            self._hold = None  # its ranks' later reports no longer count
            self._resume = {}
        return self._hold is not None
