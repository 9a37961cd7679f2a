"""launcher.control.shrink: the ranks of a round after live shrinks, and the rule that turns a
repair plan into a live shrink or a fallback to restart-all (with the reason)."""

from __future__ import annotations

from launcher.control.shrink import after_shrink, members, shrink_plan
from launcher.protocol import plan as P


def status(rank: int, shrinkable: bool = True, shard: str = "dp") -> P.RankStatus:
    return P.RankStatus(
        rank=rank,
        generation=1,
        replacement=False,
        committed_step=2,
        step=3,
        shard=shard,
        shrinkable=shrinkable,
    )


def plan(strategy: str = P.ELASTIC, failed=(3,)) -> P.Plan:
    return P.Plan(generation=1, strategy=strategy, failed_ranks=list(failed))


def repair(**kw) -> P.RepairPlan:
    return P.RepairPlan(generation=1, resume_step=3, action="rollback", **kw)


def test_members_leave_out_dropped_ranks_and_an_elastic_rounds_failed_ones() -> None:
    assert members(4, set(), plan()) == [0, 1, 2]
    assert members(4, {3}, plan(P.RECOVER_IN_PLACE, failed=(1,))) == [0, 1, 2]
    assert members(4, {3}, plan(failed=(0,))) == [1, 2]
    assert members(4, set(), plan(P.RECOVER_IN_PLACE, failed=(1,))) == [0, 1, 2, 3]


def test_a_grow_rounds_members_include_the_returning_ranks() -> None:
    grow = P.Plan(generation=2, strategy=P.GROW, restart_ranks=[3])
    assert members(4, {3}, grow) == [0, 1, 2, 3]
    assert members(4, {1, 3}, grow) == [0, 2, 3]  # rank 1 has not returned


def test_a_shrink_names_the_new_world() -> None:
    got = shrink_plan(repair(), [status(0), status(1), status(2)], [0, 1, 2])
    assert got.world == [0, 1, 2] and got.fallback is None and got.resume_step == 3


def test_a_rank_that_cannot_shrink_makes_it_fall_back_to_restart_all() -> None:
    got = shrink_plan(repair(), [status(0), status(1, shrinkable=False)], [0, 1])
    assert got.fallback == P.RESTART_ALL and got.world == []
    assert got.reason.startswith("no live shrink: ranks [1] cannot continue in a smaller world")


def test_whole_model_parallel_replicas_shrink_and_partial_ones_fall_back() -> None:
    # one rank of each shard left (TP=2: a whole data-parallel replica): a live shrink
    two = shrink_plan(repair(), [status(0, shard="a"), status(1, shard="b")], [0, 1])
    assert two.fallback is None and two.world == [0, 1]
    partial = [status(0, shard="a"), status(1, shard="b"), status(2, shard="a")]
    torn = shrink_plan(repair(), partial, [0, 1, 2])
    assert torn.fallback == P.RESTART_ALL and "not whole data-parallel replicas" in torn.reason


def test_transfers_and_an_empty_world_fall_back() -> None:
    moved = shrink_plan(repair(pairs=[[0, 1]]), [status(0), status(1)], [0, 1])
    assert moved.fallback == P.RESTART_ALL and "need state from each other" in moved.reason
    empty = shrink_plan(repair(), [], [])
    assert empty.fallback == P.RESTART_ALL and "no rank would be left" in empty.reason
    failed = shrink_plan(repair(fallback=P.RESTART_ALL, reason="no healthy replica"), [], [0])
    assert (
        failed.fallback == P.RESTART_ALL and failed.reason == "no live shrink: no healthy replica"
    )


def test_a_later_round_names_the_shrunk_world_and_refuses_a_renumbered_transfer() -> None:
    assert after_shrink(repair(), [0, 1, 2]).world == [0, 1, 2]
    assert after_shrink(repair(pairs=[[0, 2]]), [0, 1, 2]).world == [0, 1, 2]  # same numbers
    moved = after_shrink(repair(pairs=[[0, 3]]), [0, 2, 3])
    assert moved.fallback == P.RESTART_ALL and "not built yet" in moved.reason
