"""The controller's side of a live grow back (elastic-training): the dropped ranks return.

Owns: `GrowBack` (when the world grows back, and its round's two ends) and the pure rules it
uses: `returning` (the dropped ranks whose returning process is ready), `grow_plan` (the grow
round's repair plan: the full world, the returning ranks receiving their replica's state; or,
when that cannot be, the survivors' plan in the shrunk world, saying why).

After a live shrink (launcher.control.shrink) each dropped rank's agent starts a returning
process for it (a warm spare taken, or a cold start: launcher.agent.grow_back) for the next
generation; the process posts its status for that generation and waits. Once every dropped
rank's status is there and no round is in progress, `due` halts the world's ranks at one step
boundary (a pause request, the one `ftctl pause` makes: every rank halts after the same step,
no rollback; each marks `plan.pause_halted_key`), then returns the `elastic-grow` decision: its
plan (not charged, the same fault's handling continued) stops the halted ranks, which enter
the round at that boundary and report their status; `repair` (called by the round driver with
every status) writes the grow: the returning ranks receive their replica's full state, every
rank rebuilds the default group over the full world, `world-grow` is logged with its cost.

A grow that cannot be made never costs the job: a halt not reached within the phase timeout,
a fault first or an `ftctl pause` in effect leave the world as it is (one line why; another try
after `RETRY_S`); a grow round whose repair cannot take the returning ranks back keeps the
shrunk world (the returning processes end). Only a full grow back is built: the world grows
once every dropped rank has returned (a partial grow would renumber the group ranks, and a
transfer in a renumbered world is not built).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable, Sequence

from launcher.control.decision import Decision
from launcher.control.repair_planning import needs_state, plan_repair
from launcher.control.round_phase import RoundPhase
from launcher.control.shrink import after_shrink
from launcher.control.step_halt import OwnRoundParts
from launcher.observe.pause_state import pause_state
from launcher.protocol import plan as P
from rendezvous.kv import KVStore

RETRY_S = 10.0  # after a grow that could not start, the next try waits this long


def returning(kv: KVStore, generation: int, dropped: Iterable[int]) -> list[int]:
    """The dropped ranks whose returning process posted its status for `generation` (the
    round a grow would be), in order."""
    ranks = sorted(dropped)
    if not ranks:
        return []
    raws = [kv.try_get(P.status_key(generation, r)) for r in ranks]
    return [r for r, raw in zip(ranks, raws) if raw is not None]


def grow_plan(
    statuses: Sequence[P.RankStatus],
    generation: int,
    world: Sequence[int],
    back: Sequence[int],
    stripes: int = 0,
    node_of: Callable[[int], int] | None = None,
) -> tuple[P.RepairPlan, str]:
    """The grow round's repair plan over every rank's `statuses`: the world `world` with the
    returning ranks `back` receiving their replica's state, and ""; or, when the grow cannot be
    made, the survivors' plan in the world without `back` and why."""
    repair = plan_repair(statuses, generation, stripes, node_of)
    why = _cannot_grow(repair, statuses, world, back)
    if not why:
        return dataclasses.replace(repair, world=list(world)), ""
    kept = [r for r in world if r not in back]
    stay = plan_repair([s for s in statuses if s.rank not in back], generation, stripes, node_of)
    if not stay.fallback:
        stay = after_shrink(stay, kept)
    return dataclasses.replace(stay, reason=f"no grow: {why}; {stay.reason}"), why


def _cannot_grow(
    repair: P.RepairPlan,
    statuses: Sequence[P.RankStatus],
    world: Sequence[int],
    back: Sequence[int],
) -> str:
    if repair.fallback:
        return repair.reason or f"the repair plan falls back to {repair.fallback}"
    fresh = sorted(s.rank for s in statuses if s.rank in back and not needs_state(s))
    if fresh:
        return f"ranks {fresh} report a state of their own (not returning processes)"
    into = sorted({dst for _, dst in repair.pairs})
    if into != sorted(back):
        return f"the transfers {repair.pairs} do not go to exactly the returning ranks {list(back)}"
    if list(world) != list(range(len(world))):
        return f"a transfer in the renumbered world {list(world)} is not built yet"
    return ""


class GrowBack:
    """When the world grows back, and the two ends of its round (`due`, `repair`)."""

    def __init__(self, parts: OwnRoundParts) -> None:
        self.kv, self.log, self.settings, self.rounds = (
            parts.kv,
            parts.log,
            parts.settings,
            parts.rounds,
        )
        self.intake, self.decider = parts.intake, parts.decider
        self.dropped = parts.dropped  # the round driver's: ranks live shrinks removed
        self.stopped = parts.stopped
        self._retry_at = 0.0
        # the grow's pause request, until it ends (its t0: when the grow started)
        self.halt = parts.step_halt()
        self._said = ""  # the last "waiting" line (said once)
        self.save = parts.save  # the controller's state for a successor (handoff)

    def pause_seq(self) -> int:
        """The pause of the grow in progress (0: none), for the saved state."""
        return self.halt.seq or 0

    def adopt_pause(self, seq: int) -> None:
        """A grow's pause an earlier controller left in effect (its saved state): this grow
        back ends it (with the grow round it published, or as an abandoned try)."""
        self.halt.adopt(seq)

    # ---- the start: halted at a step boundary, then the decision -------------------------
    def due(self) -> Decision | None:
        """The grow's decision once every dropped rank's returning process is ready and the
        world's ranks halted at one step boundary; a fault's decision when one came first;
        None otherwise (nothing to grow, not yet, or the try was given up)."""
        rnd = self.rounds.round
        if self.halt.active and (rnd is None or rnd.strategy != P.GROW or not rnd.collecting):
            self._end_pause("the grow round ended")  # superseded before its repair plan
        if not self.dropped or rnd is None or self.rounds.phase is not RoundPhase.DONE:
            return None
        if time.monotonic() < self._retry_at:
            return None
        g = rnd.generation + 1
        back = returning(self.kv, g, self.dropped)
        if back != sorted(self.dropped):
            return None
        held = pause_state(self.kv)
        if held is not None and held.in_effect:
            self._say(f"ranks {back} are back; the grow waits for {held.describe()} to end")
            return None
        world = list(range(self.settings.world_size))
        survivors = [r for r in world if r not in self.dropped]
        halted = self._halt(survivors)
        if isinstance(halted, Decision) or halted is None:
            return halted
        if returning(self.kv, g, back) != back:  # a returning process ended meanwhile
            return self._give_up(f"a returning process of ranks {back} ended")
        why = (
            f"ranks {back} are back (returning processes ready): the world grows "
            f"{len(survivors)} -> {len(world)} ranks after step {halted}"
        )
        return Decision(P.GROW, why, rnd.cause, (), tuple(back), charged=False, continues=True)

    def _halt(self, ranks: list[int]) -> int | Decision | None:
        """Pause `ranks` at one step boundary (as `ftctl pause`); the step they halted after
        once every rank marked its halt; a fault's decision when one came first; None when the
        halt was not reached (given up, the pause ended)."""
        self.halt.request()
        self.save()  # a successor ends this pause (handoff)
        got = self.halt.wait(ranks)
        if got.step is None:
            self._give_up(got.why)
            return got.decision
        return got.step

    def _give_up(self, why: str) -> None:
        self._end_pause(f"abandoned: world grow: {why}")
        self._retry_at = time.monotonic() + RETRY_S
        self.log.warning(
            "grow-abandoned",
            f"the world does not grow now: {why}; the ranks keep running in the world of "
            f"{self.settings.world_size - len(self.dropped)} (next try in {RETRY_S:.0f}s)",
            dropped=sorted(self.dropped),
            reason=why,
        )
        return None

    def _end_pause(self, why: str) -> None:
        self.halt.end(why)

    def _say(self, line: str) -> None:
        if line != self._said:
            self._said = line
            self.log.info("grow-waits", line)

    # ---- the end: the grow round's repair plan --------------------------------------------
    def repair(self, plan: P.Plan, statuses: list[P.RankStatus], world: list[int]) -> P.RepairPlan:
        """The grow round's repair plan (every rank's status is in): the full world, or the
        shrunk one saying why; `world-grow` (or `grow-abandoned`) logged, the pause ended."""
        g, back = plan.generation, list(plan.restart_ranks)
        s = self.settings
        repair, why = grow_plan(statuses, g, world, back, s.transfer_stripes, s.node_of)
        before = len(world) - len(back)
        if why:
            self._give_up(f"generation {g}: {why}")
            return repair
        self.dropped.difference_update(back)
        cost = time.monotonic() - self.halt.t0 if self.halt.active else 0.0
        self._end_pause(f"world grow: generation {g}")
        self.save()  # the world is whole again, for a successor too (handoff)
        self.log.warning(
            "world-grow",
            f"generation {g}: ranks {back} are back, received from "
            f"{sorted({src for src, _ in repair.pairs})}: world size {before} -> {len(world)} "
            f"(elastic-training; {cost:.3f}s from the halt request to the repair plan)",
            generation=g,
            strategy=plan.strategy,
            grown=back,
            world=world,
            world_size=before,
            new_world_size=len(world),
            resume_step=repair.resume_step,
            cost_s=round(cost, 4),
        )
        return repair
