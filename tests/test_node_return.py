"""launcher.agent.node_return: a lost node's new agent (a hot spare, or the agent restarted)
brings its ranks back through the live grow back when a live shrink dropped them, else awaits
the round of its arrival; which plans published meanwhile are for it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from launcher.agent.node_return import (
    concerns_replacement,
    dropped_here,
    end_out_of_world,
    enter_as_replacement,
    nodes_out,
    ranks_out,
)
from launcher.control import controller_state as CS
from launcher.protocol import plan as P
from launcher.workers.workers import NodeWorkers
from rendezvous.errors import (
    DECLARED_DEAD,
    STORE_UNREACHABLE,
    NodeLostError,
    RendezvousGracefulExit,
)
from rendezvous.store.memory import LocalKV


def plan(g: int, strategy: str, failed=(), cause: dict | None = None) -> P.Plan:
    return P.Plan(
        generation=g,
        strategy=strategy,
        failed_ranks=list(failed),
        restart_ranks=[],
        reason="x",
        root_cause=cause,
    )


def test_ranks_a_live_shrink_dropped_return_through_the_grow_back() -> None:
    kv = LocalKV()
    assert dropped_here(kv, [2, 3], 0, 0) == []  # nothing saved, no plan: the arrival's round
    CS.save(kv, CS.SavedState(CS.take_term(kv), 1, dropped=[2, 3], world_round=4))
    assert dropped_here(kv, [2, 3], 0, 4) == [2, 3]
    assert dropped_here(kv, [2, 3], 0, 5) == []  # another world's record
    assert dropped_here(kv, [0, 1], 0, 4) == []  # another node's ranks
    CS.save(kv, CS.SavedState(CS.take_term(kv), 1, dropped=[3], world_round=4))
    assert dropped_here(kv, [2, 3], 0, 4) == []  # not every rank of the node: its round


def test_the_latest_plan_decides_before_the_controller_saved_it() -> None:
    kv = LocalKV()
    kv.set(P.plan_key(3), plan(3, P.ELASTIC, failed=[2, 3]).to_json())
    assert dropped_here(kv, [2, 3], 3, 0) == [2, 3]  # the shrink's round is still collecting
    CS.save(kv, CS.SavedState(CS.take_term(kv), 3, dropped=[2, 3]))
    kv.set(P.plan_key(4), plan(4, P.RESTART_ALL).to_json())
    assert dropped_here(kv, [2, 3], 4, 0) == []  # a restart-all brings every rank back


def test_which_plans_are_for_an_agent_awaiting_its_round() -> None:
    mine = {"node": 1, "evidence": {"node_joined": True}}
    assert concerns_replacement(plan(2, P.RECOVER_IN_PLACE, cause=mine), 1, [2, 3])
    assert not concerns_replacement(plan(2, P.RECOVER_IN_PLACE, cause=mine), 0, [0, 1])
    assert concerns_replacement(plan(2, P.ELASTIC, failed=[2, 3]), 1, [2, 3])
    assert not concerns_replacement(plan(2, P.ELASTIC, failed=[3]), 1, [2, 3])
    assert not concerns_replacement(plan(2, P.RECOVER_IN_PLACE, failed=[2, 3]), 1, [2, 3])


def test_the_end_barrier_does_not_wait_for_a_node_dropped_whole() -> None:
    kv = LocalKV()
    assert nodes_out(kv, 3, 2, 0) == 0
    CS.save(kv, CS.SavedState(CS.take_term(kv), 1, dropped=[3, 4, 5], world_round=0))
    assert nodes_out(kv, 3, 2, 0) == 1  # node 2 (ranks 4, 5); node 1 still has rank 2
    assert nodes_out(kv, 3, 2, 1) == 0  # another world's record


def _agent_state(left=(2, 3), growing=(), can_elect=False) -> SimpleNamespace:
    """What `ranks_out`/`end_out_of_world` read of an agent's state: node 1, ranks 2 and 3
    (no process running: stop_workers has nothing to stop)."""
    workers = NodeWorkers.create(2, 2)
    workers.left.update(left)
    return SimpleNamespace(
        workers=workers,
        executor=SimpleNamespace(returning=SimpleNamespace(growing=set(growing))),
        stack=SimpleNamespace(can_elect=can_elect),
        world=SimpleNamespace(group_rank=1),
    )


def test_a_node_is_out_of_the_world_when_every_rank_left_and_none_grows_back() -> None:
    assert ranks_out(_agent_state()) == [2, 3]
    assert ranks_out(_agent_state(left=[3])) == []  # rank 2 is still in the world
    assert ranks_out(_agent_state(growing=[3])) == []  # a grow takes rank 3 back


def test_an_agent_out_of_the_world_ends_cleanly_when_the_jobs_store_is_gone() -> None:
    """The job ended (its embedded store stopped answering) with this node's ranks still out
    of the world: the agent ends as the hot spare of a finished job does (exit 0), one line."""
    gone = NodeLostError("could not reach the store for 2s", STORE_UNREACHABLE)
    with pytest.raises(RendezvousGracefulExit) as e:
        end_out_of_world(_agent_state(), gone)
    said = str(e.value)
    assert said.startswith("node 1: its ranks [2, 3] are no longer in the world")
    assert "the job ended without them (could not reach the store for 2s)" in said
    # otherwise the agent self-fences and rejoins as usual: no end here
    end_out_of_world(_agent_state(left=[3]), gone)  # a rank of the node is in the world
    end_out_of_world(_agent_state(growing=[2]), gone)  # a grow takes them back
    end_out_of_world(_agent_state(), NodeLostError("declared dead", DECLARED_DEAD))
    end_out_of_world(_agent_state(), None)
    end_out_of_world(_agent_state(can_elect=True), gone)  # etcd: the store outlives a node


def test_a_returned_agent_with_elastic_grow_0_ends_at_once() -> None:
    """Its ranks left the world and elastic_grow=0 keeps the world shrunk: nothing brings them
    back, so the agent ends when it joins (one line, exit 0), starting no process."""
    kv = LocalKV()
    CS.save(kv, CS.SavedState(CS.take_term(kv), 1, dropped=[2, 3], world_round=0))
    started: list[list[int]] = []
    s = _agent_state(left=())
    s.kv, s.generation, s.controller = kv, 1, None
    s.stack.world_round = lambda: 0
    s.executor.returning.enabled = False
    s.executor.returning.rejoin = lambda ranks, target: started.append(ranks)
    with pytest.raises(RendezvousGracefulExit) as e:
        enter_as_replacement(s, SimpleNamespace(group_rank=1), lambda node: None)
    assert str(e.value) == (
        "replacement agent for node 1: its ranks [2, 3] left the world in a live shrink and "
        "elastic_grow=0 keeps the world shrunk: they are no longer in the world"
    )
    assert started == []
