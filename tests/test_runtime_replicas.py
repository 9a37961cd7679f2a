"""Replica layouts (pure functions): which ranks hold equal state."""

from __future__ import annotations

import pytest

from launcher.runtime.replicas import Layout, parallel_groups


def test_ddp_layout_every_rank_replicates_every_other():
    lay = Layout.ddp(4)
    assert lay.replicas(3) == (0, 1, 2, 3)
    assert {lay.shard_of(r) for r in range(4)} == {"dp"}
    assert lay.writer_of(2) == 0


def test_parallel_layout_megatron_order_tp_fastest():
    lay = Layout.from_parallel(8, dp=2, tp=4)
    assert lay.replicas(0) == (0, 4)  # seed 004's 8-card example
    assert lay.replicas(5) == (1, 5)
    assert lay.shard_of(6) == "tp2-pp0"
    assert lay.checkpoint_name(6) == "mp_rank_02"
    hybrid = Layout.from_parallel(4, dp=2, tp=2)
    assert [hybrid.replicas(r) for r in range(4)] == [(0, 2), (1, 3), (0, 2), (1, 3)]


def test_parallel_layout_with_pipeline_names_files_like_megatron():
    lay = Layout.from_parallel(8, dp=2, tp=2, pp=2)
    assert lay.replicas(5) == (5, 7)
    assert lay.checkpoint_name(5) == "mp_rank_01_001"


def test_distributed_optimizer_replicas():
    full = Layout.from_parallel(4, dp=4, optimizer_shards=4)  # S == D: no replica at all
    assert all(len(full.replicas(r)) == 1 for r in range(4))
    two = Layout.from_parallel(4, dp=4, optimizer_shards=2)  # 2 instances: d and d+2 agree
    assert two.replicas(0) == (0, 2) and two.replicas(1) == (1, 3)
    assert two.shard_of(1) == "tp0-pp0-os1"


def test_explicit_groups_and_validation():
    lay = Layout.from_groups([[2, 0], [1, 3]], 4)
    assert lay.replicas(2) == (0, 2) and lay.shard_of(3) == "group1"
    with pytest.raises(ValueError, match="partition"):
        Layout.from_groups([[0, 1], [1, 2]], 4)
    with pytest.raises(ValueError, match="must equal world size"):
        Layout.from_parallel(4, dp=3)
    with pytest.raises(ValueError, match="must divide"):
        Layout.from_parallel(4, dp=4, optimizer_shards=3)


def test_parallel_groups():
    g = parallel_groups(4, dp=2, tp=2, pp=1)
    assert (
        g["tp"] == [[0, 1], [2, 3]]
        and g["dp"] == [[0, 2], [1, 3]]
        and g["pp"] == [[0], [1], [2], [3]]
    )
