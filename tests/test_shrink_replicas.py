"""launcher.control.shrink_replicas: an elastic-training decision drops the failed ranks' whole
data-parallel replicas, read from the shards the ranks published."""

from __future__ import annotations

from launcher.control.decision import Decision
from launcher.control.shrink_replicas import dp_replicas, whole_replicas, widened
from launcher.protocol import plan as P
from launcher.runtime.replicas import Layout
from rendezvous.store.memory import LocalKV


def _shards(layout: Layout) -> dict[int, str]:
    return {r: layout.shard_of(r) for r in range(layout.world_size)}


def test_the_replicas_of_a_megatron_grid_are_its_data_parallel_slices() -> None:
    grid = Layout.from_parallel(8, dp=2, tp=2, pp=2)  # rank = p*4 + d*2 + t
    assert dp_replicas(_shards(grid)) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert dp_replicas(_shards(Layout.ddp(3))) == [[0], [1], [2]]
    uneven = Layout.from_groups([[0, 1], [2]], 3)
    assert not uneven.shrinks_by_replicas() and dp_replicas(_shards(uneven)) == []
    assert grid.shrinks_by_replicas() and Layout.ddp(3).shrinks_by_replicas()
    assert not Layout.from_parallel(4, dp=4, optimizer_shards=2).shrinks_by_replicas()


def test_failed_ranks_widen_to_their_whole_replicas() -> None:
    replicas = [[0, 1], [2, 3], [4, 5]]
    assert widened([3], replicas) == [2, 3]
    assert widened([1, 4], replicas) == [0, 1, 4, 5]
    assert widened([3], []) == [3]


def _kv(layout: Layout | None) -> LocalKV:
    kv = LocalKV()
    for r, shard in (_shards(layout) if layout else {}).items():
        kv.set(P.replica_key(r), shard.encode())
    return kv


def test_an_elastic_decision_names_the_whole_replica_and_others_are_kept() -> None:
    d = Decision(P.ELASTIC, "rank 3 died", failed_ranks=(3,), charged=True)
    got = whole_replicas(d, _kv(Layout.from_parallel(4, dp=2, tp=2)), 4)
    assert got.failed_ranks == (2, 3) and "whole data-parallel replicas" in got.reason
    assert whole_replicas(d, _kv(Layout.ddp(4)), 4) == d  # plain DDP: the rank is its replica
    assert whole_replicas(d, _kv(None), 4) == d  # no layout published: nothing widened
    other = Decision(P.RECOVER_IN_PLACE, "restart it", failed_ranks=(3,), restart_ranks=(3,))
    assert whole_replicas(other, _kv(Layout.from_parallel(4, dp=2, tp=2)), 4) == other
