"""launcher/control/hot_switch.py: the rules (the ranks a request moves, the switch round's
repair plan) and a running controller on an in-memory store: a request starts a switch (the
order and the agents' nudge), the halt waits for the incoming processes, the `hot-switch` round
is uncharged and ends with `switch-done` and the request's outcome; refusals and an abandoned
switch leave the ranks where they were (the pause ended, the outcome written). The live job is
tests/test_migrate.py's."""

from __future__ import annotations

import dataclasses
import time

import pytest
from test_grow import _events, _halt_after, status

from launcher.control.controller import Controller
from launcher.control.controller_settings import ControllerSettings
from launcher.control.fault_intake import post_fault
from launcher.control.hot_switch import ranks_to_move, switch_plan
from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from rendezvous.store.memory import LocalKV


def two_nodes(rank: int) -> int:
    return rank // 2


@pytest.mark.parametrize(
    "ranks, node, moved, why",
    [
        ([1], None, [1], ""),
        ([3, 1, 3], None, [1, 3], ""),
        ([], 1, [2, 3], ""),
        ([0], 1, [0, 2, 3], ""),
        ([4], None, [], "unknown rank(s) [4] (the job's ranks are 0..3)"),
        ([], 2, [], "unknown node 2 (the job's nodes are [0, 1])"),
        ([], None, [], "no rank or node named"),
    ],
)
def test_the_ranks_a_request_moves(ranks, node, moved, why) -> None:
    req = P.MigrateRequest(seq=1, ranks=ranks, node=node)
    assert ranks_to_move(req, 4, two_nodes) == (moved, why)


def test_the_switch_round_sends_a_replicas_state_to_the_moved_ranks_only() -> None:
    sts = [status(0, 1), status(1, 1, back=True), status(2, 1), status(3, 1)]
    repair, why = switch_plan(sts, 1, [1])
    assert why == "" and repair.pairs == [[0, 1]]
    assert (repair.resume_step, repair.action) == (6, "commit")  # the step after the halt
    _, why = switch_plan([status(r, 1) for r in range(4)], 1, [1])
    assert "ranks [1] report a state of their own" in why
    lone = [status(0, 1), status(1, 1, back=True, shard="tp1")]
    _, why = switch_plan(lone, 1, [1])
    assert "no healthy replica" in why


# ---- a running controller -------------------------------------------------------------------
def _controller(kv, tmp_path, phase_timeout: float = 5.0, aware: int = 4) -> Controller:
    for r in range(aware):
        kv.set(P.aware_key(r), b"1")
    log = AgentLog(0, str(tmp_path / "events.jsonl"), quiet=True)
    settings = ControllerSettings(
        4, 1, 3, (P.RECOVER_IN_PLACE, P.EXIT), phase_timeout=phase_timeout, window=0.1
    )
    c = Controller(kv, log, settings)
    c.start()
    return c


def _request(kv, ranks=(1,), node=None) -> int:
    seq = kv.add(P.MIGRATE_SEQ, 1)
    kv.set(P.migrate_key(seq), P.MigrateRequest(seq=seq, ranks=list(ranks), node=node).to_json())
    return seq


def _outcome(kv, seq: int) -> P.SwitchOutcome:
    return P.SwitchOutcome.from_json(kv.get(P.migrate_outcome_key(seq), 10.0))


def test_a_switch_moves_the_rank_uncharged_once_its_new_process_is_ready(tmp_path) -> None:
    kv = LocalKV()
    c = _controller(kv, tmp_path)
    try:
        seq = _request(kv)
        order = P.SwitchOrder.from_json(kv.get(P.SWITCH_KEY, 10.0))
        assert (order.seq, order.generation, order.ranks) == (seq, 1, [1])
        nudge = P.Injection.from_json(kv.get(P.inject_key(1), 1.0))
        assert (nudge.rank, nudge.kind) == (P.EVERY_RANK, P.SWITCH_KIND)
        time.sleep(0.5)
        assert kv.try_get(P.PAUSE_KEY) is None  # no halt before the new process is ready
        halted = _halt_after(kv, 5, ranks=(0, 1, 2, 3))
        kv.set(P.status_key(1, 1), status(1, 1, back=True).to_json())
        plan = P.Plan.from_json(kv.get(P.plan_key(1), 10.0))
        halted.join(5.0)
        assert plan.strategy == P.SWITCH and plan.restart_ranks == [1] and plan.failed_ranks == []
        assert plan.restarts_used == 0 and plan.history == []  # not charged, no fault
        for r in (0, 2, 3):
            kv.set(P.status_key(1, r), status(r, 1).to_json())
        rp = P.RepairPlan.from_json(kv.get(P.repair_key(1), 10.0))
        assert rp.pairs == [[0, 1]] and (rp.resume_step, rp.action) == (6, "commit")
        out = _outcome(kv, seq)
        assert (out.outcome, out.ranks, out.generation) == ("done", [1], 1) and out.cost_s > 0
        assert kv.try_get(P.resume_key(1)).startswith(b"done: hot switch #1")  # pause ended
        done = _events(tmp_path, "switch-done")
        assert len(done) == 1 and done[0]["moved"] == [1] and done[0]["sources"] == [0]
    finally:
        c.stop()


@pytest.mark.parametrize(
    "ranks, node, aware, paused, because",
    [
        ([7], None, 4, False, "unknown rank(s) [7]"),
        ([], 3, 4, False, "unknown node 3 (the job's nodes are [0])"),
        ([1], None, 3, False, "not every rank uses launcher.runtime"),
        ([1], None, 4, True, "pause #1"),
        ([], 0, 4, False, "every rank would move: no replica would be left"),
    ],
)
def test_a_request_that_cannot_be_carried_out_is_refused(
    tmp_path, ranks, node, aware, paused, because
) -> None:
    kv = LocalKV()
    if paused:
        kv.add(P.PAUSE_SEQ, 1)
        kv.set(P.PAUSE_KEY, P.PauseRequest(seq=1, max_s=60).to_json())
    c = _controller(kv, tmp_path, aware=aware)
    try:
        out = _outcome(kv, _request(kv, ranks, node))
        assert out.outcome == "refused" and because in out.why, out.why
        assert kv.try_get(P.SWITCH_KEY) is None and kv.try_get(P.plan_key(1)) is None
    finally:
        c.stop()
    [line] = _events(tmp_path, "switch-abandoned")
    assert "refused" in line["message"]


def test_a_new_process_that_ended_abandons_the_switch_and_the_pause(tmp_path) -> None:
    kv = LocalKV()
    c = _controller(kv, tmp_path)
    try:
        seq = _request(kv)
        kv.get(P.SWITCH_KEY, 10.0)
        kv.set(P.status_key(1, 1), status(1, 1, back=True).to_json())
        kv.get(P.PAUSE_KEY, 10.0)  # ready: the halt is requested; ranks 2 and 3 never halt
        kv.set(P.switch_ended_key(seq), b"rank 1's new process ended")
        out = _outcome(kv, seq)
        assert out.outcome == "abandoned" and out.why == "rank 1's new process ended"
        ended = kv.get(P.resume_key(1), 1.0)
        assert ended.startswith(b"abandoned: hot switch #1")  # the ranks go on
        assert kv.try_get(P.plan_key(1)) is None
        # the next request is taken: the controller is free again
        seq2 = _request(kv, [2])
        assert P.SwitchOrder.from_json(kv.get(P.SWITCH_KEY, 10.0)).seq in (seq2, seq)
        deadline = time.monotonic() + 10
        while P.SwitchOrder.from_json(kv.get(P.SWITCH_KEY, 1.0)).seq != seq2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        c.stop()


def test_a_fault_during_the_preparation_comes_first(tmp_path) -> None:
    kv = LocalKV()
    c = _controller(kv, tmp_path)
    try:
        seq = _request(kv)
        kv.get(P.SWITCH_KEY, 10.0)
        post_fault(kv, P.Fault(kind="signal", rank=2, node=0, generation=0, message="killed"))
        plan = P.Plan.from_json(kv.get(P.plan_key(1), 10.0))
        assert plan.strategy == P.RECOVER_IN_PLACE
        out = _outcome(kv, seq)
        assert out.outcome == "abandoned" and "a recovery round came first" in out.why
        assert kv.try_get(P.switch_ended_key(seq)) is not None  # the agents stop theirs
    finally:
        c.stop()


def test_a_switch_round_taken_up_by_a_successor_answers_its_request(tmp_path) -> None:
    """The leader is lost after the switch plan: the successor drives the round and writes the
    request's outcome, so the request is not carried out a second time."""
    kv = LocalKV()
    seq = _request(kv)
    cause = P.Fault(kind="migrate", rank=1, node=0, generation=0, evidence={"migrate": seq})
    plan = P.Plan(
        generation=1,
        strategy=P.SWITCH,
        restart_ranks=[1],
        root_cause=dataclasses.asdict(cause),
    )
    kv.set(P.plan_key(1), plan.to_json())
    kv.set(P.GENERATION_KEY, b"1")
    c = _controller(kv, tmp_path)
    try:
        for r in range(4):
            kv.set(P.status_key(1, r), status(r, 1, back=r == 1).to_json())
        rp = P.RepairPlan.from_json(kv.get(P.repair_key(1), 10.0))
        assert rp.pairs == [[0, 1]]
        out = _outcome(kv, seq)
        assert (out.outcome, out.ranks, out.generation) == ("done", [1], 1)
        time.sleep(0.5)
        assert kv.try_get(P.SWITCH_KEY) is None  # not started again
    finally:
        c.stop()


def test_a_fault_during_the_switch_round_supersedes_it_and_says_so(tmp_path) -> None:
    kv = LocalKV()
    c = _controller(kv, tmp_path)
    try:
        seq = _request(kv)
        kv.get(P.SWITCH_KEY, 10.0)
        halted = _halt_after(kv, 5, ranks=(0, 1, 2, 3))
        kv.set(P.status_key(1, 1), status(1, 1, back=True).to_json())
        assert P.Plan.from_json(kv.get(P.plan_key(1), 10.0)).strategy == P.SWITCH
        halted.join(5.0)
        post_fault(kv, P.Fault(kind="signal", rank=2, node=0, generation=1, message="killed"))
        assert P.Plan.from_json(kv.get(P.plan_key(2), 10.0)).strategy == P.RECOVER_IN_PLACE
        for r in range(4):  # the recovery round repairs rank 1's new process too
            kv.set(P.status_key(2, r), status(r, 2, back=r in (1, 2)).to_json())
        out = _outcome(kv, seq)
        assert out.outcome == "abandoned", out
        assert "a recovery round (now generation 2 (recover-in-place)) superseded" in out.why
    finally:
        c.stop()
    [line] = [e for e in _events(tmp_path, "switch-abandoned")]
    assert line["message"].endswith("ranks [1] are repaired by that round")
