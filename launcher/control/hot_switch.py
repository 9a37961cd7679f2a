"""The controller's side of a hot switch (sub-health): ranks move to new processes live.

Owns: `HotSwitch` (taking `ftctl migrate` / sub-health requests, the switch's preparation, its
round's two ends) and the pure rules it uses: `ranks_to_move` (a request's ranks, or why it is
refused) and `switch_plan` (the switch round's repair plan).

A request (`plan.MigrateRequest` under `plan.migrate_key(seq)`, written by `ftctl migrate` or by
a node's agent from its sub-health file) names ranks, or a node whose every rank moves. The
controller takes one at a time, between rounds: a request it cannot carry out is refused at
once (unknown rank or node, a shrunk world, ranks that finished or do not use the runtime, a
pause in effect). Otherwise the switch starts (`switch-start`): the `SwitchOrder` (`plan.
SWITCH_KEY`) tells the ranks' agents to start an incoming process for each (a warm spare first,
else a cold start: launcher.agent.hot_switch) for the next generation; each posts its status
for that generation and waits. Only when all are ready does `due` halt every rank at one step
boundary (`StepHalt`, a pause request) and return the `hot-switch` decision (not charged, not a
fault: the fault history does not record it): its plan makes each agent stop the drained
processes and put the incoming ones in their place; the halted ranks enter the round at the
boundary; `repair` writes the round's plan: the incoming ranks receive their replica's full
state (the drained ranks are stopped by then), every rank rebuilds its groups, and the step
after the halt runs next, no step recomputed (`switch-done`, with its cost).

Failure at any point before the drained ranks are stopped abandons the switch
(`switch-abandoned`, one line why): an incoming process that ended (its agent sets
`plan.switch_ended_key`; seen while the halt is awaited too), not ready within the phase
timeout, a halt not reached, a fault first (handled as usual), the controller stopping. The
ranks keep running where they were: the pause ends, the agents stop the incoming processes.
Every request's end is written under `plan.migrate_outcome_key` for `ftctl migrate`.

Handoff: the switch in progress and its halt's pause are in the controller's saved state
(`saved`); a successor (`take_over`) takes up a switch round the lost controller published (its
repair plan ends the pause) and abandons a switch in preparation (the pause ends at once, the
agents stop the new processes, the request is answered `abandoned`), instead of leaving the
ranks halted until the pause expires.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

from launcher.control.decision import Decision
from launcher.control.grow import returning
from launcher.control.repair_planning import needs_state, plan_repair
from launcher.control.round_phase import RoundPhase
from launcher.control.step_halt import OwnRoundParts
from launcher.observe.pause_state import pause_state
from launcher.protocol import plan as P

REFUSED, ABANDONED, DONE = "refused", "abandoned", "done"  # a request's outcomes


def ranks_to_move(
    req: P.MigrateRequest, world_size: int, node_of: Callable[[int], int]
) -> tuple[list[int], str]:
    """The ranks `req` moves, and "" ; or [] and why the request names nothing that exists."""
    world = range(world_size)
    unknown = sorted(r for r in req.ranks if r not in world)
    if unknown:
        return [], f"unknown rank(s) {unknown} (the job's ranks are 0..{world_size - 1})"
    ranks = set(req.ranks)
    if req.node is not None:
        nodes = sorted({node_of(r) for r in world})
        of_node = {r for r in world if node_of(r) == req.node}
        if not of_node:
            return [], f"unknown node {req.node} (the job's nodes are {nodes})"
        ranks |= of_node
    if not ranks:
        return [], "no rank or node named"
    return sorted(ranks), ""


def switch_plan(
    statuses: Sequence[P.RankStatus],
    generation: int,
    moved: Sequence[int],
    stripes: int = 0,
    node_of: Callable[[int], int] | None = None,
) -> tuple[P.RepairPlan, str]:
    """The switch round's repair plan over every rank's `statuses`, and "" when it is the
    switch (the moved ranks, and only they, receive a replica's state); else why not."""
    repair = plan_repair(statuses, generation, stripes, node_of)
    if repair.fallback:
        return repair, repair.reason or f"the repair plan falls back to {repair.fallback}"
    own = sorted(s.rank for s in statuses if s.rank in moved and not needs_state(s))
    if own:
        return repair, f"ranks {own} report a state of their own (not incoming processes)"
    into = sorted({dst for _, dst in repair.pairs})
    if into != sorted(moved):
        return repair, f"the transfers {repair.pairs} do not go to exactly ranks {list(moved)}"
    return repair, ""


@dataclasses.dataclass
class _Switch:
    """The switch in progress."""

    req: P.MigrateRequest
    order: P.SwitchOrder
    t0: float  # when it started (monotonic)
    ready_by: float  # the incoming processes must have posted their status by then
    decided: bool = False  # its decision was returned: the drained processes are being stopped


class HotSwitch:
    """Migrate requests, one switch at a time (`due`), and its round's repair plan (`repair`)."""

    def __init__(self, parts: OwnRoundParts) -> None:
        self.kv, self.log, self.settings, self.rounds = (
            parts.kv,
            parts.log,
            parts.settings,
            parts.rounds,
        )
        self.decider = parts.decider
        self.dropped = parts.dropped  # the round driver's: ranks live shrinks removed
        self.stopped = parts.stopped
        self.halt = parts.step_halt()
        self._next = 1  # the next request number to read
        self.current: _Switch | None = None
        self.save = parts.save  # the controller's state for a successor (handoff)
        self.taken_up = 0  # the switch (request seq) whose round an earlier controller published

    # ---- the handoff: what a successor needs, and what it does with it -----------------------
    def saved(self) -> tuple[int, int]:
        """The switch in progress and its halt's pause (0 each: none), for the saved state."""
        seq = self.current.req.seq if self.current is not None else self.taken_up
        return seq, self.halt.seq or 0

    def take_over(self, seq: int, pause: int) -> None:
        """The hot switch (request `seq`, its halt's pause `pause`) an earlier controller left
        in progress (its saved state). Its round published and not done: taken up, this
        controller's repair plan ends the pause. Else it is abandoned (one line): the pause
        ends, the agents stop the new processes, the request is answered."""
        if not seq or self.kv.try_get(P.migrate_outcome_key(seq)) is not None:
            return  # none, or it ended (its pause with it) before the earlier one was lost
        self.halt.adopt(pause)
        plan, rnd = self.rounds.inherited, self.rounds.round
        if plan is not None and plan.strategy == P.SWITCH and rnd is not None and rnd.collecting:
            if ((plan.root_cause or {}).get("evidence") or {}).get("migrate") == seq:
                self.taken_up = seq
                return
        raw, order_raw = self.kv.try_get(P.migrate_key(seq)), self.kv.try_get(P.SWITCH_KEY)
        req = P.MigrateRequest.from_json(raw) if raw is not None else P.MigrateRequest(seq=seq)
        order = P.SwitchOrder.from_json(order_raw) if order_raw is not None else None
        if order is None or order.seq != seq:
            order = P.SwitchOrder(seq=seq, generation=0, ranks=list(req.ranks))
        self.current = _Switch(req, order, time.monotonic(), time.monotonic())
        self._end(
            self.current,
            ABANDONED,
            "the controller that started it was lost before its round (a successor does not "
            "take up a switch in preparation)",
        )

    # ---- the start: a request, the incoming processes, the halt, the decision --------------
    def due(self) -> Decision | None:
        """The switch's decision once its incoming processes are ready and every rank halted;
        a fault's decision when one came first; None otherwise."""
        cur = self.current
        if cur is None and self.taken_up and not self._round_in_progress(P.SWITCH):
            seq, self.taken_up = self.taken_up, 0  # superseded before its repair plan
            self.halt.end(f"abandoned: hot switch #{seq}: a recovery round superseded its round")
        if cur is not None and self.halt.active and not self._in_round(cur):
            rnd = self.rounds.round
            newer = f"generation {rnd.generation} ({rnd.strategy})" if rnd is not None else "?"
            self._end(
                cur,
                ABANDONED,
                f"a recovery round (now {newer}) superseded its round before the repair plan "
                "(the drained processes were stopped already: that round repairs their ranks)",
            )
            return None
        if cur is None:
            self._take_request()
            return None
        if self._in_round(cur):
            return None
        return self._advance(cur)

    def _in_round(self, cur: _Switch) -> bool:
        rnd = self.rounds.round
        return (
            rnd is not None
            and rnd.generation == cur.order.generation
            and rnd.strategy == (P.SWITCH)
        )

    def _round_in_progress(self, strategy: str) -> bool:
        rnd = self.rounds.round
        return rnd is not None and rnd.strategy == strategy and rnd.collecting

    def _take_request(self) -> None:
        rnd = self.rounds.round
        if rnd is not None and self.rounds.phase is not RoundPhase.DONE:
            return  # a round in progress: the request waits for its end
        raw = self.kv.try_get(P.migrate_key(self._next))
        if raw is None:
            return
        self._next += 1
        req = P.MigrateRequest.from_json(raw)
        if self.kv.try_get(P.migrate_outcome_key(req.seq)) is not None:
            return  # answered by an earlier controller
        ranks, why = ranks_to_move(req, self.settings.world_size, self.settings.node_of)
        why = why or self._refusal(ranks)
        g = self.decider.state.generation + 1
        order = P.SwitchOrder(seq=req.seq, generation=g, ranks=ranks)
        now = time.monotonic()
        cur = _Switch(req, order, now, now + self.settings.phase_timeout)
        if why:
            self._end(cur, REFUSED, why)
            return
        self.current = cur
        self.kv.set(P.SWITCH_KEY, order.to_json())
        self.save()  # a successor abandons it (handoff)
        self._nudge()
        self.log.warning(
            "switch-start",
            f"hot switch #{req.seq} ({req.source}{': ' + req.why if req.why else ''}): ranks "
            f"{ranks} move to new processes in generation {g}; they keep running until the new "
            "ones are ready",
            seq=req.seq,
            ranks=ranks,
            node=req.node,
            source=req.source,
            generation=g,
        )

    def _refusal(self, ranks: list[int]) -> str:
        """Why the switch of `ranks` cannot start now ("" when it can)."""
        if len(ranks) >= self.settings.world_size:
            return (
                "every rank would move: no replica would be left to send the state (a transfer "
                "from the drained processes themselves is not built)"
            )
        if self.dropped:
            return f"the world is shrunk (ranks {sorted(self.dropped)} out of it)"
        finished = self.decider.finished_ranks()
        if finished:
            return f"ranks {list(finished)} finished the job"
        if not self.decider.all_aware():
            return "not every rank uses launcher.runtime (a switch needs its pause and transfer)"
        held = pause_state(self.kv)
        if held is not None and held.in_effect:
            return f"{held.describe()} is in effect"
        return ""

    def _advance(self, cur: _Switch) -> Decision | None:
        o = cur.order
        why = self._broken(cur)
        if why:
            self._end(cur, ABANDONED, why)
            return None
        if returning(self.kv, o.generation, o.ranks) != o.ranks:
            return None
        self.halt.request()
        self.save()  # a successor ends this pause (handoff)
        got = self.halt.wait(list(range(self.settings.world_size)), lambda: self._broken(cur))
        why = got.why or self._broken(cur)
        if got.step is None or why:
            self._end(cur, ABANDONED, why)
            return got.decision
        why = (
            f"hot switch #{o.seq}: ranks {o.ranks} move to their ready new processes after "
            f"step {got.step} (no fault, no rollback)"
        )
        cause = P.Fault(
            kind="migrate",
            rank=o.ranks[0],
            node=self.settings.node_of(o.ranks[0]),
            generation=o.generation - 1,
            message=why,
            evidence={"migrate": o.seq, "source": cur.req.source},
        )
        cur.decided = True
        return Decision(P.SWITCH, why, cause, (), tuple(o.ranks), charged=False)

    def _broken(self, cur: _Switch) -> str:
        """Why the switch in preparation cannot go on ("" while it can)."""
        o = cur.order
        ended = self.kv.try_get(P.switch_ended_key(o.seq))
        if ended is not None:
            return ended.decode(errors="replace")
        rnd = self.rounds.round
        if rnd is not None and rnd.generation >= o.generation:
            return f"a recovery round came first (generation {rnd.generation}, {rnd.strategy})"
        if self.stopped.is_set():
            return "the controller stops"
        ready = returning(self.kv, o.generation, o.ranks)
        if ready != o.ranks and time.monotonic() > cur.ready_by:
            late = [r for r in o.ranks if r not in ready]
            return (
                f"the new processes of ranks {late} were not ready within "
                f"{self.settings.phase_timeout:.0f}s"
            )
        return ""

    def _end(self, cur: _Switch, outcome: str, why: str, cost: float = 0.0) -> None:
        """The switch (or request) ended: its outcome written (`cost`: the seconds a done
        switch held the ranks); one line; an abandoned switch's pause ended and its agents
        told to stop the incoming processes."""
        o = cur.order
        self.halt.end(f"{outcome}: hot switch #{o.seq}: {why or 'done'}")
        if outcome != DONE:
            if self.current is cur:
                self.kv.compare_set(P.switch_ended_key(o.seq), b"", why.encode())
                self._nudge()
            stays = "are repaired by that round" if cur.decided else "keep running where they were"
            self.log.warning(
                "switch-abandoned",
                f"hot switch #{o.seq} {outcome}: {why}; "
                + (f"ranks {o.ranks} {stays}" if o.ranks else "nothing moves"),
                seq=o.seq,
                ranks=o.ranks,
                outcome=outcome,
                reason=why,
            )
        was = self.current is cur
        self.current = None
        done = P.SwitchOutcome(o.seq, outcome, why, o.ranks, o.generation, cost)
        self.kv.set(P.migrate_outcome_key(o.seq), done.to_json())
        if was:
            self.save()  # no switch in progress any more

    def _nudge(self) -> None:
        """Every agent reads the switch order again (an injection for every rank)."""
        n = self.kv.add(P.INJECT_SEQ, 1)
        self.kv.set(P.inject_key(n), P.Injection(rank=P.EVERY_RANK, kind=P.SWITCH_KIND).to_json())

    # ---- the end: the switch round's repair plan -------------------------------------------
    def repair(self, plan: P.Plan, statuses: list[P.RankStatus], world: list[int]) -> P.RepairPlan:
        """The switch round's repair plan (every rank's status is in); `switch-done` logged.
        The drained processes are stopped by now: a plan that cannot be the switch falls back
        as any round's does."""
        s, cur = self.settings, self.current
        g, moved = plan.generation, list(plan.restart_ranks)
        repair, why = switch_plan(statuses, g, moved, s.transfer_stripes, s.node_of)
        if cur is None or cur.order.generation != g:  # taken up by a successor controller
            seq = ((plan.root_cause or {}).get("evidence") or {}).get("migrate")
            if isinstance(seq, int) and not why:  # its request is answered: not taken again
                done = P.SwitchOutcome(seq, DONE, "", moved, g)
                self.kv.set(P.migrate_outcome_key(seq), done.to_json())
            self.halt.end(f"done: hot switch #{seq}: generation {g} (taken up)")
            self.taken_up = 0
            self.save()
            return repair
        if why:
            self._end(cur, ABANDONED, f"generation {g}: {why} (the round goes on as a recovery)")
            return repair
        now = time.monotonic()
        cost, ready = round(now - self.halt.t0, 4), round(self.halt.t0 - cur.t0, 4)
        idle = round(now - self.halt.halted_at, 4) if self.halt.halted_at else None
        sources = sorted({src for src, _ in repair.pairs})
        self.log.warning(
            "switch-done",
            f"generation {g}: hot switch #{cur.order.seq}: ranks {moved} moved to new "
            f"processes, state from ranks {sources}, resume at step {repair.resume_step}; "
            f"the ranks held {cost:.3f}s from the halt request to the repair plan (new "
            f"processes ready {ready:.3f}s after the request; no rollback, not charged)",
            generation=g,
            seq=cur.order.seq,
            moved=moved,
            sources=sources,
            resume_step=repair.resume_step,
            cost_s=cost,
            prepare_s=ready,
            halted_s=idle,  # from every rank halted to the repair plan
        )
        self._end(cur, DONE, "", cost)
        return repair
