"""Which ranks a live shrink drops: each failed rank's whole data-parallel replica.

Owns: `dp_replicas` (the data-parallel replicas of a job, from the shard each rank published:
`P.replica_key`, see launcher.runtime.replicas) and `whole_replicas` (an elastic-training
decision whose failed ranks are widened to their replicas: the healthy TP/PP peers of a lost
rank leave the world with it, their agents stop them, and the grow back brings them all back).

The rule is the runtime's (`Layout.shrinks_by_replicas`): ranks holding one shard are replicas
of each other, in rank order, and the i-th rank of every shard belongs to data-parallel replica
i (Megatron's grid: tensor-parallel index fastest, then data-parallel). Plain data parallelism
is one shard, so each replica is one rank and nothing is widened. A layout whose shards differ
in size, or a rank whose shard is unknown, widens nothing: the shrink's own check
(launcher.control.shrink) then refuses the world if it is not whole replicas.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

from launcher.control.decision import Decision
from launcher.protocol import plan as P
from rendezvous.kv import KVStore


def dp_replicas(shards: Mapping[int, str]) -> list[list[int]]:
    """The data-parallel replicas (each a list of ranks) of ranks 0..len(shards)-1, from each
    rank's shard name; [] when they are not whole replicas (shards of unequal size)."""
    by_shard: dict[str, list[int]] = {}
    for rank in sorted(shards):
        by_shard.setdefault(shards[rank], []).append(rank)
    sizes = {len(ranks) for ranks in by_shard.values()}
    if len(sizes) != 1:
        return []
    (n,) = sizes
    return [sorted(ranks[i] for ranks in by_shard.values()) for i in range(n)]


def widened(failed: Iterable[int], replicas: list[list[int]]) -> list[int]:
    """`failed` with every rank of their data-parallel replicas."""
    out = set(failed)
    for replica in replicas:
        if out & set(replica):
            out |= set(replica)
    return sorted(out)


def read_shards(kv: KVStore, world_size: int) -> dict[int, str]:
    """Each rank's published shard (empty when a rank has none: no layout is known)."""
    ranks = range(world_size)
    raws = kv.present([P.replica_key(r) for r in ranks])
    if any(raw is None for raw in raws):
        return {}
    return {r: bytes(raw).decode() for r, raw in zip(ranks, raws) if raw is not None}


def whole_replicas(decision: Decision, kv: KVStore, world_size: int) -> Decision:
    """An elastic-training `decision` whose failed ranks are whole data-parallel replicas."""
    if decision.strategy != P.ELASTIC or decision.absorbed or not decision.failed_ranks:
        return decision
    ranks = widened(decision.failed_ranks, dp_replicas(read_shards(kv, world_size)))
    if ranks == sorted(decision.failed_ranks):
        return decision
    return dataclasses.replace(
        decision,
        failed_ranks=tuple(ranks),
        reason=f"{decision.reason}; ranks {ranks} leave: the failed ranks' whole "
        "data-parallel replicas (their tensor/pipeline-parallel peers too)",
    )
