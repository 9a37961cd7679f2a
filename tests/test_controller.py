"""The controller's decisions and round driving, on an in-process store (LocalKV)."""

from __future__ import annotations

import threading
import time

import pytest

from launcher.control import controller_state as CS
from launcher.control.controller import Controller
from launcher.control.controller_settings import ControllerHooks, ControllerSettings
from launcher.control.fault_intake import post_fault
from launcher.control.progress import ProgressBoard
from launcher.control.round_phase import RoundPhase
from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from rendezvous.store.memory import LocalKV


@pytest.fixture()
def kv():
    return LocalKV()


HOOKS = ("stale", "fence", "new_round", "waiting")


def controller(kv, log, world_size, nnodes, max_restarts, chain, **kw) -> Controller:
    """A Controller of `world_size` ranks on `nnodes` nodes; `kw`: the other settings and hooks
    (ControllerSettings and ControllerHooks fields) by name."""
    hooks = ControllerHooks(**{k: kw.pop(k) for k in HOOKS if k in kw})
    settings = ControllerSettings(world_size, nnodes, max_restarts, tuple(chain), **kw)
    return Controller(kv, log, settings, hooks)


def make(kv, world=4, max_restarts=3, chain=None, tmp_path=None, window=2.0) -> Controller:
    log = AgentLog(0, None, quiet=True)
    c = controller(
        kv,
        log,
        world,
        1,
        max_restarts,
        chain or [P.RETRY, P.RECOVER_IN_PLACE, P.RESTART_ALL, P.EXIT],
        phase_timeout=5.0,
        window=window,
    )
    c.start()
    return c


def plan_of(kv, g: int) -> P.Plan:
    return P.Plan.from_json(kv.get(P.plan_key(g), 10.0))


def fault(rank=1, kind="signal", gen=0) -> P.Fault:
    return P.Fault(kind=kind, rank=rank, node=0, generation=gen, message="x")


def test_unmodified_job_restarts_all_and_clears_worker_keys(kv) -> None:
    c = make(kv)
    try:
        kv.set("worker/key", b"stale")
        post_fault(kv, fault())
        p = plan_of(kv, 1)
        assert (
            p.strategy == P.RESTART_ALL and p.restart_ranks == [0, 1, 2, 3] and p.restarts_used == 1
        )
        assert kv.try_get(P.go_key(1)) is None  # not released before every node stopped
        kv.add(P.stopped_key(1), 1)
        kv.set(P.all_stopped_key(1), b"1")
        assert kv.wait([P.go_key(1)], 10.0)
        assert kv.try_get("worker/key") is None and kv.try_get(P.GENERATION_KEY) == b"1"
    finally:
        c.stop()


def test_runtime_job_recovers_in_place_and_plans_repair(kv) -> None:
    for r in range(4):
        kv.set(P.aware_key(r), b"1")
    c = make(kv)
    try:
        post_fault(kv, fault(rank=2))
        p = plan_of(kv, 1)
        assert p.strategy == P.RECOVER_IN_PLACE and p.restart_ranks == [2]
        for r in range(4):
            st = P.RankStatus(
                rank=r,
                generation=1,
                replacement=(r == 2),
                committed_step=-1 if r == 2 else 6,
                step=-1 if r == 2 else 7,
                shard="dp",
            )
            kv.set(P.status_key(1, r), st.to_json())
        rp = P.RepairPlan.from_json(kv.get(P.repair_key(1), 10.0))
        assert (
            rp.pairs == [[0, 2]]
            and rp.resume_step == 7
            and rp.action == "rollback"
            and not rp.fallback
        )
    finally:
        c.stop()


def test_no_healthy_replica_falls_back_to_restart_all(kv) -> None:
    for r in range(2):
        kv.set(P.aware_key(r), b"1")
    c = make(kv, world=2)
    try:
        post_fault(kv, fault(rank=1))
        assert plan_of(kv, 1).strategy == P.RECOVER_IN_PLACE
        kv.set(P.all_stopped_key(2), b"1")  # the agents' part of the fallback round
        kv.set(P.status_key(1, 0), P.RankStatus(0, 1, False, 3, 4, shard="a").to_json())
        kv.set(P.status_key(1, 1), P.RankStatus(1, 1, True, -1, -1, shard="b").to_json())
        p2 = plan_of(kv, 2)
        assert p2.strategy == P.RESTART_ALL and "fallback" in p2.reason
        assert p2.restarts_used == 1  # the fallback does not charge the budget twice
    finally:
        c.stop()


def test_budget_spent_exits_and_stale_faults_are_absorbed(kv) -> None:
    c = make(kv, max_restarts=0)
    try:
        post_fault(kv, fault(rank=1))
        p = plan_of(kv, 1)
        assert p.strategy == P.EXIT and p.root_cause["rank"] == 1
        post_fault(kv, fault(rank=0, gen=0))  # a bystander of generation 0: absorbed
        post_fault(kv, fault(rank=3, gen=1))
        assert plan_of(kv, 2).failed_ranks == [3]
        assert kv.try_get(P.plan_key(3)) is None
    finally:
        c.stop()


def test_a_fault_during_status_collection_supersedes_the_round(kv) -> None:
    for r in range(4):
        kv.set(P.aware_key(r), b"1")
    c = make(kv)
    try:
        post_fault(kv, fault(rank=2, kind="uce-low"))
        assert plan_of(kv, 1).strategy == P.RETRY
        kv.set(P.status_key(1, 0), P.RankStatus(0, 1, False, 4, 5, shard="dp").to_json())
        post_fault(kv, fault(rank=3, kind="network", gen=1))  # rank 3 fails mid-recovery
        p2 = plan_of(kv, 2)
        assert (
            p2.strategy == P.RECOVER_IN_PLACE
            and p2.failed_ranks == [2, 3]
            and p2.restart_ranks == [3]
        )
        assert (
            p2.restarts_used == 2 and kv.try_get(P.repair_key(1)) is None
        )  # round 1 never completes
        post_fault(kv, fault(rank=3, kind="signal", gen=1))  # its late exit report: part of round 2
        for r in range(4):
            kv.set(
                P.status_key(2, r),
                P.RankStatus(
                    r, 2, r == 3, -1 if r == 3 else 4, 5, dirty=(r == 2), shard="dp"
                ).to_json(),
            )
        rp = P.RepairPlan.from_json(kv.get(P.repair_key(2), 10.0))
        assert rp.pairs == [[0, 2], [0, 3]] and rp.resume_step == 5
        assert c.round is not None and not c.round.collecting
        assert c.round.generation == 2 and c.phase is RoundPhase.DONE
        assert kv.try_get(P.plan_key(3)) is None
    finally:
        c.stop()


def test_dump_round_names_the_step_and_the_writer_of_each_shard(kv) -> None:
    for r in range(4):
        kv.set(P.aware_key(r), b"1")
    c = make(kv, chain=[P.DUMP, P.EXIT])
    try:
        post_fault(kv, fault(rank=1))
        p = plan_of(kv, 1)
        assert p.strategy == P.DUMP and p.restarts_used == 0 and p.restart_ranks == []
        shards = {0: "a", 2: "b", 3: "b"}
        for r, shard in shards.items():
            kv.set(
                P.status_key(1, r),
                P.RankStatus(r, 1, False, 6 if r != 3 else 5, 7, shard=shard).to_json(),
            )
        rp = P.RepairPlan.from_json(kv.get(P.repair_key(1), 10.0))
        assert rp.fallback == P.DUMP and rp.resume_step == 7 and rp.writers == {"a": 0, "b": 2}
    finally:
        c.stop()


def net(rank: int, gen: int = 0) -> P.Fault:
    return P.Fault(
        kind="network",
        rank=rank,
        node=0,
        generation=gen,
        message="all_reduce timed out",
        evidence={"collective": "gradient all_reduce"},
    )


def board(kv, idle: dict[int, float], waiting: set[int]) -> None:
    ProgressBoard(kv, 0).publish(
        {
            r: {
                "aware": True,
                "phase": "forward",
                "waiting": r in waiting,
                "idle_s": t,
                "silent_s": 0.3,
                "state": "S",
                "pid": 100 + r,
                "local_rank": r,
            }
            for r, t in idle.items()
        }
    )


def test_survivors_timing_out_in_one_collective_are_one_hang_of_the_rank_they_wait_on(kv) -> None:
    for r in range(4):
        kv.set(P.aware_key(r), b"1")
    board(kv, {0: 9.0, 1: 12.0, 2: 9.0, 3: 8.8}, waiting={0, 2, 3})
    c = make(kv)
    try:
        for r in (3, 2, 0):
            post_fault(kv, net(r))
        p = plan_of(kv, 1)
        assert (p.strategy, p.failed_ranks, p.restart_ranks) == (P.RECOVER_IN_PLACE, [1], [1])
        assert (
            p.root_cause["kind"] == "hang" and p.root_cause["pid"] == 101 and p.restarts_used == 1
        )
        for r in range(4):
            kv.set(
                P.status_key(1, r),
                P.RankStatus(r, 1, r == 1, -1 if r == 1 else 4, 5, shard="dp").to_json(),
            )
        assert kv.wait([P.repair_key(1)], 10.0)
        assert kv.try_get(P.plan_key(2)) is None  # one event, one round
        assert [h["outcome"] for h in c.history] == ["recovered"]
    finally:
        c.stop()


def test_unexplained_collective_reports_in_one_window_are_one_network_fault(kv) -> None:
    for r in range(4):
        kv.set(P.aware_key(r), b"1")
    board(kv, {r: 5.0 for r in range(4)}, waiting={0, 1, 2, 3})
    c = make(kv, window=1.0)
    try:
        post_fault(kv, net(2))
        post_fault(kv, net(0))
        p = plan_of(kv, 1)
        assert (
            p.strategy == P.RETRY
            and p.root_cause["rank"] == 2
            and p.root_cause["kind"] == "network"
        )
        assert [x["rank"] for x in p.root_cause["evidence"]["consequences"]] == [0]
        assert p.history[-1]["consequences"] == 1
        post_fault(kv, net(3))  # from generation 0, after round 1 began: a consequence of its stop
        for r in range(4):
            kv.set(P.status_key(1, r), P.RankStatus(r, 1, False, 4, 5, shard="dp").to_json())
        assert kv.wait([P.repair_key(1)], 10.0)
        assert kv.try_get(P.plan_key(2)) is None
    finally:
        c.stop()


def test_the_exit_plan_names_the_fault_that_ended_the_job_and_the_history(kv) -> None:
    for r in range(4):
        kv.set(P.aware_key(r), b"1")
    c = make(kv, max_restarts=1)
    try:
        post_fault(kv, fault(rank=2, kind="uce-low"))
        assert plan_of(kv, 1).strategy == P.RETRY
        for r in range(4):
            kv.set(P.status_key(1, r), P.RankStatus(r, 1, False, 4, 5, shard="dp").to_json())
        assert kv.wait([P.repair_key(1)], 10.0)
        post_fault(kv, fault(rank=1, kind="hang", gen=1))
        p = plan_of(kv, 2)
        assert p.strategy == P.EXIT and p.root_cause["rank"] == 1 and p.root_cause["kind"] == "hang"
        assert [(h["rank"], h["kind"], h["handling"], h["outcome"][:7]) for h in p.history] == [
            (2, "uce-low", [[P.RETRY, 1]], "recover"),
            (1, "hang", [[P.EXIT, 2]], "failed:"),
        ]
    finally:
        c.stop()


def _two_nodes(kv, node_replace_timeout: float) -> Controller:
    for r in range(4):
        kv.set(P.aware_key(r), b"1")
    c = controller(
        kv,
        AgentLog(0, None, quiet=True),
        4,
        2,
        3,
        [P.RETRY, P.RECOVER_IN_PLACE, P.RESTART_ALL, P.EXIT],
        phase_timeout=0.5,
        window=0.1,
        node_replace_timeout=node_replace_timeout,
        min_nodes=2,
    )
    c.start()
    return c


def test_a_lost_node_is_repaired_from_peers_once_its_new_agent_arrives(kv) -> None:
    c = _two_nodes(kv, node_replace_timeout=30.0)
    try:
        c.note_node(1, lost=True, why="no heartbeat for 2s")
        p1 = plan_of(kv, 1)
        assert p1.strategy == P.RECOVER_IN_PLACE and p1.failed_ranks == [2, 3]
        assert p1.restart_ranks == [] and p1.root_cause["kind"] == "node-lost"
        for r in (0, 1):  # the survivors report; node 1's ranks cannot, yet
            kv.set(P.status_key(1, r), P.RankStatus(r, 1, False, 4, 5, shard="dp").to_json())
        time.sleep(1.5)  # longer than the phase timeout: the round still waits for node 1
        assert kv.try_get(P.plan_key(2)) is None and kv.try_get(P.repair_key(1)) is None
        c.note_node(1, lost=False)
        post_fault(
            kv,
            P.Fault(
                kind="node-lost",
                rank=None,
                node=1,
                generation=1,
                message="spare",
                evidence={"node_joined": True, "node_ranks": [2, 3]},
            ),
        )
        p2 = plan_of(kv, 2)
        assert p2.strategy == P.RECOVER_IN_PLACE and p2.restart_ranks == [2, 3]
        assert p2.restarts_used == 1  # the arrival continues the loss's round
        for r in range(4):
            st = P.RankStatus(r, 2, r >= 2, -1 if r >= 2 else 4, -1 if r >= 2 else 5, shard="dp")
            kv.set(P.status_key(2, r), st.to_json())
        rp = P.RepairPlan.from_json(kv.get(P.repair_key(2), 10.0))
        assert rp.pairs == [[0, 2], [0, 3]] and not rp.fallback
    finally:
        c.stop()


def test_a_lost_node_not_taken_over_within_the_timeout_ends_the_job(kv) -> None:
    c = _two_nodes(kv, node_replace_timeout=1.0)
    try:
        c.note_node(1, lost=True, why="its etcd lease expired (TTL 5s)")
        c.note_node(1, lost=True, why="again")  # news of the same loss: one fault
        assert plan_of(kv, 1).strategy == P.RECOVER_IN_PLACE
        for r in (0, 1):
            kv.set(P.status_key(1, r), P.RankStatus(r, 1, False, 4, 5, shard="dp").to_json())
        p2 = plan_of(kv, 2)
        assert p2.strategy == P.EXIT and p2.failed_ranks == [2, 3]
        assert p2.reason.startswith("node 1 lost (its etcd lease expired (TTL 5s)): no hot spare")
        assert kv.try_get(P.FAULT_SEQ) == b"1"
    finally:
        c.stop()


def _three_nodes(kv, new_round) -> Controller:
    """3 nodes of 2 unmodified ranks, --nnodes 2:3, node_replace_timeout 0.5 s."""
    c = controller(
        kv,
        AgentLog(0, None, quiet=True),
        6,
        3,
        3,
        [P.RETRY, P.RECOVER_IN_PLACE, P.RESTART_ALL, P.EXIT],
        phase_timeout=0.5,
        window=0.1,
        node_replace_timeout=0.5,
        min_nodes=2,
        new_round=new_round,
    )
    c.start()
    return c


def test_a_lost_node_not_taken_over_shrinks_the_world_in_a_new_rendezvous_round(kv) -> None:
    asked: list[int] = []
    c = _three_nodes(kv, lambda: asked.append(1) or 1)
    try:
        c.note_node(1, lost=True, why="no heartbeat for 2s")
        p = plan_of(kv, 1)  # the loss itself waits (unmodified workers); the timeout shrinks
        assert asked == [1] and p.new_round == 1 and p.strategy == P.RESTART_ALL
        assert p.failed_ranks == [2, 3] and p.restart_ranks == [0, 1, 2, 3]
        assert p.restarts_used == 1 and kv.try_get(P.RESTARTS_USED_KEY) == b"1"
        assert p.reason.endswith("continuing on 2 node(s): world size 6 -> 4 (restart-all)")
        assert kv.try_get(P.go_key(1)) is None  # the agents restart in the new round, no barrier
        assert c.phase is RoundPhase.REGROUPING  # this world ends
    finally:
        c.stop()


def test_a_static_world_or_a_round_that_cannot_start_ends_the_job(kv) -> None:
    from rendezvous.errors import RendezvousError

    def refuse() -> int:
        raise RendezvousError("the world is already retired")

    for new_round, needle in (
        (None, "a static rendezvous (--node-rank) cannot renumber"),
        (refuse, "the new rendezvous round could not start: the world"),
    ):
        for k in kv.keys(""):
            kv.delete(k)
        c = _three_nodes(kv, new_round)
        try:
            c.note_node(1, lost=True, why="no heartbeat for 2s")
            p = plan_of(kv, 1)
            assert p.strategy == P.EXIT and p.new_round == 0 and needle in p.reason, p.reason
            assert p.restarts_used == 0
        finally:
            c.stop()


def test_scale_up_restart_opens_a_round_for_a_waiting_node_uncharged(kv) -> None:
    asked: list[int] = []
    waiting = [0]
    c = controller(
        kv,
        AgentLog(0, None, quiet=True),
        4,
        2,
        3,
        [P.RETRY, P.RECOVER_IN_PLACE, P.RESTART_ALL, P.EXIT],
        phase_timeout=0.5,
        window=0.1,
        min_nodes=2,
        new_round=lambda: asked.append(1) or 1,
        waiting=lambda: waiting[0],
        max_nodes=3,
    )
    c.start()
    try:
        time.sleep(0.7)
        assert kv.try_get(P.plan_key(1)) is None and not asked  # nobody waits
        waiting[0] = 1
        p = plan_of(kv, 1)
        assert p.strategy == P.RESTART_ALL and p.new_round == 1 and asked == [1]
        assert p.restarts_used == 0 and "2 -> 3 node(s), world size 4 -> 6" in p.reason
        time.sleep(1.2)
        assert asked == [1] and kv.try_get(P.plan_key(2)) is None  # once per world
    finally:
        c.stop()


def test_a_report_of_a_stale_agent_is_refused_and_logged(kv, tmp_path) -> None:
    """A fault stamped by an agent incarnation that is no longer a member (cut off, declared
    dead, replaced) starts no round; the next live report does."""
    log = AgentLog(0, str(tmp_path / "events.jsonl"), quiet=True)
    stale = {(1, 1)}
    c = controller(
        kv,
        log,
        4,
        2,
        3,
        [P.RETRY, P.RECOVER_IN_PLACE, P.RESTART_ALL, P.EXIT],
        phase_timeout=5.0,
        window=0.1,
        stale=lambda n, i: "declared dead" if (n, i) in stale else "",
    )
    c.start()
    try:
        old = fault(rank=1)
        old.by_node, old.by_incarnation = 1, 1
        post_fault(kv, old)
        live = fault(rank=2)
        live.by_node, live.by_incarnation = 1, 2
        post_fault(kv, live)
        p = plan_of(kv, 1)
        assert p.failed_ranks == [2]  # the stale report of rank 1 decided nothing
        assert kv.try_get(P.plan_key(2)) is None
    finally:
        c.stop()
        log.close()
    from launcher.observe.logs import read_event_file

    refused = [
        e
        for e in read_event_file(str(tmp_path / "events.jsonl"))
        if e["event"] == "stale-write-refused"
    ]
    assert len(refused) == 1 and refused[0]["stale_node"] == 1 and refused[0]["incarnation"] == 1
    assert "refused: the writer is stale (declared dead)" in refused[0]["message"]


def test_a_fenced_controller_publishes_nothing_and_stops(kv) -> None:
    from rendezvous.errors import FencedError

    def fence(key: str) -> None:
        raise FencedError(f"node 0 (incarnation 1) is stale: write to {key!r} refused (lost)")

    log = AgentLog(0, None, quiet=True)
    c = controller(kv, log, 4, 1, 3, [P.RESTART_ALL, P.EXIT], phase_timeout=5.0, fence=fence)
    c.start()
    try:
        post_fault(kv, fault(rank=1))
        c._thread.join(5.0)
        assert not c._thread.is_alive()
        assert kv.try_get(P.plan_key(1)) is None and kv.try_get(P.GENERATION_KEY) is None
    finally:
        c.stop()


def test_a_controller_elected_later_goes_on_from_the_next_unread_fault(kv) -> None:
    """A handoff neither replays a decided fault nor skips one posted while there was none."""
    c = make(kv, chain=[P.RESTART_ALL, P.EXIT])
    try:
        post_fault(kv, fault(rank=1))
        assert plan_of(kv, 1).failed_ranks == [1]
    finally:
        c.stop()  # its node is lost
    post_fault(kv, fault(rank=3, gen=1))  # reported while no controller runs
    c2 = make(kv, chain=[P.RESTART_ALL, P.EXIT])
    try:
        p = plan_of(kv, 2)
        assert p.failed_ranks == [3] and p.restarts_used == 2
        assert kv.try_get(P.plan_key(3)) is None
    finally:
        c2.stop()


# ---- handoff: a controller elected on another node goes on from what the lost one left -------
def _node_world(kv, start: bool = True) -> Controller:
    """Two nodes of two ranks (node 0: ranks 0, 1; node 1: ranks 2, 3), runtime-aware."""
    for r in range(4):
        kv.set(P.aware_key(r), b"1")
    c = controller(
        kv,
        AgentLog(0, None, quiet=True),
        4,
        2,
        3,
        [P.RETRY, P.RECOVER_IN_PLACE, P.RESTART_ALL, P.EXIT],
        phase_timeout=5.0,
        window=0.1,
        node_replace_timeout=30.0,
        min_nodes=2,
    )
    if start:
        c.start()
    return c


def test_a_stopped_controller_publishes_no_fallback_for_its_round(kv) -> None:
    """Stopping (deposed, or its agent leaving) ends the round's driving: the successor takes
    it up; it used to publish the fallback's plan on its way out."""
    c = _node_world(kv)
    try:
        post_fault(kv, fault(rank=3, gen=0))
        assert plan_of(kv, 1).strategy == P.RECOVER_IN_PLACE
    finally:
        c.stop()
    assert kv.try_get(P.plan_key(2)) is None and kv.try_get(P.repair_key(1)) is None


def test_a_successor_supersedes_the_round_in_progress_with_the_lost_nodes_ranks(kv) -> None:
    """The controller's node (node 0) died while its recover-in-place round for rank 3 collected
    statuses: the successor takes the round up, and the loss of node 0 supersedes it with a
    new generation whose failed ranks include node 0's. The history goes on too."""
    c1 = _node_world(kv)
    c1.reconcile({0: 1, 1: 1}, [])
    try:
        post_fault(kv, fault(rank=1, kind="exit", gen=0))  # an earlier fault, recovered
        assert plan_of(kv, 1).failed_ranks == [1]
        for r in range(4):
            kv.set(P.status_key(1, r), P.RankStatus(r, 1, r == 1, 4, 5, shard="dp").to_json())
        kv.get(P.repair_key(1), 10.0)
        post_fault(kv, fault(rank=3, kind="exit", gen=1))
        p2 = plan_of(kv, 2)
        assert p2.strategy == P.RECOVER_IN_PLACE and p2.failed_ranks == [3]
        kv.set(P.status_key(2, 2), P.RankStatus(2, 2, False, 6, 7, shard="dp").to_json())
    finally:
        c1.stop()  # its node is lost mid-round
    assert kv.try_get(P.repair_key(2)) is None
    c2 = _node_world(kv, start=False)
    assert c2.round is not None and c2.round.generation == 2 and c2.round.collecting
    assert c2.phase is RoundPhase.COLLECTING and c2.rounds.inherited is not None
    assert [h["rank"] for h in c2.history] == [1, 3] and c2.history[0]["outcome"] == "recovered"
    c2.reconcile({1: 1}, [0])
    c2.start()
    try:
        p3 = plan_of(kv, 3)
        assert p3.strategy == P.RECOVER_IN_PLACE and p3.failed_ranks == [0, 1, 3]
        assert p3.restart_ranks == [] and p3.root_cause["kind"] == "node-lost"
        assert [h["rank"] for h in p3.history] == [1, 3, None]
        assert p3.history[1]["outcome"].startswith("superseded")
    finally:
        c2.stop()


def test_a_successor_finishes_the_round_in_progress_when_nothing_supersedes_it(kv) -> None:
    c1 = _node_world(kv)
    try:
        post_fault(kv, fault(rank=3, kind="exit", gen=0))
        assert plan_of(kv, 1).failed_ranks == [3]
    finally:
        c1.stop()
    c2 = _node_world(kv, start=False)
    c2.reconcile({0: 1, 1: 1}, [])
    c2.start()
    try:
        for r in range(4):
            kv.set(
                P.status_key(1, r),
                P.RankStatus(
                    r, 1, r == 3, -1 if r == 3 else 4, -1 if r == 3 else 5, shard="dp"
                ).to_json(),
            )
        rp = P.RepairPlan.from_json(kv.get(P.repair_key(1), 10.0))
        assert rp.pairs == [[0, 3], [2, 3]] and not rp.fallback  # one replica per node sends
        assert kv.try_get(P.plan_key(2)) is None
    finally:
        c2.stop()


def test_a_successor_takes_up_a_plan_published_before_the_generation_key(kv) -> None:
    """The controller died after writing generation 1's plan (the agents acted on it) but before
    setting the generation key and saving: the successor goes on from that plan (it used to read
    generation 0, publish its own generation 1 over the plan the agents had acted on and never
    take the round up; failed once in CI)."""
    c1 = _node_world(kv)
    try:
        post_fault(kv, fault(rank=3, kind="exit", gen=0))
        p1 = plan_of(kv, 1)
    finally:
        c1.stop()
    kv.delete(P.GENERATION_KEY)  # its last two writes never happened
    kv.delete(CS.STATE_KEY)
    c2 = _node_world(kv, start=False)
    assert c2.state.generation == 1 and kv.get(P.GENERATION_KEY, 1.0) == b"1"
    assert c2.rounds.inherited is not None and c2.round.failed_ranks == (3,)
    assert [h["rank"] for h in c2.history] == [3]
    c2.reconcile({1: 1}, [0])
    c2.start()
    try:
        p2 = plan_of(kv, 2)
        assert p2.failed_ranks == [0, 1, 3] and p2.root_cause["kind"] == "node-lost"
        assert plan_of(kv, 1).to_json() == p1.to_json()  # not overwritten
    finally:
        c2.stop()


def test_a_successor_releases_a_restart_all_round_the_lost_controller_published(kv) -> None:
    c1 = make(kv, chain=[P.RESTART_ALL, P.EXIT])
    try:
        post_fault(kv, fault(rank=1))
        assert plan_of(kv, 1).strategy == P.RESTART_ALL
    finally:
        c1.stop()  # before the nodes stopped: no go
    assert kv.try_get(P.go_key(1)) is None
    c2 = make(kv, chain=[P.RESTART_ALL, P.EXIT])
    try:
        kv.add(P.stopped_key(1), 1)  # the one node stops its workers
        assert kv.get(P.go_key(1), 10.0) == b"1"
        assert kv.try_get(P.plan_key(2)) is None
    finally:
        c2.stop()


def test_a_successor_does_not_report_a_known_loss_again_and_its_timeout_runs_on(kv) -> None:
    c1 = _node_world(kv)
    try:
        c1.note_node(1, lost=True, why="its etcd lease expired (TTL 2s)")
        assert plan_of(kv, 1).failed_ranks == [2, 3]
    finally:
        c1.stop()
    time.sleep(0.3)
    c2 = _node_world(kv, start=False)
    assert c2.lost_nodes == {1}
    at, f = c2.nodes.lost_at[1]
    assert 0.3 <= time.monotonic() - at < 5.0 and f.message == "its etcd lease expired (TTL 2s)"
    c2.reconcile({0: 1}, [1])
    assert kv.try_get(P.FAULT_SEQ) == b"1"  # not reported again


def test_a_node_taken_over_before_the_successor_was_elected_is_reported_to_it(kv) -> None:
    """A hot spare claimed node 0 (incarnation 2) while no controller ran: nobody heard of its
    arrival. The successor compares the membership with the incarnations the lost controller
    accounted for, reports the arrival, and the round starts node 0's ranks on the spare."""
    c1 = _node_world(kv)
    c1.reconcile({0: 1, 1: 1}, [])
    c1.stop()
    c2 = _node_world(kv, start=False)
    assert c2.known == {0: 1, 1: 1}
    c2.reconcile({0: 2, 1: 1}, [])
    c2.start()
    try:
        p1 = plan_of(kv, 1)
        assert p1.strategy == P.RECOVER_IN_PLACE and p1.restart_ranks == [0, 1]
        assert p1.root_cause["evidence"]["node_joined"] and p1.root_cause["node"] == 0
        assert c2.note_arrival(0, 2) is None  # the membership's own news of it: once only
        assert kv.try_get(P.FAULT_SEQ) == b"1"
    finally:
        c2.stop()


def test_an_arrival_brought_by_two_threads_at_once_is_reported_once(kv, monkeypatch) -> None:
    """The successor's reconcile and the membership watch may report the same takeover at the
    same moment; both passed the 'already known?' check before either had posted, and the
    arrival became two faults and two rounds (the spare spawned its rank twice, CI)."""
    import launcher.control.fault_intake as C

    c1 = _node_world(kv)
    c1.reconcile({0: 1, 1: 1}, [])
    c1.stop()
    c2 = _node_world(kv, start=False)
    real, entered = C.post_fault, threading.Barrier(2, timeout=1.0)

    def slow_post(store, fault):
        try:
            entered.wait()  # the second report arrives while the first is being posted
        except threading.BrokenBarrierError:
            pass
        return real(store, fault)

    monkeypatch.setattr(C, "post_fault", slow_post)
    got: list = []
    ts = [
        threading.Thread(target=lambda w=w: got.append(c2.note_arrival(0, 2, why=w)))
        for w in ("watch", "reconcile")
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert sorted(got, key=str) == [1, None] and kv.try_get(P.FAULT_SEQ) == b"1"
    assert c2.known[0] == 2 and not c2.nodes.arriving


def test_a_controller_of_a_new_world_keeps_the_history_but_not_the_old_worlds_nodes(kv) -> None:
    """After the world shrank (a restart-all plan into a new rendezvous round) node ranks are
    renumbered: the first controller of the new world does not take the old world's lost nodes
    or incarnations, nor the regroup plan as a round to drive; the history goes on."""
    from launcher.control.decision import Decision

    c1 = _node_world(kv, start=False)
    c1.reconcile({0: 1, 1: 1}, [])
    c1.note_node(1, lost=True, why="no heartbeat for 2s")
    cause = P.Fault(
        kind="node-lost",
        rank=None,
        node=1,
        generation=0,
        message="lost",
        evidence={"node_lost": True, "node_ranks": [2, 3]},
    )
    c1.publish(Decision(P.RESTART_ALL, "shrink", cause, (2, 3), (0, 1), charged=True), new_round=1)
    c2 = controller(
        kv,
        AgentLog(0, None, quiet=True),
        2,
        1,
        3,
        [P.RETRY, P.RECOVER_IN_PLACE, P.RESTART_ALL, P.EXIT],
        phase_timeout=5.0,
        window=0.1,
        world_round=1,
    )
    assert c2.lost_nodes == set() and c2.known == {} and not c2.handoff.unfinished(plan_of(kv, 1))
    assert [h["node"] for h in c2.history] == [1]
    c3 = controller(
        kv, AgentLog(0, None, quiet=True), 4, 2, 3, [P.RESTART_ALL, P.EXIT], world_round=0
    )  # a controller of the old world would have them
    assert c3.lost_nodes == {1} and c3.known == {0: 1, 1: 1}


# ---------------------------------------------------------------- peers that finished the job
def _finished_world(kv, tmp_path, phase_timeout: float = 120.0) -> tuple[Controller, AgentLog]:
    for r in range(4):
        kv.set(P.aware_key(r), b"1")
    log = AgentLog(0, str(tmp_path / "events.jsonl"), quiet=True)
    c = controller(
        kv,
        log,
        4,
        1,
        3,
        [P.RETRY, P.RECOVER_IN_PLACE, P.RESTART_ALL, P.EXIT],
        phase_timeout=phase_timeout,
        window=0.1,
    )
    c.start()
    return c, log


def _events(tmp_path, name: str) -> list[dict]:
    from launcher.observe.logs import read_event_file

    return [e for e in read_event_file(str(tmp_path / "events.jsonl")) if e["event"] == name]


def test_a_rank_failing_after_its_peers_finished_restarts_all_at_once_saying_why(
    kv, tmp_path
) -> None:
    c, log = _finished_world(kv, tmp_path)
    try:
        for r in (0, 2, 3):
            kv.set(P.finished_key(r), b"0")  # their agents saw them finish in generation 0
        f = fault(rank=1)
        f.message = "Signal 6 (SIGABRT) received by PID 42"
        t0 = time.monotonic()
        post_fault(kv, f)
        p = plan_of(kv, 1)
        assert time.monotonic() - t0 < 5.0
        assert p.strategy == P.RESTART_ALL and p.restarts_used == 1 and p.failed_ranks == [1]
        assert "ranks [0, 2, 3] already finished the job" in p.reason, p.reason
    finally:
        c.stop()
        log.close()
    line = _events(tmp_path, "peers-finished")
    assert len(line) == 1 and line[0]["finished_ranks"] == [0, 2, 3] and line[0]["rank"] == 1
    assert line[0]["message"].startswith("rank 1 (generation 0) failed: signal: Signal 6 (SIGABRT)")


def test_peers_finishing_while_the_replacement_waits_end_the_round_at_once(kv, tmp_path) -> None:
    """The stop came after the survivors' last step: they finish instead of reporting; the
    round falls back at once, not after the phase timeout (the replacement's plan never comes)."""
    c, log = _finished_world(kv, tmp_path, phase_timeout=120.0)
    try:
        post_fault(kv, fault(rank=1))
        assert plan_of(kv, 1).strategy == P.RECOVER_IN_PLACE
        kv.set(P.status_key(1, 1), P.RankStatus(1, 1, True, -1, -1, shard="dp").to_json())
        time.sleep(0.5)
        assert kv.try_get(P.plan_key(2)) is None  # nobody finished yet: the round waits
        t0 = time.monotonic()
        for r in (0, 2, 3):
            kv.set(P.finished_key(r), b"0")
        p2 = plan_of(kv, 2)
        assert time.monotonic() - t0 < 5.0
        assert p2.strategy == P.RESTART_ALL and p2.restarts_used == 1  # not charged again
        assert "ranks [0, 2, 3] finished the job instead of reporting their status" in p2.reason
        assert kv.try_get(P.repair_key(1)) is None
    finally:
        c.stop()
        log.close()
    (line,) = _events(tmp_path, "peers-finished")
    assert (line["rank"], line["generation"], line["round"], line["finished_ranks"]) == (
        1,
        0,
        1,
        [0, 2, 3],
    )
    assert "finished the job during generation 1's recovery round" in line["message"], line
    (fell,) = _events(tmp_path, "fallback")
    assert fell["round_phase"] == "collecting"  # the phase the round fell back from
    assert [e["round_phase"] for e in _events(tmp_path, "plan")] == [
        "collecting",
        "waiting-for-stop",
    ]


def test_a_finished_mark_of_an_earlier_process_of_the_rank_is_stale(kv, tmp_path) -> None:
    c, log = _finished_world(kv, tmp_path)
    try:
        for r in (0, 2, 3):
            kv.set(P.finished_key(r), b"0")
        post_fault(kv, fault(rank=1))
        assert plan_of(kv, 1).strategy == P.RESTART_ALL  # every rank gets a new process
        kv.set(P.all_stopped_key(1), b"1")
        assert kv.wait([P.go_key(1)], 10.0)
        post_fault(kv, fault(rank=2, gen=1))  # the new processes run: ranks 0 and 3 repair it
        assert plan_of(kv, 2).strategy == P.RECOVER_IN_PLACE
        assert c.finished_ranks() == ()
        kv.set(P.finished_key(3), b"1")  # rank 3's generation-1 process finished
        assert c.finished_ranks() == (3,)
    finally:
        c.stop()
        log.close()


def test_a_fault_during_status_collection_is_seen_within_the_fast_slice(kv) -> None:
    """Issue 32: a rank killed while a round collects statuses supersedes it at once (the status
    wait's slice is short in a round's first second), not at the end of a 0.2 s wait."""
    for r in range(4):
        kv.set(P.aware_key(r), b"1")
    c = make(kv)
    try:
        post_fault(kv, fault(rank=1))
        assert plan_of(kv, 1).failed_ranks == [1]
        time.sleep(0.21)  # a 0.2 s slice would have just begun
        t0 = time.monotonic()
        post_fault(kv, fault(rank=2, gen=1))
        assert plan_of(kv, 2).failed_ranks == [1, 2]
        assert time.monotonic() - t0 < 0.12
    finally:
        c.stop()


@pytest.mark.etcd
def test_a_round_cut_short_by_a_store_error_is_driven_again(tmp_path) -> None:
    """etcd stops answering while the controller collects a round's statuses (its requests
    time out: a StoreError): once it answers again, the controller drives the same round on
    to its repair plan (`Handoff.retake`); it used to go idle and leave the ranks waiting for a
    repair plan until their store timeout (seen in CI: a watch confirmed late)."""
    import signal

    from helpers_etcd import start_etcd

    from launcher.observe.logs import read_event_file
    from rendezvous.store.etcd import EtcdConf, EtcdKV

    srv = start_etcd()
    kv = EtcdKV(srv.endpoint, "/ftrun/retake", EtcdConf(request_timeout=0.5))
    for r in range(4):
        kv.set(P.aware_key(r), b"1")
    events = str(tmp_path / "events.jsonl")
    log = AgentLog(0, events, quiet=True)
    chain = [P.RECOVER_IN_PLACE, P.RESTART_ALL, P.EXIT]
    c = controller(kv, log, 4, 1, 3, chain, phase_timeout=20.0, window=0.1)
    c.start()
    try:
        post_fault(kv, fault(rank=3, kind="exit", gen=0))
        assert plan_of(kv, 1).strategy == P.RECOVER_IN_PLACE
        srv.proc.send_signal(signal.SIGSTOP)  # the controller's status wait times out
        deadline = time.monotonic() + 10.0
        while not any(e["event"] == "controller" for e in read_event_file(events)):
            assert time.monotonic() < deadline, "no store error in the controller"
            time.sleep(0.05)
        srv.proc.send_signal(signal.SIGCONT)
        for r in range(4):
            kv.set(P.status_key(1, r), P.RankStatus(r, 1, r == 3, 4, 5, shard="dp").to_json())
        rp = P.RepairPlan.from_json(kv.get(P.repair_key(1), 10.0))
        assert rp.pairs and not rp.fallback and kv.try_get(P.plan_key(2)) is None
        resumed = [e for e in read_event_file(events) if e["event"] == "round-resumed"]
        assert [(e["generation"], e["retaken"]) for e in resumed] == [(1, True)]
    finally:
        srv.proc.send_signal(signal.SIGCONT)
        c.stop()
        kv.close()
        srv.stop()
