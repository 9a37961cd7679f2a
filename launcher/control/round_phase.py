"""The phases of the controller's recovery round, and every change of phase, in one place.

Owns: `RoundPhase` and `RoundTracker`, the controller's latest round (`decision.Round`: the
latest plan's generation, strategy, failed ranks and cause) and the phase it is in. A round
starts when its plan is published (or when a controller elected later finds it in the store):

    IDLE --plan--> COLLECTING            process-level: waits for every rank's status
                     |--> DONE            the repair plan is written
                     '--> FELL_BACK       the repair plan names a fallback: its round follows
                   WAITING_FOR_STOP      restart-all: waits for every node to stop its workers
                     '--> DONE            released (`go`)
                   COLLECTING_SURVIVORS  dump: waits for the survivors' statuses
                     '--> DONE            the dying-gasp plan is written
                   DONE                  exit: the agents end the job
    any phase --new rendezvous round--> REGROUPING   shrink or grow: this world ends

A newer plan starts a new round from any phase but REGROUPING (it supersedes a collecting round,
follows a fallback, or follows a finished one). Only a process-level round in COLLECTING is
"collecting" for the decision rules (`Round.collecting`); the tracker keeps the two in step.
"""

from __future__ import annotations

import dataclasses
from enum import Enum

from launcher.control.decision import PROCESS_LEVEL, Round
from launcher.protocol import plan as P


class RoundPhase(str, Enum):
    IDLE = "idle"  # no round yet: the controller waits for a fault report
    COLLECTING = "collecting"  # process-level: waits for every rank's status
    WAITING_FOR_STOP = "waiting-for-stop"  # restart-all: waits for every node to stop
    COLLECTING_SURVIVORS = "collecting-survivors"  # dump: waits for the survivors' statuses
    REGROUPING = "regrouping"  # a new rendezvous round was requested: this world ends
    DONE = "done"  # the round's last key is written (repair plan, go, dump plan), or exit
    FELL_BACK = "fell-back"  # its repair plan names a fallback: the fallback round follows


# Within one round: the phases a phase may end in.
ENDS: dict[RoundPhase, tuple[RoundPhase, ...]] = {
    RoundPhase.COLLECTING: (RoundPhase.DONE, RoundPhase.FELL_BACK),
    RoundPhase.WAITING_FOR_STOP: (RoundPhase.DONE,),
    RoundPhase.COLLECTING_SURVIVORS: (RoundPhase.DONE,),
}


class RoundPhaseError(RuntimeError):
    """A change of phase the round's rules do not allow (a bug in the controller)."""


def first_phase(strategy: str, new_round: bool = False) -> RoundPhase:
    """The phase a round of `strategy` starts in when its plan is published (`new_round`: the
    plan moves the job to a new rendezvous round)."""
    if new_round:
        return RoundPhase.REGROUPING
    if strategy in PROCESS_LEVEL:
        return RoundPhase.COLLECTING
    if strategy == P.RESTART_ALL:
        return RoundPhase.WAITING_FOR_STOP
    if strategy == P.DUMP:
        return RoundPhase.COLLECTING_SURVIVORS
    return RoundPhase.DONE


def found_phase(plan: P.Plan, unfinished: bool) -> RoundPhase:
    """The phase of the round of `plan` as a controller elected later finds it in the store
    (`unfinished`: its last key is not written yet; a new-round plan ended with its world)."""
    if not unfinished or plan.new_round:
        return RoundPhase.DONE
    return first_phase(plan.strategy)


class RoundTracker:
    """The latest round and its phase. Changed only through `start`, `advance` and `regroup`
    (by the controller's thread); read by everyone."""

    def __init__(self) -> None:
        self.round: Round | None = None  # the latest plan's round
        self.phase = RoundPhase.IDLE
        # the plan of the round an earlier controller was driving, until this one takes it up
        self.inherited: P.Plan | None = None

    @property
    def regrouping(self) -> bool:
        """True when this world ends: its agents move to a new rendezvous round."""
        return self.phase is RoundPhase.REGROUPING

    def start(self, rnd: Round, phase: RoundPhase) -> None:
        """A plan was published (or found at a takeover): its round begins in `phase`."""
        if self.regrouping and phase is not RoundPhase.REGROUPING:
            raise RoundPhaseError(
                f"generation {rnd.generation}: no {phase.value} round once this world regroups"
            )
        self._enter(rnd, phase)

    def advance(self, generation: int, phase: RoundPhase) -> None:
        """Round `generation`'s phase ends in `phase` (see `ENDS`); nothing when a newer round
        is the latest."""
        if self.round is None or self.round.generation != generation:
            return
        if phase not in ENDS.get(self.phase, ()):
            raise RoundPhaseError(
                f"generation {generation}: {self.phase.value} does not end in {phase.value}"
            )
        self._enter(self.round, phase)

    def regroup(self) -> None:
        """A new rendezvous round was opened for the next plan: this world ends."""
        if self.regrouping:
            raise RoundPhaseError("this world regroups already")
        if self.round is None:  # no round yet (agents waiting to get in at the job's start)
            self.phase = RoundPhase.REGROUPING
        else:
            self._enter(self.round, RoundPhase.REGROUPING)

    def _enter(self, rnd: Round, phase: RoundPhase) -> None:
        self.round = dataclasses.replace(rnd, collecting=phase is RoundPhase.COLLECTING)
        self.phase = phase
