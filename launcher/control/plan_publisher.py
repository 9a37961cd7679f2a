"""Publishing the controller's plans: the one way a decision reaches the agents.

Owns: `PlanPublisher`: the plan of a decision for the next generation (`P.plan_key`), written
only by a controller that still is one (its agent a member, `ControllerHooks.fence`; its term
not superseded, `controller_state.check_term`); charging the restart budget when the decision
counts (`P.RESTARTS_USED_KEY`); the fault history (`FaultHistory`, published with every plan);
starting the plan's round (`RoundTracker.start`, in its first phase); the job's generation
(`P.GENERATION_KEY`); and the `plan` log line. `outcome` records how a round's fault ended.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from launcher.control import controller_state as CS
from launcher.control.controller_settings import ControllerHooks
from launcher.control.decider import Decider
from launcher.control.decision import Decision, Round
from launcher.control.fault_history import FaultHistory
from launcher.control.node_book import NodeBook
from launcher.control.round_phase import RoundTracker, first_phase
from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from rendezvous.kv import KVStore


class PlanPublisher:
    def __init__(
        self,
        kv: KVStore,
        log: AgentLog,
        hooks: ControllerHooks,
        term: int,
        state: CS.ControllerState,
        history: FaultHistory,
        rounds: RoundTracker,
        decider: Decider,
        nodes: NodeBook,
        save: Callable[[], None],
    ) -> None:
        self.kv, self.log, self.hooks, self.term = kv, log, hooks, term
        self.state, self.history, self.rounds = state, history, rounds
        self.decider = decider  # who each plan starts (finished marks of earlier processes)
        self.nodes = nodes  # the lost nodes a shrink leaves out (its log line)
        self.save = save

    def publish(self, decision: Decision, new_round: int = 0) -> P.Plan:
        """Write generation (current + 1)'s plan for `decision` (`new_round`: the rendezvous
        round the agents move to, 0: none) and start its round."""
        assert decision.strategy is not None and decision.cause is not None
        st = self.state
        g = st.generation + 1
        if self.hooks.fence is not None:
            self.hooks.fence(P.plan_key(g))  # a stale controller publishes nothing
        CS.check_term(self.kv, self.term, P.plan_key(g))  # nor one a successor took over from
        if decision.charged:
            st.budget = st.budget.charge()
            self.kv.set(P.RESTARTS_USED_KEY, str(st.budget.used).encode())
        if decision.strategy != P.SWITCH:  # a hot switch is no fault (launcher.control.hot_switch)
            self.history.note(decision, g)
        plan = P.Plan(
            generation=g,
            strategy=decision.strategy,
            failed_ranks=list(decision.failed_ranks),
            restart_ranks=list(decision.restart_ranks),
            reason=decision.reason,
            root_cause=dataclasses.asdict(decision.cause),
            restarts_used=st.budget.used,
            history=self.history.copy(),
            new_round=new_round,
        )
        st.generation = g
        self.decider.note_spawns(plan)
        rnd = Round(g, decision.strategy, decision.failed_ranks, decision.cause)
        self.rounds.start(rnd, first_phase(decision.strategy, bool(new_round)))
        self.kv.set(P.plan_key(g), plan.to_json())
        # logged as soon as the agents can read it: the writes after it queue behind the
        # plan's fan-out on the store (one request each)
        self._log_plan(plan, decision)
        self.kv.set(P.GENERATION_KEY, str(g).encode())
        self.save()
        return plan

    def _log_plan(self, plan: P.Plan, decision: Decision) -> None:
        g, strategy, new_round, budget = (
            plan.generation,
            plan.strategy,
            plan.new_round,
            self.state.budget,
        )
        where = (
            ""
            if not new_round
            else (
                f" in rendezvous round {new_round} with the waiting node(s)"
                if decision.grow
                else f" in rendezvous round {new_round} without node(s) "
                f"{sorted(self.nodes.lost_nodes)} (world size {len(plan.restart_ranks)})"
            )
        )
        self.log.info(
            "plan",
            f"generation {g}: {strategy}{where}, failed ranks "
            f"{plan.failed_ranks}, restart "
            f"{'all' if strategy == P.RESTART_ALL else plan.restart_ranks}; restarts used "
            f"{budget.used}/{budget.limit}",
            generation=g,
            strategy=strategy,
            failed_ranks=plan.failed_ranks,
            restart_ranks=plan.restart_ranks,
            charged=decision.charged,
            round_phase=self.rounds.phase.value,
            **({"new_round": new_round} if new_round else {}),
            **({"scale_up": True} if decision.grow else {}),
        )

    def outcome(self, g: int, outcome: str) -> None:
        """Generation `g`'s round completed: its fault's outcome (saved)."""
        if self.history.outcome(g, outcome):
            self.save()
