"""spare_process: the agent's settings a spare gets in its command line, and its assignment."""

from __future__ import annotations

import json

from launcher.workers.spare_process import NICE_FLAG, job_nice, nice_args, parse_nice


def test_the_priorities_the_agent_writes_are_the_ones_the_spare_reads() -> None:
    args = nice_args(10, 0)
    assert args[0] == NICE_FLAG
    assert parse_nice(args[1]) == (10, 0)
    assert parse_nice(nice_args(-5, -15)[1]) == (-5, -15)


def test_an_assignment_asks_for_its_own_niceness_or_gets_the_agents() -> None:
    assert job_nice(json.dumps({"env": {}, "nice": -10}), 0) == -10
    assert job_nice(json.dumps({"env": {}, "nice": None}), 3) == 3
    assert job_nice(json.dumps({"env": {}}), 3) == 3
    assert job_nice("not json", 5) == 5
    assert job_nice(json.dumps([1, 2]), 5) == 5  # not an object
