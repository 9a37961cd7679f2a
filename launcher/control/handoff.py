"""The handoff between controllers: what one leaves in the store, and how the next goes on.

Owns: `Handoff`. `save` writes what a successor needs (`launcher.control.controller_state`,
fenced by the controller's term): the fault history, the lost nodes waiting for a new agent and
the agent incarnations accounted for, the ranks live shrinks dropped, a live grow's pause and
the hot switch in progress with its pause. `restore` (when the controller is built) reads it
back: the history (from the latest plan when the earlier controller died between publishing it
and saving; the generation key it had not set yet is set), and, when the saved state is of this
world's rendezvous round, the lost nodes (their loss is not reported again, their
node_replace_timeout runs on), the incarnations, the dropped ranks (the world is shrunk: the
grow back and the decisions know it), a grow's pause (`restored_pause`: the grow back ends it,
or takes it up with the grow round) and the hot switch in progress with its pause
(`restored_switch`: `HotSwitch.take_over` ends it); who each published plan restarted; and the
round of the latest plan, in the phase its keys say (`round_phase.found_phase`). `reconcile`
(before `start()`) compares that with the membership now: a node lost meanwhile is reported
lost, a node taken over meanwhile (a hot spare that claimed it before this controller was
elected) is reported as an arrival. `resume` takes up the round the earlier controller was
driving (its plan published, its phase not done): the reports that arrived meanwhile are decided
first (a lost node's loss or arrival supersedes it with a new generation that includes the
node's ranks), else the round is driven to its end (statuses and repair plan, the restart-all
release, the dump plan). `retake` hands `resume` this controller's own round when a store error
cut its driving short (an etcd request that timed out mid-round used to leave the round
undriven: the ranks waited out their store timeout).
"""

from __future__ import annotations

import json
import threading
from typing import Callable

from launcher.control import controller_state as CS
from launcher.control.controller_settings import ControllerSettings
from launcher.control.decider import Decider
from launcher.control.decision import PROCESS_LEVEL, Decision, Round
from launcher.control.fault_history import FaultHistory
from launcher.control.fault_intake import FaultIntake
from launcher.control.node_book import NodeBook
from launcher.control.round_driver import RoundDriver
from launcher.control.round_phase import RoundTracker, found_phase
from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from rendezvous.kv import KVStore

RETAKEN_BY_OWNER = (P.GROW, P.SWITCH)  # rounds `retake` leaves to their own driver


class Handoff:
    def __init__(
        self,
        kv: KVStore,
        log: AgentLog,
        settings: ControllerSettings,
        term: int,
        state: CS.ControllerState,
        history: FaultHistory,
        nodes: NodeBook,
        rounds: RoundTracker,
        decider: Decider,
    ) -> None:
        self.kv, self.log, self.settings, self.term = kv, log, settings, term
        self.state, self.history, self.nodes, self.rounds = state, history, nodes, rounds
        self.decider = decider
        self.save_lock = threading.Lock()  # one save at a time (any thread)
        # the pause of a live grow back in progress (GrowBack.pause_seq), set by the controller
        self.grow_pause: Callable[[], int] = lambda: 0
        self.restored_pause = 0  # a grow's pause an earlier controller left in effect
        # the hot switch in progress (request seq, its pause seq: HotSwitch.saved), set by the
        # controller; and the one an earlier controller left (HotSwitch.take_over ends it)
        self.switch: Callable[[], tuple[int, int]] = lambda: (0, 0)
        self.restored_switch = (0, 0)
        self.retaken = False  # the inherited round is this controller's own (`retake`)

    def save(self) -> None:
        """The state a successor needs (`launcher.control.controller_state`); FencedError when
        a newer controller took over."""
        lost, known = self.nodes.snapshot()
        switch_seq, switch_pause = self.switch()
        with self.save_lock:
            CS.save(
                self.kv,
                CS.SavedState(
                    self.term,
                    self.state.generation,
                    self.history.copy(),
                    lost,
                    known,
                    self.settings.world_round,
                    sorted(self.decider.dropped),
                    self.grow_pause(),
                    switch_seq,
                    switch_pause,
                ),
            )

    def restore(self) -> None:
        """History, lost nodes and known incarnations from the saved state; the round of the
        latest plan (kept in `RoundTracker.inherited` for `resume`; None at the job's start)."""
        saved = CS.load(self.kv)
        g = self.state.generation
        plan = self._latest_plan()
        if saved is not None and saved.world_round == self.settings.world_round:
            self.nodes.restore(saved.lost, saved.known)
            self.decider.dropped.update(saved.dropped)  # the world is shrunk: it may grow back
            self.restored_pause = saved.grow_pause
            self.restored_switch = (saved.switch_seq, saved.switch_pause)
        if saved is not None and (plan is None or saved.generation >= g):
            self.history.entries = [dict(h) for h in saved.history]
        elif plan is not None:  # it died between publishing the plan and saving its state
            self.history.entries = [dict(h) for h in plan.history]
        for gen in range(1, g + 1):  # who each published plan restarted
            raw_plan = self.kv.try_get(P.plan_key(gen))
            if raw_plan is not None:
                self.decider.note_spawns(P.Plan.from_json(raw_plan))
        if self.state.generation_key_behind:  # the write the earlier controller missed
            self.kv.set(P.GENERATION_KEY, str(g).encode())
            self.state.generation_key_behind = False
        if plan is not None:
            cause = P.Fault.from_json(
                json.dumps(
                    plan.root_cause or {"kind": "exit", "rank": None, "node": -1, "generation": g}
                )
            )
            rnd = Round(g, plan.strategy, tuple(plan.failed_ranks), cause)
            self.rounds.start(rnd, found_phase(plan, self.unfinished(plan)))
        self.rounds.inherited = plan

    def unfinished(self, plan: P.Plan) -> bool:
        """True when `plan`'s round is not done: its phase key is not written yet. A plan that
        moved the job to a new rendezvous round (shrink, grow) ended with its world."""
        g = plan.generation
        if plan.new_round:
            return False
        if plan.strategy in PROCESS_LEVEL or plan.strategy == P.DUMP:
            return self.kv.try_get(P.repair_key(g)) is None
        if plan.strategy == P.RESTART_ALL:
            return self.kv.try_get(P.go_key(g)) is None
        return False

    def retake(self) -> None:
        """After a store error cut this controller's driving of a round short: the latest
        plan's round, when not done, is taken up again by `resume` like an inherited one (a
        grow's or a hot switch's round stays with its owner, `GrowBack` / `HotSwitch`)."""
        plan = self._latest_plan()
        if plan is not None and plan.strategy not in RETAKEN_BY_OWNER and self.unfinished(plan):
            self.rounds.inherited, self.retaken = plan, True

    def _latest_plan(self) -> P.Plan | None:
        """The plan of the job's generation (None before the first)."""
        g = self.state.generation
        raw = self.kv.try_get(P.plan_key(g)) if g > 0 else None
        return P.Plan.from_json(raw) if raw is not None else None

    def resume(self, intake: FaultIntake, driver: RoundDriver) -> Decision | None:
        """Take up the round an earlier controller was driving, or this one's after a store
        error (`retake`; see the module docstring)."""
        plan, retaken = self.rounds.inherited, self.retaken
        self.retaken = False
        if plan is None or not self.unfinished(plan):
            self.rounds.inherited = None
            return None
        g = plan.generation
        whose = (
            "was cut short by a store error; this controller drives it again"
            if retaken
            else "of the previous controller was in progress; this controller takes it up"
        )
        self.log.warning(
            "round-resumed",
            f"generation {g}: the {plan.strategy} round {whose} (failed ranks {plan.failed_ranks})",
            generation=g,
            strategy=plan.strategy,
            failed_ranks=plan.failed_ranks,
            round_phase=self.rounds.phase.value,
            retaken=retaken,
        )
        while True:  # what was reported meanwhile first: it may supersede the round
            fault = intake.take(0.0)
            if fault is None:
                break
            d = self.decider.decide(fault)
            if not d.absorbed:
                self.rounds.inherited = None
                return d
        d = None
        if plan.strategy in PROCESS_LEVEL:
            d = driver.drive_repair(plan)
        elif plan.strategy == P.RESTART_ALL:
            driver.release_restart_all(g)
        elif plan.strategy == P.DUMP:
            driver.drive_dump(plan)
        self.rounds.inherited = None
        return d

    def reconcile(self, members: dict[int, int], lost: list[int]) -> None:
        """Before `start()`: what changed in the membership while no controller heard of it.
        `members`: live node -> its agent's incarnation; `lost`: nodes with no live agent."""
        nodes = self.nodes
        for node in sorted(lost):
            nodes.note_node(node, lost=True)  # a no-op for a loss already reported
        for node, inc in sorted(members.items()):
            was = nodes.known.get(node)
            if was is None:
                with nodes.lock:
                    nodes.known[node] = inc
            elif inc > was or node in nodes.lost_nodes:
                nodes.note_arrival(node, inc, host="", why="taken over while no controller ran")
        self.save()
