"""Repair planning: who sends a replacement its state, and where the ranks resume.

Owns: the pure function `plan_repair` (with its steps `check_statuses` and `pick_senders`) that
turns the ranks' `RankStatus` reports of one recovery round into a `RepairPlan` (who sends state
to whom, where to resume), and `plan_dump`, its counterpart for a dying-gasp round (which step
the survivors save, and which rank writes each shard). Ranks with equal `shard` hold equal state
(see `launcher.runtime.replicas.Layout`, which names the shards); the controller calls both, the
runtime only executes their result.
"""

from __future__ import annotations

from typing import Callable, Iterable

from launcher.protocol.plan import DUMP, RESTART_ALL, RankStatus, RepairPlan

# How many replicas send one replacement its state. AUTO (the default, FTRUN_TRANSFER_STRIPES=auto):
# one sender per node that holds an up-to-date replica, so each stripe leaves through a network
# interface of its own. Senders on one host share its CPUs and memory bandwidth: on the 2-core
# test box a striped receive from one host was slower inside a running job (0.51-0.77 GB/s striped
# vs 0.74-0.87 from one sender, bench_recovery.py), so on a single node AUTO means one sender.
# A number N (1..16) takes the lowest N up-to-date replicas wherever they run.
AUTO_STRIPES = 0
MAX_STRIPES = 16


def needs_state(status: RankStatus) -> bool:
    """A rank whose own state cannot be trusted: a fresh replacement or stopped mid-update."""
    return bool(status.replacement or status.dirty)


def plan_repair(
    statuses: Iterable[RankStatus],
    generation: int,
    max_stripes: int = AUTO_STRIPES,
    node_of: Callable[[int], int] | None = None,
) -> RepairPlan:
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
    check_statuses(sts, generation)
    healthy = [s for s in sts if not (s.replacement or s.dirty)]  # needs_state, inlined
    if not healthy:
        return RepairPlan(
            generation,
            resume_step=0,
            action="rollback",
            fallback=RESTART_ALL,
            reason="no rank holds a trusted state",
        )
    top = max(s.committed_step for s in healthy)
    resume = top + 1
    # only the shards of ranks that need state need senders: survivors all at `top` need no
    # pairing (a shard with no healthy rank at `top` has every rank among the targets)
    targets = [s for s in sts if s.replacement or s.dirty or s.committed_step < top]
    want = {s.shard for s in targets}
    sources = pick_senders(
        (s for s in healthy if s.shard in want), top, max_stripes, node_of, shards=want
    )
    missing = sorted(want - set(sources))
    if missing:
        return RepairPlan(
            generation,
            resume_step=resume,
            action="rollback",
            fallback=RESTART_ALL,
            reason=f"no healthy replica at step {resume} for shard(s) "
            + ", ".join(repr(m) for m in missing),
        )
    targets.sort(key=lambda s: s.rank)
    pairs = [[src, s.rank] for s in targets for src in sources[s.shard]]
    interrupted = max(s.step for s in healthy)
    action = "rollback" if interrupted >= resume else "commit"
    why = ", ".join(f"{dst}<-{src}" for src, dst in pairs) or "none"
    return RepairPlan(
        generation,
        resume_step=resume,
        action=action,
        pairs=pairs,
        reason=f"resume at step {resume} ({action}); repairs: {why}",
    )


def check_statuses(statuses: list[RankStatus], generation: int) -> None:
    """ValueError unless `statuses` are one report per rank, all of generation `generation`."""
    if not statuses:
        raise ValueError("plan_repair needs at least one RankStatus")
    ranks = [s.rank for s in statuses]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"duplicate ranks in statuses: {sorted(ranks)}")
    wrong = [s.rank for s in statuses if s.generation != generation]
    if wrong:
        raise ValueError(f"statuses of ranks {wrong} are not for generation {generation}")


def pick_senders(
    healthy: Iterable[RankStatus],
    top: int,
    max_stripes: int = AUTO_STRIPES,
    node_of: Callable[[int], int] | None = None,
    shards: set[str] | None = None,
) -> dict[str, list[int]]:
    """shard -> the ranks that send its state to each target, in stripe order: of the healthy
    ranks at committed step `top`, the lowest `max_stripes`, or with `AUTO_STRIPES` the lowest
    one on each node (`node_of(rank)`; one node when it is None), at most `MAX_STRIPES`. A
    shard with no healthy rank at `top` is missing from the result. `shards`: the only shards
    `healthy` holds, when the caller knows them: the walk ends once each has its senders."""
    if not (max_stripes == AUTO_STRIPES or 1 <= max_stripes <= MAX_STRIPES):
        raise ValueError(
            f"max_stripes={max_stripes} must be {AUTO_STRIPES} (auto: one sender "
            f"per node) or in 1..{MAX_STRIPES}"
        )
    cap = MAX_STRIPES if max_stripes == AUTO_STRIPES else max_stripes
    sources: dict[str, list[int]] = {}
    nodes_used: dict[str, set[int]] = {}
    full: set[str] = set()
    for s in sorted(healthy, key=lambda s: s.rank):
        if s.committed_step != top or s.shard in full:
            continue
        chosen = sources.setdefault(s.shard, [])
        if max_stripes == AUTO_STRIPES:
            node = node_of(s.rank) if node_of is not None else 0
            used = nodes_used.setdefault(s.shard, set())
            if node in used:
                continue
            used.add(node)
        chosen.append(s.rank)
        if len(chosen) >= cap:
            full.add(s.shard)
            if shards is not None and full >= shards:
                break
    return sources


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
    return RepairPlan(
        generation,
        resume_step=top + 1,
        action="rollback",
        fallback=DUMP,
        reason=f"dying-gasp checkpoint of step {top + 1}",
        writers=writers,
    )
