"""tests/helpers_launch.py: what the end-to-end tests read back from a run."""

from __future__ import annotations

from helpers_launch import spawned_pids


def test_a_spare_that_overtook_a_cold_replacement_takes_its_place_in_the_pids() -> None:
    evs = [
        {"event": "spawn", "rank": 0, "pid": 10},
        {"event": "spawn", "rank": 1, "pid": 11},
        {"event": "spawn", "rank": 1, "pid": 21, "replacement": True},
        {"event": "spawn", "rank": 1, "pid": 31, "replacement": True, "overtook": 21},
        {"event": "spawn", "rank": 1, "pid": 41, "replacement": True},
        {"event": "hello", "rank": 1, "pid": 41},
    ]
    assert spawned_pids(evs) == {0: [10], 1: [11, 31, 41]}
