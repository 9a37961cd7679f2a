"""The controller: runs on the leader agent and carries out the recovery decisions.

Owns: `Controller`, the loop that turns reported faults into recovery rounds, and the parts it
is built from (one job each; the decision rules live in `launcher.control.decision`, nowhere
else):

  fault_intake         reading reports in order, refusing stale writers, one event one fault
  decider              asking `decision` (situation, decision, fallback), with its log lines
  plan_publisher       publishing a decision's plan for the next generation, the restart budget
  round_phase          the round in progress and its phase (every change of phase goes through it)
  round_driver         driving a round's phases, a timeout each: restart-all, process-level, dump
  node_book            lost nodes and the agents holding each node; their loss and arrival as faults
  world_changes        shrinking without an unreplaced node, growing with waiting agents (regroup)
  grow                 a live grow back after a live shrink (the dropped ranks' processes return,
                       on their node or on the new agent of a lost node)
  hot_switch           `ftctl migrate` / sub-health: ranks move to new processes, no fault
  step_halt            the controller's own pause at a step boundary (grow, hot switch)
  handoff              the state a successor needs, and taking up the round an earlier one drove
  fault_history        the job's fault history (published with every plan, for the failure summary)
  controller_settings  what it is built with: `ControllerSettings` and `ControllerHooks`

One pass of the loop: a round that an earlier controller was driving (or this one, until a store
error cut it short: `Handoff.retake`) is taken up first (`Handoff.resume`); else a decision that
cannot wait (a lost node's node_replace_timeout ran out, agents waiting to get in:
`WorldChanges.overdue`; the dropped ranks back: `GrowBack.due`; a hot switch's new processes
ready: `HotSwitch.due`); else the next fault (`FaultIntake.take`) is decided (`Decider.decide`).
A decision that is not absorbed is executed: its plan is published and its round driven
(`execute`), until nothing follows (a round can be superseded by a new fault, or fall back).
Once a new rendezvous round was requested (REGROUPING) this world ends: the loop only waits to
be stopped. A fenced controller (its agent stale, or a successor took over: `FencedError`)
stops.

Ranks done with the job (`finished_ranks`: their agents set `P.finished_key` when a rank says
goodbye or exits 0) take part in no round: every decision knows them (`decision` rule 6), and a
round whose survivors finish instead of reporting their status falls back at once, logging
`peers-finished`.
"""

from __future__ import annotations

import threading
import time

from launcher.control import controller_state as CS
from launcher.control.controller_settings import ControllerHooks, ControllerSettings
from launcher.control.decider import Decider
from launcher.control.decision import PROCESS_LEVEL, Decision, Round, Situation
from launcher.control.fault_history import FaultHistory
from launcher.control.fault_intake import FaultIntake
from launcher.control.grow import GrowBack
from launcher.control.handoff import Handoff
from launcher.control.hot_switch import HotSwitch
from launcher.control.node_book import NodeBook
from launcher.control.plan_publisher import PlanPublisher
from launcher.control.round_driver import RoundDriver
from launcher.control.round_phase import RoundPhase, RoundTracker
from launcher.control.step_halt import OwnRoundParts
from launcher.control.world_changes import WorldChanges
from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from rendezvous.errors import FencedError
from rendezvous.kv import KVStore, StoreError


class Controller:
    """Leader-side decision loop. Owned by the leader agent: `start()` / `stop()`."""

    def __init__(
        self,
        kv: KVStore,
        log: AgentLog,
        settings: ControllerSettings,
        hooks: ControllerHooks | None = None,
    ) -> None:
        hooks = ControllerHooks() if hooks is None else hooks
        self.kv, self.log, self.settings = kv, log, settings
        self.state = CS.ControllerState.read(kv, settings.max_restarts)
        self.term = CS.take_term(kv)  # fences the saved state against earlier controllers
        self.rounds = RoundTracker()
        self.faults = FaultHistory()
        self._stop = threading.Event()
        self._after_error = False  # a store error interrupted the last pass (`Handoff.retake`)
        self._assemble(hooks)
        self.handoff.restore()  # the latest plan's round, when an earlier controller wrote it
        self.grow.adopt_pause(self.handoff.restored_pause)  # a grow the earlier one started
        self.switch.take_over(*self.handoff.restored_switch)  # its switch: taken up or ended
        self._thread = threading.Thread(target=self._run, name="ftrun-controller", daemon=True)

    def _assemble(self, hooks: ControllerHooks) -> None:
        """The parts, each with what it needs (see the module docstring)."""
        kv, log, settings = self.kv, self.log, self.settings
        self.nodes = NodeBook(kv, log, settings, hooks, self.state, self._save)
        self.decider = Decider(kv, log, settings, self.state, self.rounds)
        self.intake = FaultIntake(kv, log, settings, hooks, self.state, self.rounds)
        self.handoff = Handoff(
            kv,
            log,
            settings,
            self.term,
            self.state,
            self.faults,
            self.nodes,
            self.rounds,
            self.decider,
        )
        self.publisher = PlanPublisher(
            kv,
            log,
            hooks,
            self.term,
            self.state,
            self.faults,
            self.rounds,
            self.decider,
            self.nodes,
            self._save,
        )
        self.world = WorldChanges(
            log,
            settings,
            hooks,
            self.nodes,
            self.rounds,
            self.decider.situation,
            self.publisher.publish,
        )
        self.driver = RoundDriver(
            kv,
            log,
            settings,
            self.rounds,
            self.intake,
            self.decider,
            self.nodes,
            self.publisher,
            self.world.overdue,
            self._stop,
        )
        self._assemble_own_rounds()

    def _assemble_own_rounds(self) -> None:
        """The rounds the controller starts itself, on the round driver's dropped ranks: the
        live grow back (launcher.control.grow) and the hot switch (launcher.control.hot_switch)."""
        d = self.driver
        parts = OwnRoundParts(
            self.kv,
            self.log,
            self.settings,
            self.rounds,
            d.intake,
            d.decider,
            d.dropped,
            self._stop,
            self._save,
        )
        self.grow = GrowBack(parts)
        self.switch = HotSwitch(parts)
        d.own_repairs[P.GROW] = self.grow.repair
        d.own_repairs[P.SWITCH] = self.switch.repair
        d.node_fallback = self.world.without_live_shrink  # a lost node's shrink refused
        self.decider.live_nodes = self.nodes.live_nodes
        self.nodes.aware = self.decider.all_aware
        self.handoff.grow_pause = self.grow.pause_seq
        self.handoff.switch = self.switch.saved

    # ---- what the agent and the tests look at ---------------------------------------------
    @property
    def round(self) -> Round | None:
        """The latest plan's round."""
        return self.rounds.round

    @property
    def phase(self) -> RoundPhase:
        """The phase of the latest round (`round_phase.RoundPhase`)."""
        return self.rounds.phase

    @property
    def history(self) -> list[dict]:
        """The fault history (every fault handled: strategies tried, outcome)."""
        return self.faults.entries

    @property
    def lost_nodes(self) -> set[int]:
        return self.nodes.lost_nodes

    @property
    def known(self) -> dict[int, int]:
        return self.nodes.known

    def situation(self, fault: P.Fault | None = None) -> Situation:
        return self.decider.situation(fault)

    def finished_ranks(self, fault: P.Fault | None = None) -> tuple[int, ...]:
        return self.decider.finished_ranks(fault)

    # ---- membership news (any thread) ----------------------------------------------------
    def note_node(self, node: int, lost: bool, why: str = "", host: str = "") -> None:
        self.nodes.note_node(node, lost, why, host)

    def note_arrival(
        self, node: int, incarnation: int, host: str = "", why: str = ""
    ) -> int | None:
        return self.nodes.note_arrival(node, incarnation, host, why)

    def reconcile(self, members: dict[int, int], lost: list[int]) -> None:
        """Before `start()`: see `Handoff.reconcile`."""
        self.handoff.reconcile(members, lost)

    def _save(self) -> None:
        self.handoff.save()

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    # ---- the loop ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            if self.rounds.regrouping:  # this world ends: its agents move to the new round
                self._stop.wait(0.2)
                continue
            try:
                self._step()
            except FencedError as e:
                self.log.error("controller-fenced", f"this controller is stale and stops: {e}")
                return
            except StoreError as e:
                if self._stop.is_set():
                    return
                self.log.error("controller", f"store error in controller: {e}")
                self._after_error = True
                time.sleep(0.2)

    def _step(self) -> None:
        """One pass of the loop (see the module docstring)."""
        if self._after_error:  # a round cut short by it is driven again
            self.handoff.retake()
            self._after_error = False
        if self.rounds.inherited is not None:  # again after a store error
            self._run_rounds(self.handoff.resume(self.intake, self.driver))
            return
        overdue = self.world.overdue() or self.grow.due() or self.switch.due()
        if overdue is not None:
            self._run_rounds(overdue)
            return
        self.decider.prime()  # the aware keys read while idle, not on a fault's path
        fault = self.intake.take(0.5)
        if fault is not None:
            self.handle(fault)

    def _run_rounds(self, decision: Decision | None) -> None:
        while decision is not None and not decision.absorbed and not self._stop.is_set():
            decision = self.execute(decision)

    def handle(self, fault: P.Fault) -> None:
        """Decide about one reported fault, then run rounds until none follows."""
        self._run_rounds(self.decider.decide(fault))

    def execute(self, decision: Decision) -> Decision | None:
        """Publish the decision's plan and drive its round; returns what must follow (a fault
        that superseded the round, or its fallback), None when the round is in the agents' and
        workers' hands."""
        if decision.shrink or decision.grow:
            return self.world.regroup(decision)
        plan = self.publisher.publish(decision)
        if plan.strategy == P.RESTART_ALL:
            self.driver.release_restart_all(plan.generation)
        elif plan.strategy in PROCESS_LEVEL:
            return self.driver.drive_repair(plan)
        elif plan.strategy == P.DUMP:
            self.driver.drive_dump(plan)
        return None

    def publish(self, decision: Decision, new_round: int = 0) -> P.Plan:
        """See `PlanPublisher.publish`."""
        return self.publisher.publish(decision, new_round)
