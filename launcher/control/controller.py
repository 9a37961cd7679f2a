"""The controller: runs on the leader agent and carries out the recovery decisions.

Owns: reading reported `Fault`s from the store in order, asking `launcher.control.decision` what to do
(the decision rules live there, nowhere else), publishing the resulting `Plan` for the next
generation, keeping the job-wide `--max_restarts` budget and the next fault to read in the
store (a controller elected on another node goes on from both), and driving the phases of a
round through the store with a timeout each: restart-all (wait until every node stopped its
workers, clear the worker keys, release them), process-level (collect every rank's status, write
the repair plan; a new fault meanwhile or an impossible repair leads to the decision's next
round), dump (collect the survivors' statuses, write the dying-gasp plan). Agents execute plans;
the in-worker runtime executes repair plans.

Ranks done with the job (`finished_ranks`: their agents set `P.finished_key` when a rank says
goodbye or exits 0; a mark from a process older than the rank's latest restart is stale) take
part in no round: every decision knows them (`decision` rule 6), and a round whose survivors
finish instead of reporting their status falls back at once, logging `peers-finished`.

Reports that may be consequences of another rank's fault (`decision.may_be_consequence`) are held
up to `window` seconds: the reports of that window and every node's progress records
(`launcher.control.progress`) become one fault (`decision.merge`), so one event is one round. The
controller refuses (logs `stale-write-refused`, decides nothing) a report stamped by an agent that
is no longer a member (`Fault.by_node`/`by_incarnation`, checked with `stale`): a node cut off,
declared dead or replaced cannot start a round in the job's newer generation. Before it writes a
plan it checks its own agent is still a member (`fence`); a fenced controller stops. The
controller also keeps the job's fault history (each fault, the strategies tried for it in order,
and how it ended), published with every plan for the failure summary.

Node loss (membership news from the leader agent, `note_node`): a lost node becomes a `node-lost`
fault naming its ranks, reported like any other (so it is ordered with the ranks' own reports);
its arrival (a hot spare or a replacement agent taking it over) is reported by the agent. While
a process-level round waits for the statuses of a lost node's ranks, the phase timeout does not
apply: the node has `node_replace_timeout` seconds from its loss to be taken over, after which
`decision.unreplaced` decides: the world shrinks (`_regroup`: the agent's `new_round` opens a new
rendezvous round without the lost node, then the plan, restart-all with `new_round` set, sends
every remaining agent into it; they stop their workers, rejoin, and restart every worker in the
smaller world), or the job ends with the reason (below --nnodes MIN, no restart-all in the chain,
no budget, a static rendezvous). The same new-round path grows the world with `--rdzv-conf
scale_up=restart` (torchrun's behaviour): agents waiting to get in (`waiting`) start a restart-all
in a new round that includes them (`decision.scale_up`).

Handoff (a controller elected on another node, `launcher.control.controller_role`): a controller goes on
from the store: generation, restart budget, next unread fault, and what it saves as it goes
(`launcher.control.controller_state`, fenced by its term): the fault history, the lost nodes waiting for
a new agent (their loss is not reported again, their node_replace_timeout runs on) and the agent
incarnations accounted for. `reconcile()` (before `start()`) compares that with the membership
now: a node lost meanwhile is reported lost, a node taken over meanwhile (a hot spare that
claimed it before this controller was elected) is reported as an arrival. The round the lost
controller was driving (its plan published, its phase not done) is taken up: the reports that
arrived meanwhile are decided first (a lost node's loss or arrival supersedes it with a new
generation that includes the node's ranks), else the round is driven to its end (statuses and
repair plan, the restart-all release, the dump plan).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from launcher.control import controller_state as CS
from launcher.control.decision import (
    PROCESS_LEVEL,
    Budget,
    Decision,
    Round,
    Situation,
    covered_by,
    culprit,
    decide,
    fallback,
    may_be_consequence,
    merge,
    scale_up,
    unreplaced,
)
from launcher.control.progress import read_progress
from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from launcher.protocol.faults import FaultKind
from rendezvous.errors import FencedError, RendezvousError
from rendezvous.kv import KVStore, StoreError


@dataclass
class ControllerState:
    generation: int = 0
    next_fault: int = 1
    budget: Budget = field(default_factory=lambda: Budget(0, 0))


class Controller:
    """Leader-side decision loop. Owned by the leader agent: `start()` / `stop()`."""

    def __init__(
        self,
        kv: KVStore,
        log: AgentLog,
        world_size: int,
        nnodes: int,
        max_restarts: int,
        chain: list[str],
        phase_timeout: float = 120.0,
        window: float = 2.0,
        node_replace_timeout: float = 600.0,
        min_nodes: int | None = None,
        stale: Callable[[int, int], str] | None = None,
        fence: Callable[[str], None] | None = None,
        transfer_stripes: int = 0,
        new_round: Callable[[], int] | None = None,
        waiting: Callable[[], int] | None = None,
        max_nodes: int = 0,
        world_round: int = 0,
    ) -> None:
        self.kv = kv
        # scale_up=restart: how many agents wait to get in (None: they wait as hot spares)
        self._waiting = waiting if new_round is not None else None
        self.max_nodes = max(max_nodes, nnodes)
        self._regrouping = False  # a new rendezvous round was requested: this world ends
        # opens a new rendezvous round without the lost nodes (Membership.request_round); None:
        # the rendezvous is static (node ranks fixed by --node-rank), the world cannot shrink
        self._new_round = new_round
        self._stale = stale  # why a report's writer (node, incarnation) is stale, "" when not
        self._fence = fence  # raises FencedError when this controller's agent is stale
        self.transfer_stripes = (
            transfer_stripes  # senders per replacement, 0: one per node (replicas.AUTO_STRIPES)
        )
        self.window = window
        self.history: list[dict] = []  # every fault handled: strategies tried, outcome
        self.log = log
        self.world_size = world_size
        self.nnodes = nnodes
        self.chain = tuple(chain)
        self.phase_timeout = phase_timeout
        self.round: Round | None = None  # the latest plan's round
        self.lost_nodes: set[int] = set()  # nodes whose agent is gone: they cannot stop workers
        self.node_replace_timeout = node_replace_timeout
        self.min_nodes = nnodes if min_nodes is None else min_nodes
        self._lost_at: dict[int, tuple[float, P.Fault]] = {}  # lost node -> (when, its fault)
        self._nodes_lock = threading.Lock()
        raw, used, seq, nxt = (
            kv.try_get(k)
            for k in (P.GENERATION_KEY, P.RESTARTS_USED_KEY, P.FAULT_SEQ, P.FAULT_NEXT_KEY)
        )
        self.state = ControllerState(
            generation=int(raw) if raw is not None else 0,
            next_fault=int(nxt) if nxt is not None else (int(seq) + 1 if seq is not None else 1),
            budget=Budget(int(used) if used is not None else 0, max_restarts),
        )
        self.term = CS.take_term(kv)  # fences the saved state against earlier controllers
        self.world_round = world_round  # the rendezvous round of this world (node numbering)
        self.known: dict[int, int] = {}  # node -> agent incarnation accounted for
        self._arriving: set[tuple[int, int]] = set()  # (node, incarnation) being reported now
        self._save_lock = threading.Lock()
        # rank -> generation of the latest plan that started a new process for it: a finished
        # mark from an earlier process of the rank (`finished_ranks`) is stale
        self._spawned_at: dict[int, int] = {}
        self._inherited = self._restore()  # the latest plan, when an earlier controller wrote it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftrun-controller", daemon=True)

    # ---- handoff: the state an earlier controller left in the store ------------------------
    def _restore(self) -> P.Plan | None:
        """History, lost nodes and known incarnations from the saved state; the round of the
        latest plan. Returns that plan (None at the job's start)."""
        saved = CS.load(self.kv)
        g = self.state.generation
        raw = self.kv.try_get(P.plan_key(g)) if g > 0 else None
        plan = P.Plan.from_json(raw) if raw is not None else None
        if saved is not None and saved.world_round == self.world_round:
            self.known = dict(saved.known)
            now_wall, now = time.time(), time.monotonic()
            for node, rec in saved.lost.items():
                fault = P.Fault.from_json(rec["fault"])
                self.lost_nodes.add(node)
                self._lost_at[node] = (now - max(0.0, now_wall - float(rec["at"])), fault)
        if saved is not None and (plan is None or saved.generation >= g):
            self.history = [dict(h) for h in saved.history]
        elif plan is not None:  # it died between publishing the plan and saving its state
            self.history = [dict(h) for h in plan.history]
        for gen in range(1, g + 1):  # who each published plan restarted
            raw_plan = self.kv.try_get(P.plan_key(gen))
            if raw_plan is not None:
                self._note_spawns(P.Plan.from_json(raw_plan))
        if plan is not None:
            cause = P.Fault.from_json(
                json.dumps(
                    plan.root_cause or {"kind": "exit", "rank": None, "node": -1, "generation": g}
                )
            )
            collecting = plan.strategy in PROCESS_LEVEL and self.kv.try_get(P.repair_key(g)) is None
            self.round = Round(
                g, plan.strategy, tuple(plan.failed_ranks), cause, collecting=collecting
            )
        return plan

    def _unfinished(self, plan: P.Plan) -> bool:
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

    def _resume(self) -> Decision | None:
        """Take up the round an earlier controller was driving (see the module docstring)."""
        plan = self._inherited
        if plan is None or not self._unfinished(plan):
            self._inherited = None
            return None
        g = plan.generation
        self.log.warning(
            "round-resumed",
            f"generation {g}: the {plan.strategy} round of the "
            "previous controller was in progress; this controller takes it up "
            f"(failed ranks {plan.failed_ranks})",
            generation=g,
            strategy=plan.strategy,
            failed_ranks=plan.failed_ranks,
        )
        while True:  # what was reported meanwhile first: it may supersede the round
            fault = self._take_fault(0.0)
            if fault is None:
                break
            d = self._decide(fault)
            if not d.absorbed:
                self._inherited = None
                return d
        if plan.strategy in PROCESS_LEVEL:
            d = self._drive_repair(plan)
            self._inherited = None
            return d
        if plan.strategy == P.RESTART_ALL:
            self._release_restart_all(g)
        elif plan.strategy == P.DUMP:
            self._drive_dump(plan)
        self._inherited = None
        return None

    def reconcile(self, members: dict[int, int], lost: list[int]) -> None:
        """Before `start()`: what changed in the membership while no controller heard of it.
        `members`: live node -> its agent's incarnation; `lost`: nodes with no live agent."""
        for node in sorted(lost):
            self.note_node(node, lost=True)  # a no-op for a loss already reported
        for node, inc in sorted(members.items()):
            was = self.known.get(node)
            if was is None:
                with self._nodes_lock:
                    self.known[node] = inc
            elif inc > was or node in self.lost_nodes:
                self.note_arrival(node, inc, host="", why="taken over while no controller ran")
        self._save()

    def _save(self) -> None:
        """The state a successor needs (`launcher.control.controller_state`); FencedError when a newer
        controller took over."""
        with self._nodes_lock:
            lost = {
                n: {"at": time.time() - (time.monotonic() - at), "fault": f.to_json().decode()}
                for n, (at, f) in self._lost_at.items()
            }
            known = dict(self.known)
        with self._save_lock:
            CS.save(
                self.kv,
                CS.SavedState(
                    self.term,
                    self.state.generation,
                    [dict(h) for h in self.history],
                    lost,
                    known,
                    self.world_round,
                ),
            )

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    # ---- the loop ---------------------------------------------------------------------------
    def _next_fault(self, timeout: float) -> P.Fault | None:
        """The next reported fault (consumed), waiting up to `timeout` s for it."""
        key = P.fault_key(self.state.next_fault)
        raw = (
            self.kv.try_get(key)
            if timeout <= 0
            else (self.kv.get(key, 5.0) if self.kv.wait([key], timeout) else None)
        )
        if raw is None:
            return None
        seq = self.state.next_fault
        self.state.next_fault += 1
        self.kv.set(P.FAULT_NEXT_KEY, str(self.state.next_fault).encode())
        fault = P.Fault.from_json(raw)
        why = (
            self._stale(fault.by_node, fault.by_incarnation)
            if (self._stale is not None and fault.by_node is not None and fault.by_incarnation)
            else ""
        )
        if why:
            self.log.error(
                "stale-write-refused",
                f"fault #{seq} of rank {fault.rank} from node "
                f"{fault.by_node} (incarnation {fault.by_incarnation}, generation "
                f"{fault.generation}) refused: the writer is stale ({why}); the job is "
                f"at generation {self.state.generation}",
                rank=fault.rank,
                stale_node=fault.by_node,
                incarnation=fault.by_incarnation,
                stale_generation=fault.generation,
                seq=seq,
                where="controller",
            )
            return None
        return fault

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._regrouping:  # this world ends: its agents move to the new round
                self._stop.wait(0.2)
                continue
            try:
                if self._inherited is not None:  # again after a store error
                    self._run_rounds(self._resume())
                    continue
                overdue = self._unreplaced() or self._scale_up()
                if overdue is not None:
                    self._run_rounds(overdue)
                    continue
                fault = self._take_fault(0.5)
                if fault is not None:
                    self.handle(fault)
            except FencedError as e:
                self.log.error("controller-fenced", f"this controller is stale and stops: {e}")
                return
            except StoreError as e:
                if self._stop.is_set():
                    return
                self.log.error("controller", f"store error in controller: {e}")
                time.sleep(0.2)

    def _take_fault(self, timeout: float) -> P.Fault | None:
        """The next fault to decide about: a report that may be a consequence is held for the
        window and merged with what else arrives (see the module docstring)."""
        fault = self._next_fault(timeout)
        if fault is None or not may_be_consequence(fault) or covered_by(fault, self.round):
            return fault
        batch = [fault]
        deadline = time.monotonic() + self.window
        while True:
            progress = read_progress(self.kv, self.nnodes)
            reporters = sorted({f.rank for f in batch if f.rank is not None})
            if (
                not all(may_be_consequence(f) for f in batch)
                or culprit(batch, progress)
                or len(reporters) >= self.world_size
                or time.monotonic() >= deadline
            ):
                break
            more = self._next_fault(min(0.2, max(0.0, deadline - time.monotonic())))
            if more is not None:
                batch.append(more)
        merged = merge(batch, progress)
        if len(batch) > 1 or merged.rank != fault.rank or merged.kind != fault.kind:
            self.log.warning(
                "fault-merged",
                f"{len(batch)} report(s) from ranks {reporters} are one "
                f"fault: rank {merged.rank} {merged.kind} ({merged.message})",
                rank=merged.rank,
                fault_kind=merged.kind,
                reporters=reporters,
                reports=len(batch),
            )
        return merged

    def all_aware(self) -> bool:
        return all(self.kv.try_get(P.aware_key(r)) is not None for r in range(self.world_size))

    def situation(self, fault: P.Fault | None = None) -> Situation:
        return Situation(
            self.chain,
            self.state.budget,
            self.all_aware(),
            self.world_size,
            self.round,
            self.finished_ranks(fault),
        )

    def _note_spawns(self, plan: P.Plan) -> None:
        for r in plan.restart_ranks:  # every rank for restart-all
            self._spawned_at[r] = plan.generation

    def finished_ranks(self, fault: P.Fault | None = None) -> tuple[int, ...]:
        """Ranks whose current process is done with the job (`P.finished_key`, set by their
        agents), with the ones `fault`'s agent saw finished when it reported (its evidence; it
        may be ahead of the store)."""
        out = set()
        for key in self.kv.keys(P.FINISHED_PREFIX):
            raw = self.kv.try_get(key)
            try:
                rank, gen = int(key[len(P.FINISHED_PREFIX) :]), int(raw or b"-1")
            except ValueError:
                continue
            if gen >= self._spawned_at.get(rank, 0):
                out.add(rank)
        if fault is not None and fault.generation >= self.state.generation:
            out.update(int(r) for r in fault.evidence.get("finished_ranks") or ())
        return tuple(sorted(r for r in out if 0 <= r < self.world_size))

    def node_of(self, rank: int) -> int:
        """The group rank (node) running global rank `rank` (the inverse of `ranks_of`)."""
        return rank // max(1, self.world_size // max(1, self.nnodes))

    def ranks_of(self, node: int) -> list[int]:
        """The global ranks of group rank `node` (every node runs the same number)."""
        per = self.world_size // max(1, self.nnodes)
        return list(range(node * per, (node + 1) * per))

    def note_node(self, node: int, lost: bool, why: str = "", host: str = "") -> None:
        """Membership news (any thread): a lost node cannot take part in a restart barrier; its
        loss is reported as a `node-lost` fault (first news of it only), its deadline for a
        replacement starts."""
        with self._nodes_lock:
            if not lost:
                self.lost_nodes.discard(node)
                self._lost_at.pop(node, None)
                return
            first = node not in self.lost_nodes
            self.lost_nodes.add(node)
        if not first:
            return
        fault = P.Fault(
            kind=FaultKind.NODE_LOST.value,
            rank=None,
            node=node,
            generation=self.state.generation,
            message=why or "its agent is gone",
            host=host,
            evidence={"node_lost": why or True, "node_ranks": self.ranks_of(node)},
        )
        with self._nodes_lock:
            self._lost_at[node] = (time.monotonic(), fault)
        seq = post_fault(self.kv, fault)
        self._save()
        self.log.info(
            "fault-reported",
            f"node {node} lost ({fault.message}): reported as fault "
            f"#{seq}; its ranks {fault.evidence['node_ranks']} wait up to "
            f"node_replace_timeout={self.node_replace_timeout:g}s for a hot spare or a "
            "replacement agent",
            seq=seq,
            lost_node=node,
        )

    def note_arrival(
        self, node: int, incarnation: int, host: str = "", why: str = ""
    ) -> int | None:
        """A hot spare or replacement agent (agent incarnation `incarnation`; 0 when unknown)
        holds `node` now: report its arrival, the round that starts the node's ranks. Once per
        incarnation; returns the fault's number, None when already reported."""
        key = (node, incarnation)
        with self._nodes_lock:  # checked and claimed at once: the takeover's reconcile and the
            # membership watch may both bring the same arrival (one report, one round)
            if incarnation and (
                key in self._arriving
                or (self.known.get(node) == incarnation and node not in self.lost_nodes)
            ):
                return None
            if incarnation:
                self._arriving.add(key)
        try:
            if self._fence is not None:
                self._fence(P.FAULT_SEQ)
            msg = f"hot spare or replacement agent for node {node}" + (f" ({why})" if why else "")
            seq = post_fault(
                self.kv,
                P.Fault(
                    kind=FaultKind.NODE_LOST.value,
                    rank=None,
                    node=node,
                    generation=self.state.generation,
                    message=msg,
                    host=host,
                    evidence={
                        "node_joined": True,
                        "node_ranks": self.ranks_of(node),
                        "incarnation": incarnation,
                    },
                ),
            )
            with self._nodes_lock:  # accounted for once its report is in the store
                if incarnation:
                    self.known[node] = incarnation
                self.lost_nodes.discard(node)
                self._lost_at.pop(node, None)
        finally:
            with self._nodes_lock:
                self._arriving.discard(key)
        self.log.info(
            "fault-reported",
            f"node {node} taken over (incarnation {incarnation}"
            + (f", {why}" if why else "")
            + f"): reported as fault #{seq}",
            seq=seq,
            joined_node=node,
        )
        self._save()
        return seq

    def _unreplaced(self) -> Decision | None:
        """The decision for a lost node not taken over within node_replace_timeout (once)."""
        now = time.monotonic()
        if self._regrouping:
            return None
        with self._nodes_lock:
            late = [
                (n, at, f)
                for n, (at, f) in self._lost_at.items()
                if now - at >= self.node_replace_timeout
            ]
            for n, _, _ in late:
                del self._lost_at[n]
            left = self.nnodes - len(self.lost_nodes)
        if not late:
            return None
        node, at, fault = min(late, key=lambda x: x[1])
        renumber = (
            ""
            if self._new_round is not None
            else (
                "a static rendezvous (--node-rank) cannot renumber the nodes; restart the lost "
                "node's agent with the same --node-rank, or use --rdzv-backend c10d|etcd"
            )
        )
        d = unreplaced(
            fault,
            now - at,
            self.node_replace_timeout,
            left,
            self.min_nodes,
            self.situation(),
            self.nnodes,
            renumber,
        )
        if d.shrink:
            self.log.warning(
                "world-shrink",
                d.reason,
                lost_node=node,
                reason=fault.message,
                strategy=d.strategy,
                nodes_left=left,
                world_size=self.world_size,
                new_world_size=len(d.restart_ranks),
                waited_s=round(now - at, 3),
                node_replace_timeout=self.node_replace_timeout,
            )
        else:
            self.log.error("node-not-replaced", d.reason, lost_node=node, strategy=d.strategy)
        return d

    def _scale_up(self) -> Decision | None:
        """scale_up=restart: a new round for the agents waiting to get in (once per world)."""
        if self._waiting is None or self._regrouping:
            return None
        with self._nodes_lock:
            nodes = self.nnodes - len(self.lost_nodes)
        if nodes >= self.max_nodes:
            return None
        d = scale_up(
            self._waiting(),
            nodes,
            self.max_nodes,
            self.world_size // max(1, self.nnodes),
            self.round,
        )
        if d is not None:
            self.log.warning(
                "world-grow", d.reason, strategy=d.strategy, nodes=nodes, world_size=self.world_size
            )
        return d

    def _waiting_for_node(self, missing: list[int]) -> bool:
        """True when every rank in `missing` is on a lost node that may still be taken over."""
        with self._nodes_lock:
            waiting = {r for n in self._lost_at for r in self.ranks_of(n)}
        return bool(missing) and set(missing) <= waiting

    def _run_rounds(self, decision: Decision | None) -> None:
        while decision is not None and not decision.absorbed and not self._stop.is_set():
            decision = self.execute(decision)

    def handle(self, fault: P.Fault) -> None:
        """Decide about one reported fault, then run rounds until none follows."""
        self._run_rounds(self._decide(fault))

    def _decide(self, fault: P.Fault) -> Decision:
        d = decide(fault, self.situation(fault))
        if d.peers_finished and not d.absorbed:
            self._log_peers_finished(fault, d)
        if d.absorbed:
            self.log.info(
                "fault-absorbed",
                f"fault of rank {fault.rank} ({fault.kind}) from "
                f"generation {fault.generation}: {d.reason}",
                rank=fault.rank,
                fault_kind=fault.kind,
            )
            return d
        if d.supersedes is not None:  # one event for it (events.jsonl readers rely on that)
            what = (
                f"rank {fault.rank} failed ({fault.kind})"
                if fault.rank is not None
                else f"node {fault.node} "
                + ("taken over" if fault.evidence.get("node_joined") else "lost")
            )
            self.log.warning(
                "round-superseded",
                f"generation {d.supersedes}: {what} during "
                f"recovery; starting a new round ({d.reason})",
                rank=fault.rank,
                fault_kind=fault.kind,
                strategy=d.strategy,
                reason=d.reason,
            )
            return d
        label = " [injected]" if fault.injected else ""
        who = (
            f"rank {fault.rank} {fault.kind}"
            if fault.rank is not None
            else f"no rank, {fault.kind}"
        )
        self.log.info(
            "decide",
            f"fault: {who}{label} on node {fault.node} -> {d.strategy} ({d.reason})",
            rank=fault.rank,
            fault_kind=fault.kind,
            strategy=d.strategy,
            reason=d.reason,
            injected=fault.injected,
        )
        return d

    def _log_peers_finished(self, fault: P.Fault, d: Decision, g: int | None = None) -> None:
        """One line: the root cause first, then why no process-level round can repair it
        (`g`: the round whose survivors finished meanwhile)."""
        who = f"rank {fault.rank}" if fault.rank is not None else f"node {fault.node}"
        when = "" if g is None else f" during generation {g}'s recovery round"
        self.log.warning(
            "peers-finished",
            f"{who} (generation {fault.generation}) failed: "
            f"{fault.kind}: {fault.message}; its peers {list(d.peers_finished)} "
            f"finished the job{when}, so process-level repair is impossible: "
            f"{d.strategy}",
            rank=fault.rank,
            fault_kind=fault.kind,
            generation=fault.generation,
            round=g,
            finished_ranks=list(d.peers_finished),
            strategy=d.strategy,
        )

    def execute(self, decision: Decision) -> Decision | None:
        """Publish the decision's plan and drive its round; returns what must follow (a fault
        that superseded the round, or its fallback), None when the round is in the agents' and
        workers' hands."""
        if decision.shrink or decision.grow:
            return self._regroup(decision)
        plan = self.publish(decision)
        if plan.strategy == P.RESTART_ALL:
            self._release_restart_all(plan.generation)
        elif plan.strategy in PROCESS_LEVEL:
            return self._drive_repair(plan)
        elif plan.strategy == P.DUMP:
            self._drive_dump(plan)
        return None

    def _regroup(self, decision: Decision) -> Decision | None:
        """Restart-all in a new world (without the lost nodes, or with the waiting ones): open
        the new rendezvous round first (so every agent that reads the plan finds it), then
        publish the plan that sends them into it. The agents stop their workers, rejoin, and
        restart every worker in the new world; a new controller starts on the new leader (this
        one is stopped with its world)."""
        assert self._new_round is not None and decision.cause is not None
        try:
            rnd = self._new_round()
        except RendezvousError as e:
            if decision.grow:  # the world goes on as it is
                self.log.error("world-grow", f"the new rendezvous round could not start: {e}")
                self._waiting = None
                return None
            return dataclasses.replace(
                decision,
                strategy=P.EXIT,
                shrink=False,
                charged=False,
                restart_ranks=(),
                reason=f"{decision.reason}; but the new rendezvous round could not start: {e}",
            )
        self._regrouping = True
        self.publish(decision, new_round=rnd)
        return None

    def publish(self, decision: Decision, new_round: int = 0) -> P.Plan:
        assert decision.strategy is not None and decision.cause is not None
        st = self.state
        g = st.generation + 1
        strategy = decision.strategy
        if self._fence is not None:
            self._fence(P.plan_key(g))  # a stale controller publishes nothing
        CS.check_term(self.kv, self.term, P.plan_key(g))  # nor one a successor took over from
        if decision.charged:
            st.budget = st.budget.charge()
            self.kv.set(P.RESTARTS_USED_KEY, str(st.budget.used).encode())
        self._note_history(decision, g)
        plan = P.Plan(
            generation=g,
            strategy=strategy,
            failed_ranks=list(decision.failed_ranks),
            restart_ranks=list(decision.restart_ranks),
            reason=decision.reason,
            root_cause=dataclasses.asdict(decision.cause),
            restarts_used=st.budget.used,
            history=[dict(h) for h in self.history],
            new_round=new_round,
        )
        st.generation = g
        self._note_spawns(plan)
        self.round = Round(
            g, strategy, decision.failed_ranks, decision.cause, collecting=strategy in PROCESS_LEVEL
        )
        self.kv.set(P.plan_key(g), plan.to_json())
        self.kv.set(P.GENERATION_KEY, str(g).encode())
        self._save()
        where = (
            ""
            if not new_round
            else (
                f" in rendezvous round {new_round} with the waiting node(s)"
                if decision.grow
                else f" in rendezvous round {new_round} without node(s) {sorted(self.lost_nodes)} "
                f"(world size {len(plan.restart_ranks)})"
            )
        )
        self.log.info(
            "plan",
            f"generation {g}: {strategy}{where}, failed ranks "
            f"{plan.failed_ranks}, restart "
            f"{'all' if strategy == P.RESTART_ALL else plan.restart_ranks}; restarts used "
            f"{st.budget.used}/{st.budget.limit}",
            generation=g,
            strategy=strategy,
            failed_ranks=plan.failed_ranks,
            restart_ranks=plan.restart_ranks,
            charged=decision.charged,
            **({"new_round": new_round} if new_round else {}),
            **({"scale_up": True} if decision.grow else {}),
        )
        return plan

    def _note_history(self, decision: Decision, g: int) -> None:
        """The fault history: a fallback continues the current fault's handling; any other
        decision starts a new entry (the previous one ends: superseded, or already recovered)."""
        assert decision.strategy is not None and decision.cause is not None
        cur = self.history[-1] if self.history else None
        if decision.continues and cur is not None:
            cur["handling"].append([decision.strategy, g])
        else:
            if cur is not None and cur["outcome"] == "in progress":
                cur["outcome"] = (
                    f"superseded by rank {decision.cause.rank} {decision.cause.kind} "
                    f"in generation {g}"
                )
            c = decision.cause
            self.history.append(
                {
                    "rank": c.rank,
                    "kind": c.kind,
                    "node": c.node,
                    "pid": c.pid,
                    "message": c.message[:500],
                    "injected": c.injected,
                    "time": c.time,
                    "handling": [[decision.strategy, g]],
                    "outcome": "in progress",
                    "consequences": len(c.evidence.get("consequences", [])),
                }
            )
        if decision.strategy in (P.EXIT, P.DUMP):
            self.history[-1]["outcome"] = f"failed: {decision.reason}"

    def _outcome(self, g: int, outcome: str) -> None:
        """Generation `g`'s round completed: its fault's outcome."""
        cur = self.history[-1] if self.history else None
        if cur is not None and cur["handling"][-1][1] == g and cur["outcome"] == "in progress":
            cur["outcome"] = outcome
            self._save()

    # ---- dying-gasp round -----------------------------------------------------------------
    def _drive_dump(self, plan: P.Plan) -> None:
        """Survivors report, then save the current step (the runtime's dump fallback) and exit."""
        from launcher.control.repair_planning import plan_dump

        g = plan.generation
        live = [r for r in range(self.world_size) if r not in plan.failed_ranks]
        keys = [P.status_key(g, r) for r in live]
        deadline = time.monotonic() + self.phase_timeout
        while not self.kv.wait(keys, 0.2):
            gone = self._finished_without_status(g, plan.failed_ranks)
            if gone:
                self.log.error(
                    "dump-incomplete",
                    f"generation {g}: ranks {gone} finished the job "
                    "instead of reporting their status; the dying-gasp checkpoint "
                    "has the other survivors' state only",
                    finished_ranks=gone,
                )
                break
            if time.monotonic() > deadline:
                self.log.error(
                    "phase-timeout",
                    f"generation {g}: survivors did not report within "
                    f"{self.phase_timeout:.0f}s; the dying-gasp checkpoint may be "
                    "incomplete",
                )
                break
        statuses = [
            P.RankStatus.from_json(raw) for raw in (self.kv.try_get(k) for k in keys) if raw
        ]
        repair = plan_dump(statuses, g)
        self.kv.set(P.repair_key(g), repair.to_json())
        self.log.info(
            "dump-plan",
            f"generation {g}: survivors save step {repair.resume_step} and exit",
            generation=g,
            resume_step=repair.resume_step,
            writers=repair.writers,
        )

    # ---- restart-all round --------------------------------------------------------------------
    def _release_restart_all(self, g: int) -> None:
        deadline = time.monotonic() + self.phase_timeout
        while not self.kv.wait([P.all_stopped_key(g)], 0.05):
            with self._nodes_lock:
                need = self.nnodes - len(self.lost_nodes)
            raw = self.kv.try_get(P.stopped_key(g))
            if raw is not None and int(raw) >= need:
                break
            if self._stop.is_set():
                return  # stopped (deposed, or its agent leaves): a successor releases it
            if time.monotonic() > deadline:
                self.log.error(
                    "phase-timeout",
                    f"generation {g}: not every node stopped its workers "
                    f"within {self.phase_timeout:.0f}s; releasing anyway",
                )
                break
        n = self.kv.clear_except(P.ROOT + "/")
        self.kv.set(P.go_key(g), b"1")
        self._outcome(g, "restarted (restart-all)")
        self.log.info(
            "restart-all-go",
            f"generation {g}: all nodes stopped; cleared {n} worker keys; workers restart",
            generation=g,
            cleared=n,
        )

    # ---- process-level round -----------------------------------------------------------------
    def _drive_repair(self, plan: P.Plan) -> Decision | None:
        """Collect every rank's status, then write the repair plan. A new fault meanwhile
        supersedes the round; missing statuses or no healthy replica make it fall back."""
        from launcher.control.repair_planning import plan_repair

        g = plan.generation
        keys = [P.status_key(g, r) for r in range(self.world_size)]
        t0 = time.monotonic()
        deadline = t0 + self.phase_timeout
        while not self.kv.wait(keys, 0.2):
            newer = self._take_fault(0.0)
            if newer is not None:
                d = self._decide(newer)
                if not d.absorbed:
                    return d
                continue
            overdue = self._unreplaced() or self._scale_up()
            if overdue is not None:
                return overdue
            if self._stop.is_set():
                return None  # stopped (deposed, or its agent leaves): a successor takes it up
            gone = self._finished_without_status(g, plan.failed_ranks)
            if gone:
                return self._fallback(
                    g,
                    f"ranks {gone} finished the job instead of reporting "
                    "their status (the stop came after their last step)",
                )
            if time.monotonic() > deadline:
                missing = [r for r, k in enumerate(keys) if self.kv.try_get(k) is None]
                if self._waiting_for_node(missing):
                    continue  # node_replace_timeout bounds this wait (_unreplaced)
                self.log.error(
                    "phase-timeout",
                    f"generation {g}: ranks {missing} did not report "
                    f"within {self.phase_timeout:.0f}s",
                )
                return self._fallback(g, f"ranks {missing} did not report status")
        statuses = [P.RankStatus.from_json(self.kv.get(k, 5.0)) for k in keys]
        repair = plan_repair(statuses, g, self.transfer_stripes, self.node_of)
        self.kv.set(P.repair_key(g), repair.to_json())
        if self.round is not None and self.round.generation == g:
            self.round = dataclasses.replace(self.round, collecting=False)
        self.log.info(
            "repair-plan",
            f"generation {g}: resume at step {repair.resume_step} "
            f"({repair.action}); transfers {repair.pairs or 'none'}"
            + (f"; fallback {repair.fallback}: {repair.reason}" if repair.fallback else ""),
            generation=g,
            resume_step=repair.resume_step,
            action=repair.action,
            pairs=repair.pairs,
            fallback=repair.fallback,
            status_wait_s=round(time.monotonic() - t0, 4),
        )
        if repair.fallback:
            return self._fallback(g, repair.reason or "no healthy replica")
        self._outcome(g, "recovered")
        return None

    def _finished_without_status(self, g: int, failed: list[int]) -> list[int]:
        """Ranks of generation `g`'s round that finished the job without reporting a status:
        they never will."""
        return [
            r
            for r in self.finished_ranks()
            if r not in failed and self.kv.try_get(P.status_key(g, r)) is None
        ]

    def _fallback(self, g: int, reason: str) -> Decision:
        """Peer repair impossible: the decision's fallback rule picks what follows."""
        d = fallback(self.situation(), reason)
        if d.peers_finished and self.round is not None:
            self._log_peers_finished(self.round.cause, d, g)
        self.log.warning(
            "fallback",
            f"generation {g}: peer recovery impossible ({reason}); falling back to {d.strategy}",
            strategy=d.strategy,
            reason=reason,
        )
        return d


def post_fault(kv: KVStore, fault: P.Fault) -> int:
    """Agents report a fault to the controller; returns its sequence number."""
    seq = kv.add(P.FAULT_SEQ, 1)
    kv.set(P.fault_key(seq), fault.to_json())
    return seq
