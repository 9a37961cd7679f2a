"""The controller's own pause at one step boundary, before a round it starts itself.

Owns: `StepHalt`: a live grow back (launcher.control.grow) and a hot switch
(launcher.control.hot_switch) halt the world's ranks at one step boundary before they publish
their round: `request` writes a pause request (the one `ftctl pause` makes: every rank halts
after the same step, no rollback, and marks `plan.pause_halted_key`) and nudges every agent;
`wait` waits for every rank's mark, giving up on a fault that came first (its decision is
returned), on the pause ended by anyone else, on the controller stopping, or after the phase
timeout; `end` ends the pause (the ranks go on, or enter the round that followed).
`OwnRoundParts`: what both of those rounds work with (the controller's store, log, settings,
round tracker, intake, decider, the dropped ranks, its stop event and state save).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from launcher.control.controller_settings import ControllerSettings
from launcher.control.decider import Decider
from launcher.control.decision import Decision
from launcher.control.fault_intake import FaultIntake
from launcher.control.round_phase import RoundTracker
from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from rendezvous.kv import KVStore

HALT_MAX_S = 300.0  # the pause expires after this (a controller gone mid-halt)


@dataclass(frozen=True)
class OwnRoundParts:
    """The controller's parts a round it starts itself (grow back, hot switch) works with."""

    kv: KVStore
    log: AgentLog
    settings: ControllerSettings
    rounds: RoundTracker
    intake: FaultIntake
    decider: Decider
    dropped: set[int]  # the round driver's: ranks live shrinks removed
    stopped: threading.Event  # the controller stops
    save: Callable[[], None]  # the controller's state for a successor (handoff)

    def step_halt(self) -> "StepHalt":
        return StepHalt(
            self.kv, self.intake, self.decider, self.stopped, self.settings.phase_timeout
        )


@dataclass(frozen=True)
class Halted:
    """How a halt ended: `step` every rank halted after; else None, `why` it was not reached
    and, when a fault came first, the controller's decision about it."""

    step: int | None
    why: str = ""
    decision: Decision | None = None


class StepHalt:
    """One controller pause at a time: requested, waited for, ended."""

    def __init__(
        self,
        kv: KVStore,
        intake: FaultIntake,
        decider: Decider,
        stopped: threading.Event,
        timeout: float,
    ) -> None:
        self.kv, self.intake, self.decider = kv, intake, decider
        self.stopped = stopped  # the controller stops
        self.timeout = timeout
        self.seq: int | None = None  # the pause request in effect (its seq), until it ends
        self.t0 = 0.0  # when it was requested
        self.halted_at = 0.0  # when every rank had halted (monotonic; 0: not yet)

    @property
    def active(self) -> bool:
        return self.seq is not None

    def request(self) -> None:
        """Ask every rank to halt after one step (as `ftctl pause`)."""
        kv = self.kv
        seq = kv.add(P.PAUSE_SEQ, 1)
        self.seq, self.t0, self.halted_at = seq, time.monotonic(), 0.0
        kv.set(P.PAUSE_KEY, P.PauseRequest(seq=seq, max_s=HALT_MAX_S).to_json())
        nudge = kv.add(P.INJECT_SEQ, 1)
        kv.set(P.inject_key(nudge), P.Injection(rank=P.EVERY_RANK, kind=P.PAUSE_KIND).to_json())

    def adopt(self, seq: int) -> None:
        """A pause an earlier controller requested and left in effect (its saved state): this
        halt ends it (no-op while one of its own is in effect)."""
        if seq and self.seq is None:
            self.seq, self.t0, self.halted_at = seq, time.monotonic(), 0.0

    def wait(self, ranks: list[int], broken: Callable[[], str] = lambda: "") -> Halted:
        """Every rank of `ranks` halted (the step they halted after), or why not (`broken`:
        the caller's own reason to give up, "" while there is none)."""
        kv, seq = self.kv, self.seq
        assert seq is not None
        keys = [P.pause_halted_key(seq, r) for r in ranks]
        deadline = self.t0 + self.timeout
        while not kv.wait(keys, 0.05):
            fault = self.intake.take(0.0)
            if fault is not None:
                why = f"a fault came first (rank {fault.rank} {fault.kind})"
                return Halted(None, why, self.decider.decide(fault))
            ended = kv.try_get(P.resume_key(seq))
            if ended is not None:
                return Halted(None, f"the pause ended: {ended.decode(errors='replace')}")
            if self.stopped.is_set():
                return Halted(None, "the controller stops")
            why = broken()
            if why:
                return Halted(None, why)
            if time.monotonic() > deadline:
                late = [r for r, k in zip(ranks, keys) if kv.try_get(k) is None]
                return Halted(None, f"ranks {late} did not halt within {self.timeout:.0f}s")
        steps = {int(v) for v in kv.multi_get(keys, 5.0)}
        self.halted_at = time.monotonic()
        return Halted(max(steps))

    def end(self, why: str) -> None:
        """End the pause in effect (no-op without one): the ranks go on, or enter the round."""
        if self.seq is not None:
            self.kv.compare_set(P.resume_key(self.seq), b"", why.encode())
            self.seq = None
