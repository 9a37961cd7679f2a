"""The controller: the one place where recovery decisions are made (runs on the leader agent).

Owns: turning a reported `Fault` into a `Plan` for the next generation (which strategy of the
chain applies, who is restarted, whether the restart budget allows it), driving the phases of a
round through the store with a timeout each (restart-all: wait until every node stopped its
workers, clear the worker keys, release them; process-level: collect every rank's status, compute
the repair plan, fall back to restart-all when peer repair is impossible), and the job-wide
`--max_restarts` budget. Agents execute plans; the in-worker runtime executes repair plans.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field

from launcher import plan as P
from launcher.faults import FaultKind, pick_strategy
from launcher.logs import AgentLog
from rendezvous.kv import KVStore, StoreError

STOPPED = "ftrun/g{g}/stopped"
GO = "ftrun/g{g}/go"
AWARE = "ftrun/aware/{rank}"
RESTARTS_USED = "ftrun/restarts_used"


def stopped_key(g: int) -> str:
    return STOPPED.format(g=g)


def go_key(g: int) -> str:
    return GO.format(g=g)


def aware_key(rank: int) -> str:
    return AWARE.format(rank=rank)


@dataclass
class ControllerState:
    generation: int = 0
    restarts_used: int = 0
    next_fault: int = 1
    history: list[dict] = field(default_factory=list)


class Controller:
    """Leader-side decision loop. Owned by the leader agent: `start()` / `stop()`."""

    def __init__(self, kv: KVStore, log: AgentLog, world_size: int, nnodes: int, max_restarts: int,
                 chain: list[str], phase_timeout: float = 120.0) -> None:
        self.kv = kv
        self.log = log
        self.world_size = world_size
        self.nnodes = nnodes
        self.max_restarts = max_restarts
        self.chain = chain
        self.phase_timeout = phase_timeout
        self.state = ControllerState()
        self.current_plan: P.Plan | None = None
        self.lost_nodes: set[int] = set()  # nodes whose agent is gone: they cannot stop workers
        self._nodes_lock = threading.Lock()
        raw = kv.try_get(P.GENERATION_KEY)
        if raw is not None:
            self.state.generation = int(raw)
        used = kv.try_get(RESTARTS_USED)
        if used is not None:
            self.state.restarts_used = int(used)
        seq = kv.try_get(P.FAULT_SEQ)
        if seq is not None:
            self.state.next_fault = int(seq) + 1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftrun-controller", daemon=True)

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    # ---- the loop ---------------------------------------------------------------------------
    def _next_fault(self, timeout: float) -> P.Fault | None:
        key = P.fault_key(self.state.next_fault)
        if not self.kv.wait([key], timeout):
            return None
        self.state.next_fault += 1
        return P.Fault.from_json(self.kv.get(key, 5.0))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                fault = self._next_fault(0.5)
                if fault is not None:
                    self.handle(fault)
            except StoreError as e:
                if self._stop.is_set():
                    return
                self.log.error("controller", f"store error in controller: {e}")
                time.sleep(0.2)

    def all_aware(self) -> bool:
        return all(self.kv.try_get(aware_key(r)) is not None for r in range(self.world_size))

    def absorbed(self, fault: P.Fault) -> bool:
        """A late report that the round in progress already covers (a bystander of a restart-all,
        or the failed rank itself reported twice). Any other fault is a new failure."""
        plan = self.current_plan
        if plan is None or fault.generation >= plan.generation:
            return False
        if fault.evidence.get("node_joined"):
            return False  # a replacement agent always gets the round that starts its ranks
        if plan.strategy in (P.RESTART_ALL, P.EXIT, P.DUMP):
            return True
        return fault.rank in plan.failed_ranks or fault.rank is None

    def note_node(self, node: int, lost: bool) -> None:
        """Membership news (any thread): a lost node cannot take part in a restart barrier."""
        with self._nodes_lock:
            if lost:
                self.lost_nodes.add(node)
            else:
                self.lost_nodes.discard(node)

    def handle(self, fault: P.Fault) -> None:
        st = self.state
        if self.absorbed(fault):
            self.log.info("fault-absorbed", f"fault of rank {fault.rank} ({fault.kind}) from "
                          f"generation {fault.generation} is part of the round already in progress",
                          rank=fault.rank, fault_kind=fault.kind)
            return
        if (self.current_plan is not None and fault.generation < self.current_plan.generation
                and self.current_plan.strategy in (P.RETRY, P.RECOVER_IN_PLACE)):
            # Another rank of the same round failed (e.g. every rank of a node): widen the round.
            fault.generation = self.current_plan.generation
        aware = self.all_aware()
        budget_left = st.restarts_used < self.max_restarts
        strategy, why = pick_strategy(FaultKind(fault.kind), self.chain, aware, budget_left,
                                      repeat_uce=bool(fault.evidence.get("repeat_uce")))
        if fault.rank is None and strategy in (P.RETRY, P.RECOVER_IN_PLACE):
            # A whole node (its agent) was lost or replaced: every rank restarts.
            strategy, why = pick_strategy(FaultKind(fault.kind), [s for s in self.chain if s not in (
                P.RETRY, P.RECOVER_IN_PLACE)], False, budget_left)
            why = f"node {fault.node}: {fault.message}; {why}"
        label = " [injected]" if fault.injected else ""
        self.log.info("decide", f"fault: rank {fault.rank} {fault.kind}{label} on node {fault.node} -> "
                      f"{strategy} ({why})", rank=fault.rank, fault_kind=fault.kind,
                      strategy=strategy, reason=why, injected=fault.injected)
        self.publish(strategy, fault, why)

    def publish(self, strategy: str, fault: P.Fault, reason: str, failed: list[int] | None = None,
                restart: list[int] | None = None) -> P.Plan:
        st = self.state
        g = st.generation + 1
        failed_ranks = sorted(set(failed or ([] if fault.rank is None else [fault.rank])))
        if strategy == P.RESTART_ALL:
            restart = list(range(self.world_size))
        elif strategy == P.RECOVER_IN_PLACE:
            restart = failed_ranks if restart is None else sorted(restart)
        else:
            restart = []
        if strategy in (P.RETRY, P.RECOVER_IN_PLACE, P.RESTART_ALL):
            st.restarts_used += 1
            self.kv.set(RESTARTS_USED, str(st.restarts_used).encode())
        plan = P.Plan(generation=g, strategy=strategy, failed_ranks=failed_ranks, restart_ranks=restart,
                      reason=reason, root_cause=dataclasses.asdict(fault),
                      restarts_used=st.restarts_used, max_restarts=self.max_restarts)
        st.generation = g
        self.current_plan = plan
        st.history.append({"generation": g, "strategy": strategy, "time": time.time()})
        self.kv.set(P.plan_key(g), plan.to_json())
        self.kv.set(P.GENERATION_KEY, str(g).encode())
        self.log.info("plan", f"generation {g}: {strategy}, failed ranks {failed_ranks}, restart "
                      f"{'all' if strategy == P.RESTART_ALL else restart}; restarts used "
                      f"{st.restarts_used}/{self.max_restarts}", generation=g, strategy=strategy,
                      failed_ranks=failed_ranks, restart_ranks=restart)
        if strategy == P.RESTART_ALL:
            self._release_restart_all(g, fault)
        elif strategy in (P.RECOVER_IN_PLACE, P.RETRY):
            self._drive_repair(plan, fault)
        elif strategy == P.DUMP:
            self._drive_dump(plan)
        return plan

    # ---- dying-gasp round -----------------------------------------------------------------
    def _drive_dump(self, plan: P.Plan) -> None:
        """Survivors report, then save the current step (the runtime's dump fallback) and exit."""
        g = plan.generation
        live = [r for r in range(self.world_size) if r not in plan.failed_ranks]
        keys = [P.status_key(g, r) for r in live]
        if not self.kv.wait(keys, self.phase_timeout):
            self.log.error("phase-timeout", f"generation {g}: survivors did not report within "
                           f"{self.phase_timeout:.0f}s; the dying-gasp checkpoint may be incomplete")
        statuses = [P.RankStatus.from_json(raw) for raw in (self.kv.try_get(k) for k in keys) if raw]
        healthy = [s for s in statuses if not (s.replacement or s.dirty)]
        resume = max((s.committed_step for s in healthy), default=-1) + 1
        repair = P.RepairPlan(generation=g, resume_step=resume, action="rollback", fallback=P.DUMP,
                              reason=f"dying-gasp checkpoint of step {resume}")
        self.kv.set(P.repair_key(g), repair.to_json())
        self.log.info("dump-plan", f"generation {g}: survivors save step {resume} and exit",
                      generation=g, resume_step=resume, ranks=[s.rank for s in healthy])

    # ---- restart-all round --------------------------------------------------------------------
    def _release_restart_all(self, g: int, fault: P.Fault) -> None:
        deadline = time.monotonic() + self.phase_timeout
        while not self.kv.wait([stopped_key(g) + "_all"], 0.05):
            with self._nodes_lock:
                need = self.nnodes - len(self.lost_nodes)
            raw = self.kv.try_get(stopped_key(g))
            if raw is not None and int(raw) >= need:
                break
            if time.monotonic() > deadline or self._stop.is_set():
                self.log.error("phase-timeout", f"generation {g}: not every node stopped its workers "
                               f"within {self.phase_timeout:.0f}s; releasing anyway")
                break
        n = self.kv.clear_except(P.ROOT + "/")
        self.kv.set(go_key(g), b"1")
        self.log.info("restart-all-go", f"generation {g}: all nodes stopped; cleared {n} worker keys; "
                      "workers restart", generation=g, cleared=n)

    # ---- process-level round -----------------------------------------------------------------
    def _drive_repair(self, plan: P.Plan, fault: P.Fault) -> None:
        from launcher.runtime.replicas import plan_repair  # the replica rules live with the runtime

        g = plan.generation
        keys = [P.status_key(g, r) for r in range(self.world_size)]
        t0 = time.monotonic()
        deadline = t0 + self.phase_timeout
        while not self.kv.wait(keys, 0.2):
            newer = self._peek_new_fault(g)
            if newer is not None:
                self.log.warning("round-superseded", f"generation {g}: rank {newer.rank} failed "
                                 f"({newer.kind}) during recovery; starting a new round")
                self.state.next_fault += 1
                failed = sorted(set(plan.failed_ranks) | ({newer.rank} if newer.rank is not None else set()))
                aware = self.all_aware()
                budget_left = self.state.restarts_used < self.max_restarts
                strategy, why = pick_strategy(FaultKind(newer.kind), self.chain, aware, budget_left)
                if strategy == P.RETRY:
                    strategy = P.RECOVER_IN_PLACE
                # ranks already restarted in this round keep their (live) replacements
                restart = None if strategy != P.RECOVER_IN_PLACE else (
                    [newer.rank] if newer.rank is not None else [])
                self.publish(strategy, newer, why, failed=failed, restart=restart)
                return
            if time.monotonic() > deadline or self._stop.is_set():
                missing = [r for r, k in enumerate(keys) if self.kv.try_get(k) is None]
                self.log.error("phase-timeout", f"generation {g}: ranks {missing} did not report "
                               f"within {self.phase_timeout:.0f}s; falling back to restart-all")
                self._fallback(g, fault, f"ranks {missing} did not report status")
                return
        statuses = [P.RankStatus.from_json(self.kv.get(k, 5.0)) for k in keys]
        repair = plan_repair(statuses, g)
        self.kv.set(P.repair_key(g), repair.to_json())
        self.log.info("repair-plan", f"generation {g}: resume at step {repair.resume_step} "
                      f"({repair.action}); transfers {repair.pairs or 'none'}"
                      + (f"; fallback {repair.fallback}: {repair.reason}" if repair.fallback else ""),
                      generation=g, resume_step=repair.resume_step, action=repair.action,
                      pairs=repair.pairs, fallback=repair.fallback,
                      status_wait_s=round(time.monotonic() - t0, 4))
        if repair.fallback:
            self._fallback(g, fault, repair.reason or "no healthy replica")

    def _fallback(self, g: int, fault: P.Fault, reason: str) -> None:
        """Peer repair impossible: the next strategy after the process-level ones."""
        rest = [s for s in self.chain if s not in (P.RETRY, P.RECOVER_IN_PLACE)]
        strategy = rest[0] if rest else P.EXIT
        if strategy == P.RESTART_ALL:
            # The failed round already counted against the budget; the fallback does not again.
            self.state.restarts_used -= 1
        self.log.warning("fallback", f"generation {g}: peer recovery impossible ({reason}); "
                         f"falling back to {strategy}", strategy=strategy, reason=reason)
        self.publish(strategy, fault, f"fallback: {reason}")

    def _peek_new_fault(self, g: int) -> P.Fault | None:
        raw = self.kv.try_get(P.fault_key(self.state.next_fault))
        if raw is None:
            return None
        f = P.Fault.from_json(raw)
        if self.absorbed(f):
            self.state.next_fault += 1
            self.log.info("fault-absorbed", f"fault of rank {f.rank} ({f.kind}) is part of this round",
                          rank=f.rank, fault_kind=f.kind)
            return None
        return f


def post_fault(kv: KVStore, fault: P.Fault) -> int:
    """Agents report a fault to the controller; returns its sequence number."""
    seq = kv.add(P.FAULT_SEQ, 1)
    kv.set(P.fault_key(seq), fault.to_json())
    return seq
