"""The controller's round phases (launcher.control.round_phase): the phase each plan's round
starts in, the phase a successor finds it in, and the changes of phase the tracker allows."""

from __future__ import annotations

import pytest

from launcher.control.decision import Round
from launcher.control.round_phase import (
    RoundPhase,
    RoundPhaseError,
    RoundTracker,
    first_phase,
    found_phase,
)
from launcher.protocol import plan as P


def cause(rank: int | None = 1) -> P.Fault:
    return P.Fault(kind="signal", rank=rank, node=0, generation=0, message="x")


def rnd(g: int = 1, strategy: str = P.RECOVER_IN_PLACE) -> Round:
    return Round(g, strategy, (1,), cause())


def plan(strategy: str, new_round: int = 0) -> P.Plan:
    return P.Plan(generation=1, strategy=strategy, failed_ranks=[1], new_round=new_round)


def test_each_strategy_starts_its_round_in_the_phase_it_waits_in() -> None:
    assert first_phase(P.RETRY) is RoundPhase.COLLECTING
    assert first_phase(P.RECOVER_IN_PLACE) is RoundPhase.COLLECTING
    assert first_phase(P.RESTART_ALL) is RoundPhase.WAITING_FOR_STOP
    assert first_phase(P.DUMP) is RoundPhase.COLLECTING_SURVIVORS
    assert first_phase(P.EXIT) is RoundPhase.DONE
    assert first_phase(P.RESTART_ALL, new_round=True) is RoundPhase.REGROUPING


def test_a_successor_finds_an_unfinished_round_in_its_first_phase_else_done() -> None:
    assert found_phase(plan(P.RECOVER_IN_PLACE), unfinished=True) is RoundPhase.COLLECTING
    assert found_phase(plan(P.RESTART_ALL), unfinished=True) is RoundPhase.WAITING_FOR_STOP
    assert found_phase(plan(P.DUMP), unfinished=True) is RoundPhase.COLLECTING_SURVIVORS
    assert found_phase(plan(P.RECOVER_IN_PLACE), unfinished=False) is RoundPhase.DONE
    # a plan into a new rendezvous round ended with its world: nothing to regroup again
    assert found_phase(plan(P.RESTART_ALL, new_round=1), unfinished=True) is RoundPhase.DONE


def test_only_a_collecting_round_is_collecting_for_the_decision_rules() -> None:
    t = RoundTracker()
    assert t.round is None and t.phase is RoundPhase.IDLE and t.inherited is None
    t.start(rnd(1), RoundPhase.COLLECTING)
    assert t.round is not None and t.round.collecting and t.round.generation == 1
    t.advance(1, RoundPhase.DONE)
    assert t.phase is RoundPhase.DONE and not t.round.collecting
    t.start(rnd(2, P.DUMP), RoundPhase.COLLECTING_SURVIVORS)
    assert not t.round.collecting  # a dump round takes no new failed ranks
    t.start(rnd(3), RoundPhase.COLLECTING)
    t.advance(3, RoundPhase.FELL_BACK)
    assert t.phase is RoundPhase.FELL_BACK and not t.round.collecting


def test_a_phase_ends_only_as_its_rules_say_and_only_for_the_latest_round() -> None:
    t = RoundTracker()
    t.start(rnd(1, P.RESTART_ALL), RoundPhase.WAITING_FOR_STOP)
    with pytest.raises(RoundPhaseError, match="waiting-for-stop does not end in fell-back"):
        t.advance(1, RoundPhase.FELL_BACK)
    t.advance(0, RoundPhase.DONE)  # an older round: nothing changes
    assert t.phase is RoundPhase.WAITING_FOR_STOP
    t.advance(1, RoundPhase.DONE)
    with pytest.raises(RoundPhaseError):
        t.advance(1, RoundPhase.DONE)  # done is done
    t.start(rnd(2), RoundPhase.COLLECTING)  # a newer plan: a new round from any phase
    t.start(rnd(3), RoundPhase.COLLECTING)  # superseding a collecting round
    assert t.round.generation == 3 and t.round.collecting


def test_once_the_world_regroups_only_the_regroup_plan_follows() -> None:
    t = RoundTracker()
    t.start(rnd(1), RoundPhase.COLLECTING)
    t.regroup()
    assert t.regrouping and t.round.generation == 1 and not t.round.collecting
    t.start(rnd(2, P.RESTART_ALL), RoundPhase.REGROUPING)  # the plan into the new round
    assert t.regrouping and t.round.generation == 2 and not t.round.collecting
    with pytest.raises(RoundPhaseError, match="no collecting round once this world regroups"):
        t.start(rnd(3), RoundPhase.COLLECTING)
    with pytest.raises(RoundPhaseError):
        t.regroup()


def test_a_world_may_regroup_before_any_round() -> None:
    t = RoundTracker()
    t.regroup()  # scale_up=restart: agents waiting to get in before any fault
    assert t.regrouping and t.round is None
    t.start(rnd(1, P.RESTART_ALL), RoundPhase.REGROUPING)
    assert t.round is not None and t.round.generation == 1
