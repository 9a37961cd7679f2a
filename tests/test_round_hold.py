"""The recovery round's hold on the spare pool: held until every rank of the round finished it
and committed the step it resumed at, or the timeout."""

from __future__ import annotations

import time

from launcher.workers.round_hold import RoundHold


def test_the_hold_lasts_until_every_rank_committed_its_resume_step() -> None:
    hold = RoundHold()
    assert not hold.held()
    hold.hold(5, {0, 1}, timeout=60)
    hold.recovered(0, 4)  # an older round's report does not count
    hold.recovered(0, 5)
    assert hold.held()
    hold.recovered(1, 6, resume_step=9)  # a later round covers this one; then its step
    hold.progressed(1, 8)
    assert hold.held()
    hold.progressed(1, 9)
    assert not hold.held()


def test_a_hold_ends_at_its_timeout_and_an_empty_round_holds_nothing() -> None:
    hold = RoundHold()
    hold.hold(1, set(), timeout=60)
    assert not hold.held()
    hold.hold(2, {3}, timeout=0.02)
    hold.recovered(3, 2, resume_step=4)
    time.sleep(0.03)
    assert not hold.held()
    hold.progressed(3, 4)  # a late report after the timeout changes nothing
    assert not hold.held()
