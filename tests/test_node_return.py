"""launcher.agent.node_return: a lost node's new agent (a hot spare, or the agent restarted)
brings its ranks back through the live grow back when a live shrink dropped them, else awaits
the round of its arrival; which plans published meanwhile are for it."""

from __future__ import annotations

from launcher.agent.node_return import concerns_replacement, dropped_here, nodes_out
from launcher.control import controller_state as CS
from launcher.protocol import plan as P
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
