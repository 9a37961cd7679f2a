"""The controller's side of a live shrink (elastic-training): who is in the world, and whether
the world can shrink without restarting anyone.

Owns: `members` (the ranks of a round: the job's ranks but those dropped by earlier shrinks and,
in an elastic-training round, the failed ones; a grow round's returning ranks are in),
`shrink_plan` (a round's repair plan turned into a live shrink's: the new world named in
`RepairPlan.world`, or a fallback to restart-all saying why the world cannot shrink live) and
`after_shrink` (a later round's plan in the shrunk world).

A live shrink keeps the survivors' processes: they rebuild every group over the new world
and re-run (or commit) the interrupted step from their own state (launcher.runtime.elastic). So
it needs every survivor able to continue in a smaller world (it reports `shrinkable`: the
native loop, rt.ddp, framework callbacks with `resize`, a layout of whole replicas), whole
data-parallel replicas left (as many survivors in every shard: the round's failed ranks were
widened to their replicas, launcher.control.shrink_replicas), no transfer between survivors (a
transfer in a renumbered world is not built yet) and at least one survivor. Otherwise the round
falls back down the chain (restart-all from the last checkpoint, dump, exit).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from launcher.protocol import plan as P


def members(world_size: int, dropped: Iterable[int], plan: P.Plan) -> list[int]:
    """The ranks of `plan`'s round, in order (a grow's returning ranks included)."""
    gone = set(dropped) | (set(plan.failed_ranks) if plan.strategy == P.ELASTIC else set())
    if plan.strategy == P.GROW:
        gone -= set(plan.restart_ranks)  # they are back (launcher.control.grow)
    return [r for r in range(world_size) if r not in gone]


def shrink_plan(
    repair: P.RepairPlan, statuses: Sequence[P.RankStatus], world: Sequence[int]
) -> P.RepairPlan:
    """`repair` (planned over the survivors' `statuses`) as a live shrink to `world`, or a
    fallback to restart-all naming why the world cannot shrink live."""
    why = _cannot_shrink(repair, statuses, world)
    if why:
        return P.RepairPlan(
            repair.generation,
            resume_step=repair.resume_step,
            action=repair.action,
            fallback=P.RESTART_ALL,
            reason=f"no live shrink: {why}",
        )
    return dataclasses.replace(repair, world=list(world))


def after_shrink(repair: P.RepairPlan, world: Sequence[int]) -> P.RepairPlan:
    """A later round's plan in a shrunk `world`: it names the world; a transfer between ranks
    whose group ranks are not their original numbers falls back to restart-all (not built)."""
    if repair.pairs and list(world) != list(range(len(world))):
        return P.RepairPlan(
            repair.generation,
            resume_step=repair.resume_step,
            action=repair.action,
            fallback=P.RESTART_ALL,
            reason=f"state transfer {repair.pairs} in the shrunk world {list(world)} is not "
            "built yet (its group ranks are not the ranks' numbers)",
        )
    return dataclasses.replace(repair, world=list(world))


def _cannot_shrink(
    repair: P.RepairPlan, statuses: Sequence[P.RankStatus], world: Sequence[int]
) -> str:
    if repair.fallback:
        return repair.reason or f"the repair plan falls back to {repair.fallback}"
    if not world:
        return "no rank would be left"
    stuck = sorted(s.rank for s in statuses if not s.shrinkable)
    if stuck:
        return (
            f"ranks {stuck} cannot continue in a smaller world (framework callbacks without "
            "resize, or a layout whose replicas are not whole: a distributed optimizer's "
            "shards, replica groups of unequal size)"
        )
    per_shard: dict[str, int] = {}
    for s in statuses:
        per_shard[s.shard] = per_shard.get(s.shard, 0) + 1
    if len(set(per_shard.values())) > 1:
        return f"the ranks left are not whole data-parallel replicas (ranks per shard {per_shard})"
    if repair.pairs:
        return f"survivors need state from each other ({repair.pairs})"
    return ""
