"""Replica identity and repair planning.

Owns: which ranks hold equal state (a `Layout`: plain DDP, explicit replica groups, or a
Megatron-style DP x TP x PP grid with an optional distributed optimizer), and the pure function
`plan_repair` that turns the ranks' `RankStatus` reports of one recovery round into a
`RepairPlan` (who sends state to whom, where to resume), and `plan_dump`, its counterpart for a
dying-gasp round (which step the survivors save, and which rank writes each shard). The
controller imports both; the runtime only executes their result.

Replica rules (seed 004 / Megatron): ranks that differ only in their data-parallel index hold
the same weights, optimizer state, RNG streams and global data position. With a distributed
optimizer split into `optimizer_shards` pieces inside each DP group, only ranks holding the same
optimizer shard are replicas; `optimizer_shards == dp` means no replica at all.
Rank order is Megatron's default: tensor-parallel index fastest, then data-parallel, then
pipeline (`rank = pp * dp * tp + d * tp + t`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from launcher.plan import DUMP, RESTART_ALL, RankStatus, RepairPlan


# How many replicas send one replacement its state. AUTO (the default, FTRUN_TRANSFER_STRIPES=auto):
# one sender per node that holds an up-to-date replica, so each stripe leaves through a network
# interface of its own. Senders on one host share its CPUs and memory bandwidth: on the 2-core
# test box a striped receive from one host was slower inside a running job (0.51-0.77 GB/s striped
# vs 0.74-0.87 from one sender, bench_recovery.py), so on a single node AUTO means one sender.
# A number N (1..16) takes the lowest N up-to-date replicas wherever they run.
AUTO_STRIPES = 0
MAX_STRIPES = 16


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
                f"0..{self.world_size - 1}, each rank exactly once")
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
    def from_parallel(cls, world_size: int, dp: int, tp: int = 1, pp: int = 1,
                      optimizer_shards: int = 1) -> "Layout":
        """Megatron-style grid. `optimizer_shards` = how many pieces a distributed optimizer
        splits its state into inside each DP group (1 = no distributed optimizer)."""
        for name, v in (("dp", dp), ("tp", tp), ("pp", pp), ("optimizer_shards", optimizer_shards)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if dp * tp * pp != world_size:
            raise ValueError(f"dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp} must equal world size {world_size}")
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


def needs_state(status: RankStatus) -> bool:
    """A rank whose own state cannot be trusted: a fresh replacement or stopped mid-update."""
    return bool(status.replacement or status.dirty)


def plan_repair(statuses: Iterable[RankStatus], generation: int, max_stripes: int = AUTO_STRIPES,
                node_of: Callable[[int], int] | None = None) -> RepairPlan:
    """Decide how generation `generation` repairs its ranks.

    resume_step = (max committed_step over healthy ranks) + 1. Every rank that is a replacement,
    dirty, or healthy but behind that step receives the full state from the up-to-date healthy
    ranks with the same shard, each sending one stripe (pairs [src, dst] list a target's sources
    in stripe order): the lowest `max_stripes` of them, or with `AUTO_STRIPES` the lowest one on
    each node (`node_of(rank)`; every rank on one node when it is None), at most `MAX_STRIPES`.
    When some shard has no such rank, the plan carries
    fallback="restart-all" and no pairs. action is "rollback" when some healthy rank had
    already started the resume step (it is re-run), else "commit".
    """
    sts = list(statuses)
    if not sts:
        raise ValueError("plan_repair needs at least one RankStatus")
    ranks = [s.rank for s in sts]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"duplicate ranks in statuses: {sorted(ranks)}")
    wrong = [s.rank for s in sts if s.generation != generation]
    if wrong:
        raise ValueError(f"statuses of ranks {wrong} are not for generation {generation}")
    healthy = [s for s in sts if not needs_state(s)]
    if not healthy:
        return RepairPlan(generation, resume_step=0, action="rollback", fallback=RESTART_ALL,
                          reason="no rank holds a trusted state")
    top = max(s.committed_step for s in healthy)
    resume = top + 1
    if not (max_stripes == AUTO_STRIPES or 1 <= max_stripes <= MAX_STRIPES):
        raise ValueError(f"max_stripes={max_stripes} must be {AUTO_STRIPES} (auto: one sender "
                         f"per node) or in 1..{MAX_STRIPES}")
    sources: dict[str, list[int]] = {}
    nodes_used: dict[str, set[int]] = {}
    for s in sorted(healthy, key=lambda s: s.rank):
        if s.committed_step != top:
            continue
        chosen = sources.setdefault(s.shard, [])
        if max_stripes == AUTO_STRIPES:
            node = node_of(s.rank) if node_of is not None else 0
            used = nodes_used.setdefault(s.shard, set())
            if node in used or len(chosen) >= MAX_STRIPES:
                continue
            used.add(node)
        elif len(chosen) >= max_stripes:
            continue
        chosen.append(s.rank)
    missing = sorted({s.shard for s in sts} - set(sources))
    if missing:
        return RepairPlan(generation, resume_step=resume, action="rollback", fallback=RESTART_ALL,
                          reason=f"no healthy replica at step {resume} for shard(s) "
                                 + ", ".join(repr(m) for m in missing))
    targets = sorted((s for s in sts if needs_state(s) or s.committed_step < top),
                     key=lambda s: s.rank)
    pairs = [[src, s.rank] for s in targets for src in sources[s.shard]]
    interrupted = max(s.step for s in healthy)
    action = "rollback" if interrupted >= resume else "commit"
    why = ", ".join(f"{dst}<-{src}" for src, dst in pairs) or "none"
    return RepairPlan(generation, resume_step=resume, action=action, pairs=pairs,
                      reason=f"resume at step {resume} ({action}); repairs: {why}")


def plan_dump(statuses: Iterable[RankStatus], generation: int) -> RepairPlan:
    """Decide what a dying-gasp round (strategy dump) saves.

    resume_step = (max committed_step over healthy ranks) + 1, as for `plan_repair`; the writer
    of each shard is its lowest healthy rank at that step. Shards without such a rank have no
    writer: the runtime saves nothing when its layout has a shard without one."""
    healthy = [s for s in statuses if not needs_state(s)]
    top = max((s.committed_step for s in healthy), default=-1)
    writers: dict[str, int] = {}
    for s in sorted(healthy, key=lambda s: s.rank):
        if s.committed_step == top:
            writers.setdefault(s.shard, s.rank)
    return RepairPlan(generation, resume_step=top + 1, action="rollback", fallback=DUMP,
                      reason=f"dying-gasp checkpoint of step {top + 1}", writers=writers)
