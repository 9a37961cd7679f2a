"""launcher/protocol/budget.py: the one rule for the restart budget's rounds left."""

from __future__ import annotations

from launcher.control.decision import Budget
from launcher.protocol.budget import restarts_left


def test_restarts_left_counts_down_to_zero_and_never_below() -> None:
    assert restarts_left(0, 3) == 3
    assert restarts_left(2, 3) == 1
    assert restarts_left(3, 3) == 0
    assert restarts_left(5, 3) == 0  # more charged than allowed (a limit lowered): none left
    assert restarts_left(0, 0) == 0


def test_the_controllers_budget_agrees() -> None:
    for used, limit in ((0, 0), (0, 1), (1, 1), (2, 5), (6, 5)):
        assert Budget(used, limit).left == (restarts_left(used, limit) > 0)
