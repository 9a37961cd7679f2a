"""The hang watch: progress (not liveness) resets a rank's clock; waiting ranks are spared."""
from __future__ import annotations

from launcher.hang_watch import HangWatch
from launcher.messages import Heartbeat


def beat(rank=1, step=3, phase="forward", committed=2, waiting=False) -> Heartbeat:
    return Heartbeat(rank=rank, step=step, phase=phase, committed_step=committed, waiting=waiting)


def test_only_progress_resets_the_clock() -> None:
    h = HangWatch(timeout=10.0)
    h.on_heartbeat(beat(), now=100.0)
    h.on_heartbeat(beat(), now=108.0)  # alive, same place: no progress
    assert h.overdue([1], now=109.0) == []
    assert h.overdue([1], now=111.0) == [(1, 11.0)]
    h.on_heartbeat(beat(phase="backward"), now=111.5)
    assert h.overdue([1], now=112.0) == []
    assert h.overdue([2], now=500.0) == []  # a rank without heartbeats has no clock


def test_waiting_and_untimed_phases_are_not_hangs() -> None:
    h = HangWatch(timeout=1.0)
    h.on_heartbeat(beat(waiting=True), now=0.0)
    assert h.overdue([1], now=50.0) == []  # blocked on a peer inside a collective
    h.on_heartbeat(beat(step=4, waiting=False), now=60.0)
    assert h.overdue([1], now=62.0) == [(1, 2.0)]
    for phase in ("init", "recovering", "checkpoint", "done"):
        h.on_heartbeat(beat(step=5, phase=phase), now=70.0)
        assert h.overdue([1], now=100.0) == [], phase


def test_a_new_process_or_a_goodbye_stops_the_clock_and_zero_turns_it_off() -> None:
    h = HangWatch(timeout=1.0)
    h.on_heartbeat(beat(), now=0.0)
    h.forget(1)
    assert h.overdue([1], now=10.0) == []
    h.on_heartbeat(beat(), now=20.0)  # the same mark counts as progress for the new process
    assert h.overdue([1], now=22.0) == [(1, 2.0)]
    h.stop_clock(1)
    assert h.overdue([1], now=30.0) == []
    off = HangWatch(timeout=0.0)
    off.on_heartbeat(beat(), now=0.0)
    assert not off.enabled and off.overdue([1], now=1e9) == []


def test_a_killed_rank_exits_as_a_hang_once() -> None:
    h = HangWatch(timeout=1.0)
    h.on_heartbeat(beat(), now=0.0)
    h.killed(1)
    assert h.overdue([1], now=10.0) == []  # not killed twice
    assert h.take_killed(1) and not h.take_killed(1) and not h.take_killed(2)
