"""launcher.control.world_changes and the decision rules it carries out for a lost node under
elastic-training (issue 33): a running controller on an in-process store (LocalKV), the agents
and ranks played by the test. Two nodes of two ranks: node 1 is lost; its ranks leave the world
live (at once without recover-in-place, else after node_replace_timeout); the node's new agent
is absorbed and its returning processes grow the world back; below --nnodes MIN, or when the
survivors cannot continue in a smaller world, the shrink falls back with one line why."""

from __future__ import annotations

import time

from launcher.control.controller import Controller
from launcher.control.controller_settings import ControllerHooks, ControllerSettings
from launcher.control.fault_intake import post_fault
from launcher.observe.logs import AgentLog, read_event_file
from launcher.protocol import plan as P
from rendezvous.store.memory import LocalKV

ELASTIC = (P.ELASTIC, P.RESTART_ALL, P.EXIT)
WAITING = (P.RECOVER_IN_PLACE, P.ELASTIC, P.RESTART_ALL, P.EXIT)


def status(rank: int, g: int, committed: int = 5, back: bool = False, ok: bool = True):
    return P.RankStatus(
        rank=rank,
        generation=g,
        replacement=back,
        committed_step=-1 if back else committed,
        step=-1 if back else committed,
        shard="dp",
        shrinkable=ok,
    )


def controller(
    kv, tmp_path, chain, nnodes=2, min_nodes=1, replace_s=30.0, new_round=None
) -> Controller:
    world = 2 * nnodes
    for r in range(world):
        kv.set(P.aware_key(r), b"1")
    settings = ControllerSettings(
        world,
        nnodes,
        3,
        chain,
        phase_timeout=5.0,
        window=0.1,
        node_replace_timeout=replace_s,
        min_nodes=min_nodes,
    )
    log = AgentLog(0, str(tmp_path / "events.jsonl"), quiet=True)
    c = Controller(kv, log, settings, ControllerHooks(new_round=new_round))
    c.start()
    return c


def plan_of(kv, g: int) -> P.Plan:
    return P.Plan.from_json(kv.get(P.plan_key(g), 10.0))


def events(tmp_path, name: str) -> list[dict]:
    return [e for e in read_event_file(str(tmp_path / "events.jsonl")) if e["event"] == name]


def arrival(node: int, g: int) -> P.Fault:
    return P.Fault(
        kind="node-lost",
        rank=None,
        node=node,
        generation=g,
        message="hot spare or replacement agent for node 1",
        evidence={"node_joined": True, "node_ranks": [2, 3], "incarnation": 2},
    )


def report(kv, g: int, ranks, **kw) -> None:
    for r in ranks:
        kv.set(P.status_key(g, r), status(r, g, **kw).to_json())


def halt(kv, step: int, ranks) -> None:
    """The survivors halt after `step` at the grow's pause once it is requested."""
    deadline = time.monotonic() + 10.0
    while kv.try_get(P.PAUSE_KEY) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    seq = P.PauseRequest.from_json(kv.get(P.PAUSE_KEY, 1.0)).seq
    for r in ranks:
        kv.set(P.pause_halted_key(seq, r), str(step).encode())


def test_a_lost_node_shrinks_live_at_once_and_grows_back_when_its_agent_returns(tmp_path):
    kv = LocalKV()
    c = controller(kv, tmp_path, ELASTIC, replace_s=0.5)
    try:
        c.note_node(1, lost=True, why="no heartbeat for 2s")
        p1 = plan_of(kv, 1)
        assert (p1.strategy, p1.failed_ranks, p1.restart_ranks) == (P.ELASTIC, [2, 3], [])
        assert "its ranks [2, 3] leave the world at once" in p1.reason
        report(kv, 1, (0, 1), committed=7)
        rp = P.RepairPlan.from_json(kv.get(P.repair_key(1), 10.0))
        assert rp.world == [0, 1] and not rp.fallback and rp.resume_step == 8
        time.sleep(1.0)  # past node_replace_timeout: the shrunk world stays as it is
        assert kv.try_get(P.plan_key(2)) is None and c.driver.dropped == {2, 3}
        assert events(tmp_path, "node-not-replaced")[0]["lost_node"] == 1
        c.note_node(1, lost=False)
        post_fault(kv, arrival(1, 1))  # the node's agent is back: absorbed, no round
        time.sleep(0.5)
        assert kv.try_get(P.plan_key(2)) is None
        absorbed = events(tmp_path, "fault-absorbed")
        assert "come back through the live grow back" in absorbed[-1]["message"]
        report(kv, 2, (2, 3), back=True)  # its returning processes, across hosts
        halt(kv, 9, (0, 1))
        p2 = plan_of(kv, 2)
        assert (p2.strategy, p2.restart_ranks, p2.restarts_used) == (P.GROW, [2, 3], 1)
        report(kv, 2, (0, 1), committed=9)
        rp = P.RepairPlan.from_json(kv.get(P.repair_key(2), 10.0))
        assert rp.world == [0, 1, 2, 3] and sorted(dst for _, dst in rp.pairs) == [2, 3]
        assert c.driver.dropped == set()
        (grow,) = events(tmp_path, "world-grow")
        assert (grow["world_size"], grow["new_world_size"], grow["grown"]) == (2, 4, [2, 3])
    finally:
        c.stop()


def test_with_recover_in_place_first_the_node_waits_then_shrinks_live(tmp_path):
    kv = LocalKV()
    c = controller(kv, tmp_path, WAITING, replace_s=0.8)
    try:
        c.note_node(1, lost=True, why="no heartbeat for 2s")
        p1 = plan_of(kv, 1)
        assert (p1.strategy, p1.failed_ranks) == (P.RECOVER_IN_PLACE, [2, 3])
        report(kv, 1, (0, 1))
        p2 = plan_of(kv, 2)  # node_replace_timeout ran out: no hot spare, no agent
        assert (p2.strategy, p2.failed_ranks, p2.restart_ranks) == (P.ELASTIC, [2, 3], [])
        assert p2.restarts_used == 1  # it continues the loss's round
        assert "within node_replace_timeout=0.8s" in p2.reason and "(live shrink)" in p2.reason
        (said,) = events(tmp_path, "node-shrink")
        assert said["lost_node"] == 1 and said["waited_s"] >= 0.8
        report(kv, 2, (0, 1))
        rp = P.RepairPlan.from_json(kv.get(P.repair_key(2), 10.0))
        assert rp.world == [0, 1] and not rp.fallback
        assert c.driver.dropped == {2, 3}
    finally:
        c.stop()


def test_below_nnodes_min_a_lost_node_does_not_shrink_live_and_the_job_ends(tmp_path):
    kv = LocalKV()
    c = controller(kv, tmp_path, ELASTIC, min_nodes=2, replace_s=0.5)
    try:
        c.note_node(1, lost=True, why="no heartbeat for 2s")
        p1 = plan_of(kv, 1)
        assert p1.strategy == P.EXIT and p1.failed_ranks == [2, 3]
        assert "--nnodes MIN=2 does not allow continuing on 1 node(s)" in p1.reason
    finally:
        c.stop()


def test_survivors_that_cannot_continue_smaller_take_the_restart_all_way(tmp_path):
    """Three nodes, --nnodes 2:3: node 1's live shrink is refused at the repair plan (the
    survivors use rt.ddp, say): the world shrinks by restart-all in a new rendezvous round."""
    kv = LocalKV()
    c = controller(kv, tmp_path, ELASTIC, nnodes=3, min_nodes=2, new_round=lambda: 7)
    try:
        c.note_node(1, lost=True, why="no heartbeat for 2s")
        assert plan_of(kv, 1).strategy == P.ELASTIC
        report(kv, 1, (0, 1, 4, 5), ok=False)
        p2 = plan_of(kv, 2)
        assert (p2.strategy, p2.new_round, p2.restart_ranks) == (P.RESTART_ALL, 7, [0, 1, 2, 3])
        assert p2.restarts_used == 1  # the same fault's handling
        assert p2.reason.startswith("node 1: no live shrink: ranks [0, 1, 4, 5] cannot")
        assert "continuing on 2 node(s): world size 6 -> 4 (restart-all)" in p2.reason
        (refused,) = events(tmp_path, "node-shrink-refused")
        assert refused["lost_node"] == 1
    finally:
        c.stop()
