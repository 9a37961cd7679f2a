"""The escalation policy: which strategy of the chain handles which fault."""
from __future__ import annotations

import pytest

from launcher import plan as P
from launcher.faults import FaultKind, pick_strategy

DEFAULT = [P.RETRY, P.RECOVER_IN_PLACE, P.RESTART_ALL, P.EXIT]


@pytest.mark.parametrize("kind, expected", [
    (FaultKind.UCE_LOW, P.RETRY), (FaultKind.UCE_HIGH, P.RETRY), (FaultKind.NETWORK, P.RETRY),
    (FaultKind.SIGNAL, P.RECOVER_IN_PLACE), (FaultKind.EXIT, P.RECOVER_IN_PLACE),
    (FaultKind.HANG, P.RECOVER_IN_PLACE), (FaultKind.EXCEPTION, P.RECOVER_IN_PLACE),
])
def test_cheapest_strategy_per_kind(kind: FaultKind, expected: str) -> None:
    assert pick_strategy(kind, DEFAULT, runtime_aware=True, budget_left=True)[0] == expected


def test_unmodified_scripts_get_torchrun_semantics() -> None:
    s, why = pick_strategy(FaultKind.SIGNAL, DEFAULT, runtime_aware=False, budget_left=True)
    assert s == P.RESTART_ALL and "launcher.runtime" in why


def test_chain_falls_through_when_earlier_strategies_are_disabled() -> None:
    assert pick_strategy(FaultKind.UCE_LOW, [P.RECOVER_IN_PLACE, P.EXIT], True, True)[0] == P.RECOVER_IN_PLACE
    assert pick_strategy(FaultKind.UCE_LOW, [P.RESTART_ALL, P.EXIT], True, True)[0] == P.RESTART_ALL
    assert pick_strategy(FaultKind.UCE_LOW, [P.DUMP, P.EXIT], True, True)[0] == P.DUMP
    assert pick_strategy(FaultKind.UCE_LOW, [P.EXIT], True, True)[0] == P.EXIT


def test_budget_spent_skips_restarts_and_says_why() -> None:
    s, why = pick_strategy(FaultKind.SIGNAL, [P.RECOVER_IN_PLACE, P.RESTART_ALL, P.DUMP, P.EXIT], True, False)
    assert s == P.DUMP and "budget" in why
    s, why = pick_strategy(FaultKind.SIGNAL, DEFAULT, True, False)
    assert s == P.EXIT and "budget" in why


def test_repeat_uce_is_not_retried_in_place() -> None:
    s, why = pick_strategy(FaultKind.UCE_LOW, DEFAULT, True, True, repeat_uce=True)
    assert s == P.RECOVER_IN_PLACE and "24 h" in why
