"""Replica identity.

Owns: which ranks hold equal state (a `Layout`: plain DDP, explicit replica groups, or a
Megatron-style DP x TP x PP grid with an optional distributed optimizer) and the rank groups of
such a grid (`parallel_groups`). Each rank reports its layout's shard in its `RankStatus`; the
controller plans the repair from those reports (`launcher.control.repair_planning`).

Replica rules (seed 004 / Megatron): ranks that differ only in their data-parallel index hold
the same weights, optimizer state, RNG streams and global data position. With a distributed
optimizer split into `optimizer_shards` pieces inside each DP group, only ranks holding the same
optimizer shard are replicas; `optimizer_shards == dp` means no replica at all.
Rank order is Megatron's default: tensor-parallel index fastest, then data-parallel, then
pipeline (`rank = pp * dp * tp + d * tp + t`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Layout:
    """A partition of ranks 0..world_size-1 into replica groups, one shard name per group."""

    world_size: int
    groups: tuple[tuple[int, ...], ...]
    names: tuple[str, ...]
    checkpoint_names: tuple[str, ...]  # per group: directory name of its durable checkpoint file

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be >= 1")
        seen: list[int] = sorted(r for g in self.groups for r in g)
        if seen != list(range(self.world_size)):
            raise ValueError(
                f"replica groups {[list(g) for g in self.groups]} must partition ranks "
                f"0..{self.world_size - 1}, each rank exactly once"
            )
        if len(self.names) != len(self.groups) or len(set(self.names)) != len(self.names):
            raise ValueError(f"shard names {list(self.names)} must be unique, one per group")
        if len(self.checkpoint_names) != len(self.groups):
            raise ValueError("one checkpoint name per replica group is required")

    @classmethod
    def ddp(cls, world_size: int) -> "Layout":
        """Plain data parallelism: every rank is a replica of every other."""
        return cls(world_size, (tuple(range(world_size)),), ("dp",), ("mp_rank_00",))

    @classmethod
    def from_groups(cls, groups: Sequence[Sequence[int]], world_size: int) -> "Layout":
        """Explicit replica groups, e.g. [[0, 2], [1, 3]]; group i is shard "group{i}"."""
        if not groups:
            raise ValueError("replica groups must not be empty")
        norm = tuple(tuple(sorted(int(r) for r in g)) for g in groups)
        if any(not g for g in norm):
            raise ValueError(f"replica group list {groups!r} contains an empty group")
        names = tuple(f"group{i}" for i in range(len(norm)))
        return cls(world_size, norm, names, tuple(f"mp_rank_{i:02d}" for i in range(len(norm))))

    @classmethod
    def from_parallel(
        cls, world_size: int, dp: int, tp: int = 1, pp: int = 1, optimizer_shards: int = 1
    ) -> "Layout":
        """Megatron-style grid. `optimizer_shards` = how many pieces a distributed optimizer
        splits its state into inside each DP group (1 = no distributed optimizer)."""
        for name, v in (("dp", dp), ("tp", tp), ("pp", pp), ("optimizer_shards", optimizer_shards)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if dp * tp * pp != world_size:
            raise ValueError(
                f"dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp} must equal world size {world_size}"
            )
        if dp % optimizer_shards:
            raise ValueError(f"optimizer_shards={optimizer_shards} must divide dp={dp}")
        members: dict[tuple[int, int, int], list[int]] = {}
        for rank in range(world_size):
            t, d, p = rank % tp, (rank // tp) % dp, rank // (tp * dp)
            members.setdefault((p, t, d % optimizer_shards), []).append(rank)
        keys = sorted(members, key=lambda k: min(members[k]))
        names, ckpt = [], []
        for p, t, s in keys:
            name = f"tp{t}-pp{p}" + (f"-os{s}" if optimizer_shards > 1 else "")
            names.append(name)
            base = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
            ckpt.append(base + (f"_os{s:03d}" if optimizer_shards > 1 else ""))
        return cls(world_size, tuple(tuple(members[k]) for k in keys), tuple(names), tuple(ckpt))

    def shrinks_by_replicas(self) -> bool:
        """Whether a live shrink can drop whole data-parallel replicas: every replica group has
        the same size and the i-th member of each belongs to data-parallel replica i (no
        distributed optimizer splitting the replicas). launcher.control.shrink_replicas reads
        the replicas the same way from the shards the ranks publish."""
        sizes = {len(g) for g in self.groups}
        return len(sizes) == 1 and not any("-os" in name for name in self.names)

    def group_index(self, rank: int) -> int:
        for i, g in enumerate(self.groups):
            if rank in g:
                return i
        raise ValueError(f"rank {rank} is outside world size {self.world_size}")

    def shard_of(self, rank: int) -> str:
        return self.names[self.group_index(rank)]

    def replicas(self, rank: int) -> tuple[int, ...]:
        return self.groups[self.group_index(rank)]

    def checkpoint_name(self, rank: int) -> str:
        return self.checkpoint_names[self.group_index(rank)]

    def writer_of(self, rank: int) -> int:
        """The rank that writes this rank's shard to a durable checkpoint (lowest replica)."""
        return min(self.replicas(rank))


def parallel_groups(world_size: int, dp: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """The communication groups of a DP x TP x PP grid (same rank order as Layout)."""

    def rank(p: int, d: int, t: int) -> int:
        return p * dp * tp + d * tp + t

    if dp * tp * pp != world_size:
        raise ValueError(f"dp*tp*pp = {dp * tp * pp} must equal world size {world_size}")
    return {
        "tp": [[rank(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[rank(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[rank(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }
