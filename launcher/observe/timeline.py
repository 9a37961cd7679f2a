"""What happened in a run, rebuilt from its events: nodes, ranks, faults and recovery rounds.

Owns: `Timeline`, which consumes events (the records of `events.jsonl`, in time order, from one
or more agents of one run), one handler per event kind, and answers `view()` with a `RunView`
(the records, `launcher.observe.run_view`): the job summary, one `NodeRow` per node, one
`RankRow` per rank, every `FaultRow` with the strategy taken and what it cost, every recovery
`Round` with its per-rank phase `Bar`s (derived from the round's edges by
`launcher.observe.round_phases`), each round's and the job's time lost (the rule in
`launcher.observe.run_view`), the training progress of every rank, and the world's size
over time (`launcher.observe.world_history`: the ranks a round waits for are its world's). It
is fed a whole file by `ftctl status RUN_DIR` and `ftctl report`, and event by event (plus the
heartbeat observations) by the agent's observer, so the live view and the report agree.

Phases of a round, per rank (wall-clock edges from the events named):
  detect    the failed rank: fault time (exit time, or last progress of a hang) -> agent saw it
  decide    the failed rank: detection -> the controller's `plan`
  stop      survivors: their agent got the plan -> the rank left its collectives and posted its
            status (`rank-recovered.marks.status`, or `rank-stopped` from its heartbeat);
            restart-all: plan -> every node stopped
  respawn, imports, start-up, wait, rebuild, transfer
            a process-level round, per rank: `launcher.observe.process_phases`
  respawn   restart-all: every node stopped -> the new process's `hello`
  resume    state ready -> the first step after the round committed (`rank-resumed`)
"""

from __future__ import annotations

from typing import Any

from launcher.observe.round_phases import RoundBuilder, charge_faults
from launcher.observe.run_view import (
    PROCESS_LEVEL,
    FaultRow,
    NodeRow,
    RankRow,
    Round,
    RoundData,
    RunView,
)
from launcher.observe.world_history import WorldBook


class Timeline:
    """Incremental: `feed(event)` in time order, `view()` at any point."""

    def __init__(self) -> None:
        self.v = RunView()
        self._ranks: dict[int, RankRow] = {}
        self._nodes: dict[int, NodeRow] = {}
        self._rounds: dict[int, RoundData] = {}
        self._pending: dict[int | None, FaultRow] = {}  # detected, not decided yet
        self._hang: dict[int, float] = {}
        self._injected: set[int] = set()
        self._last_decided: FaultRow | None = None
        self._aware: set[int] = set()
        self._last_time = 0.0
        self.world = WorldBook()

    # ------------------------------------------------------------------ feeding
    def feed_all(self, events: list[dict]) -> "Timeline":
        for ev in sorted(events, key=lambda e: e.get("time", 0.0)):
            self.feed(ev)
        return self

    def feed(self, ev: dict) -> None:
        kind = ev.get("event", "")
        t = float(ev.get("time", 0.0))
        self._last_time = max(self._last_time, t)
        node = ev.get("node")
        if isinstance(node, int) and kind != "heartbeat":
            self._node(node, ev).last_seen = t
        handler = _HANDLERS.get(kind)
        if handler is not None:
            handler(self, ev, t)
        self.world.feed(kind, ev, t)

    def _node(self, node: int, ev: dict | None = None) -> NodeRow:
        row = self._nodes.get(node)
        if row is None:
            row = self._nodes[node] = NodeRow(node=node)
        if ev is not None and ev.get("host") and not row.host:
            row.host = str(ev["host"])
        return row

    def rank(self, rank: int) -> RankRow:
        row = self._ranks.get(rank)
        if row is None:
            row = self._ranks[rank] = RankRow(rank=rank)
        return row

    def _round(self, generation: int) -> RoundData | None:
        return self._rounds.get(generation)

    # ---- job-level events
    def _on_start(self, ev: dict, t: float) -> None:
        cfg = ev.get("config") or {}
        v = self.v
        v.start = t if v.start is None else min(v.start, t)
        v.run_id = str(cfg.get("rdzv_id", v.run_id))
        v.script = str(cfg.get("script", v.script))
        v.max_restarts = int(cfg.get("max_restarts", v.max_restarts) or 0)
        v.nnodes = int(cfg.get("max_nodes", v.nnodes or 1) or 1)

    def _on_rendezvous(self, ev: dict, t: float) -> None:
        node = ev.get("group_rank", ev.get("node"))
        if isinstance(node, int):
            self._node(node, ev).state = "running"
        if ev.get("world_size"):
            self.v.world_size = int(ev["world_size"])
        if ev.get("log_dir") and ev["log_dir"] not in self.v.log_dirs:
            self.v.log_dirs.append(str(ev["log_dir"]))

    def _on_store_address(self, ev: dict, t: float) -> None:
        self.v.store_addr = str(ev.get("addr", ""))

    def _on_job_done(self, ev: dict, t: float) -> None:
        self.v.outcome, self.v.end = "succeeded", t
        self._finish_node(ev, "done")

    def _on_job_failed(self, ev: dict, t: float) -> None:
        self.v.outcome, self.v.end = "failed", t
        self._finish_node(ev, "failed")

    def _finish_node(self, ev: dict, state: str) -> None:
        if isinstance(ev.get("node"), int):
            self._node(ev["node"]).state = state

    def _on_node_done(self, ev: dict, t: float) -> None:
        self._finish_node(ev, "done")

    def _on_signal(self, ev: dict, t: float) -> None:
        self._finish_node(ev, "signalled")

    def _on_node_lost(self, ev: dict, t: float) -> None:
        if isinstance(ev.get("lost_node"), int):
            self._node(ev["lost_node"]).state = "lost"

    def _on_node_joined(self, ev: dict, t: float) -> None:
        if isinstance(ev.get("joined_node"), int):
            self._node(ev["joined_node"]).state = "running"

    def _on_world_shrink(self, ev: dict, t: float) -> None:
        """A lost node nobody took over: the controller continues on the remaining nodes (a
        restart-all in a new rendezvous round, whose `plan` follows without a `decide`). A live
        shrink (elastic-training: `dropped`, no `lost_node`) is the failed rank's own round:
        no fault of its own, the world smaller from then on (`WorldBook`)."""
        if "lost_node" not in ev:
            return
        node = ev.get("lost_node")
        if isinstance(node, int):
            self._node(node).state = "lost"
        f = node_lost_fault(ev, t)
        self.v.faults.append(f)
        self._last_decided = f

    def _on_round_joined(self, ev: dict, t: float) -> None:
        """An agent entered a smaller world (new rendezvous round): node and rank rows beyond
        it belonged to the old numbering."""
        nnodes, world = ev.get("nnodes"), ev.get("world_size")
        if isinstance(nnodes, int):
            for n in [n for n in self._nodes if n >= nnodes]:
                del self._nodes[n]
            self.v.nnodes = nnodes
        if isinstance(world, int):
            for r in [r for r in self._ranks if r >= world]:
                del self._ranks[r]
            self.v.world_size = world

    def _on_spare(self, ev: dict, t: float) -> None:
        if isinstance(ev.get("node"), int) and "started" in str(ev.get("message", "")):
            self._node(ev["node"]).spare = True

    def _on_spare_ready(self, ev: dict, t: float) -> None:
        if isinstance(ev.get("node"), int) and isinstance(ev.get("ready"), int):
            self._node(ev["node"]).spares_now_ready(ev["ready"], ev.get("since_job_s"))

    # ---- ranks
    def _on_spawn(self, ev: dict, t: float) -> None:
        r = self.rank(int(ev["rank"]))
        gen = int(ev.get("generation", 0))
        if r.pid is not None and not ev.get("overtook"):  # a spare overtaking: the same restart
            r.restarts += 1
        r.node, r.local_rank, r.pid, r.generation = (
            ev.get("node"),
            ev.get("local_rank"),
            ev.get("pid"),
            gen,
        )
        r.replacement = bool(ev.get("replacement"))
        r.state, r.phase, r.last_seen = ("replacement" if r.replacement else "starting"), "init", t
        r.step, r.steps_per_s = None, None
        self._aware.discard(r.rank)
        if ev.get("warm") and isinstance(ev.get("node"), int):
            self._node(ev["node"]).spare_taken()
        rd = self._round(gen)
        if rd is not None:
            rd.spawned[r.rank] = {**ev, "time": t}

    def _on_hello(self, ev: dict, t: float) -> None:
        rank = int(ev["rank"])
        self._aware.add(rank)
        rd = self._round(self.rank(rank).generation)
        if rd is not None:
            rd.hello.setdefault(rank, t)

    def _on_exit(self, ev: dict, t: float) -> None:
        r = self.rank(int(ev["rank"]))
        if ev.get("pid") not in (None, r.pid):
            return
        # killed for hanging at exit, or died in its teardown, after its goodbye: done
        done = ev.get("exitcode") == 0 or bool(ev.get("hung_at_exit") or ev.get("after_goodbye"))
        r.state = "finished" if done else "stopped"
        r.phase, r.last_seen = "done" if done else r.phase, t
        if done:
            r.steps_per_s = None

    def _on_progress(self, ev: dict, t: float) -> None:
        for key, p in (ev.get("ranks") or {}).items():
            r = self.rank(int(key))
            r.step, r.committed_step = p.get("step"), p.get("committed_step")
            if r.state in ("finished", "failed", "stopped"):
                pass  # a sample taken as the process ended: its steps count, not its phase
            else:
                r.phase, r.steps_per_s, r.last_seen = (
                    str(p.get("phase", "")),
                    p.get("steps_per_s"),
                    t,
                )
                if r.state not in ("finished", "failed", "stopped"):
                    r.state = _state_of(r.phase, bool(p.get("waiting")), r.state)
            if r.committed_step is not None and r.committed_step >= 0:
                self._point(r.rank, t, r.committed_step)

    def _on_steps(self, ev: dict, t: float) -> None:
        """A batch of committed steps (`launcher.observe.step_points`): the progress chart's
        points and each rank's last committed step (also once it finished)."""
        t0 = float(ev.get("t0") or t)
        for key, pts in (ev.get("ranks") or {}).items():
            r = self.rank(int(key))
            for dt, step in pts:
                self._point(r.rank, t0 + float(dt), int(step))
            if pts:
                r.committed_step = int(pts[-1][1])

    def _point(self, rank: int, t: float, step: int) -> None:
        series = self.v.progress.setdefault(rank, [])
        if not series or series[-1][1] != step or t - series[-1][0] > 5.0:
            series.append([round(t, 4), step])

    # ---- faults and decisions
    def _on_worker_failed(self, ev: dict, t: float) -> None:
        rank = int(ev["rank"])
        r = self.rank(rank)
        r.state, r.last_seen, r.steps_per_s = "failed", t, None
        began = t - float(ev.get("detect_ms") or 0.0) / 1000.0
        if ev.get("fault_kind") == "hang" and rank in self._hang:
            began = self._hang.pop(rank)
        self._pending[rank] = _fault_row(
            ev,
            t,
            time=began,
            rank=rank,
            injected=rank in self._injected,
            stderr_file=str(ev.get("stderr_file") or ""),
        )
        self._injected.discard(rank)

    def _on_worker_fault(self, ev: dict, t: float) -> None:
        rank = int(ev["rank"])
        self._pending[rank] = _fault_row(ev, t, rank=rank, injected=bool(ev.get("injected")))
        self._injected.discard(rank)

    def _on_hang(self, ev: dict, t: float) -> None:
        self._hang[int(ev["rank"])] = t - float(ev.get("idle_s") or 0.0)

    def _on_inject(self, ev: dict, t: float) -> None:
        if isinstance(ev.get("rank"), int):
            self._injected.add(ev["rank"])

    def _on_decide(self, ev: dict, t: float) -> None:
        rank = ev.get("rank")
        f = self._pending.pop(rank, None)
        if f is None:
            f = _fault_row(ev, t, rank=rank)
        f.injected = f.injected or bool(ev.get("injected"))
        f.strategy, f.reason = str(ev.get("strategy", "")), str(ev.get("reason", ""))
        self.v.faults.append(f)
        self._last_decided = f

    def _on_fallback(self, ev: dict, t: float) -> None:
        rd = self._latest_open()
        if rd is not None:
            rd.hint, rd.fallback_reason = "fallback", str(ev.get("reason", ""))

    def _latest_open(self) -> RoundData | None:
        for g in sorted(self._rounds, reverse=True):
            rd = self._rounds[g]
            if rd.closed_by is None:
                return rd
        return None

    # ---- rounds
    def _on_plan(self, ev: dict, t: float) -> None:
        g = int(ev.get("generation", 0))
        prev = self._latest_open()
        fallback = prev is not None and prev.hint == "fallback" and prev.round.generation < g
        if prev is not None and prev.round.generation < g:
            prev.closed_by, prev.closed_at = prev.hint or _closed_by(ev), t
        rd = self._rounds.get(g) or RoundData(Round(generation=g, strategy="", plan_time=t))
        self._rounds[g] = rd
        if isinstance(ev.get("node"), int):
            self._node(ev["node"]).leader = True  # the controller runs on the leader agent
        ro = rd.round
        ro.strategy, ro.plan_time, ro.start = str(ev.get("strategy", ro.strategy)), t, t
        ro.failed_ranks = list(ev.get("failed_ranks") or [])
        ro.restart_ranks = list(ev.get("restart_ranks") or [])
        fault = prev.round.fault if fallback and prev is not None else self._last_decided
        if fault is not None and fallback:
            ro.fault, ro.reason = fault, f"fallback: {prev.fallback_reason}"  # type: ignore[union-attr]
            fault.strategy = f"{fault.strategy} -> {ro.strategy}"
        elif fault is not None and fault.round is None:
            ro.fault, ro.reason, ro.start = fault, fault.reason, fault.time
            fault.round, fault.strategy = g, ro.strategy
        self.v.generation = max(self.v.generation, g)
        charged = not fallback and ev.get("charged", True) is not False  # as the controller
        if ro.strategy in (*PROCESS_LEVEL, "restart-all") and charged:
            self.v.restarts_used += 1

    def _on_superseded(self, ev: dict, t: float) -> None:
        """A rank failed while a round ran: the controller publishes the next plan without a
        `decide`; the newest detected fault is the one it acts on."""
        if not self._pending:
            return
        key = max(self._pending, key=lambda k: self._pending[k].detected or 0.0)
        f = self._pending.pop(key)
        f.reason = str(ev.get("message", "failed during recovery"))
        f.during_recovery = True
        self.v.faults.append(f)
        self._last_decided = f

    def _on_plan_received(self, ev: dict, t: float) -> None:
        g = int(ev.get("generation", 0))
        rd = self._rounds.get(g)
        if rd is None:  # another node's view: the controller's events are not here
            prev = self._latest_open()
            if prev is not None:
                prev.closed_by, prev.closed_at = prev.hint or "superseded", t
            rd = self._rounds[g] = RoundData(
                Round(
                    generation=g,
                    strategy=str(ev.get("strategy", "")),
                    plan_time=t,
                    start=t,
                    failed_ranks=list(ev.get("failed_ranks") or []),
                )
            )
        if isinstance(ev.get("node"), int):
            rd.node_plan.setdefault(ev["node"], t)
        self.v.generation = max(self.v.generation, g)

    def _on_restart_all_go(self, ev: dict, t: float) -> None:
        rd = self._round(int(ev.get("generation", 0)))
        if rd is not None:
            rd.go = t

    def _on_restarted(self, ev: dict, t: float) -> None:
        rd = self._round(int(ev.get("generation", 0)))
        if rd is not None and isinstance(ev.get("node"), int):
            rd.restarted[ev["node"]] = t

    def _on_repair_plan(self, ev: dict, t: float) -> None:
        rd = self._round(int(ev.get("generation", 0)))
        if rd is not None:
            rd.round.resume_step, rd.round.action = ev.get("resume_step"), ev.get("action")
            rd.round.pairs = list(ev.get("pairs") or [])
            rd.repair_planned = t

    def _on_dump(self, ev: dict, t: float) -> None:
        rd = self._latest_open()
        if rd is not None:
            rd.hint = "dump"

    def _on_rank_stopped(self, ev: dict, t: float) -> None:
        """A rank entered a round (left its collectives, or a replacement joined) and posted
        its status: its agent saw it in the rank's heartbeat (`at`, the rank's clock)."""
        rank = int(ev["rank"])
        rd = self._round(int(ev.get("generation", 0)))
        if rd is not None:
            rd.stopped.setdefault(rank, float(ev.get("at") or t))

    def _on_rank_recovered(self, ev: dict, t: float) -> None:
        rank = int(ev["rank"])
        rd = self._round(int(ev.get("generation", 0)))
        if rd is not None:
            rd.recovered[rank] = {**ev, "time": t}
        r = self.rank(rank)
        r.phase, r.last_seen = "resumed", t
        r.generation = max(r.generation, int(ev.get("generation", 0)))

    def _on_rank_resumed(self, ev: dict, t: float) -> None:
        rank = int(ev["rank"])
        rd = self._round(int(ev.get("generation", 0)))
        if rd is not None:
            rd.resumed.setdefault(rank, {**ev, "time": t})
        r = self.rank(rank)
        r.state, r.last_seen = "training", t
        if isinstance(ev.get("step"), int):
            r.committed_step = ev["step"]
            self._point(rank, t, ev["step"])
        out = self.world.outside(int(ev.get("generation", 0)))
        back = all(k in rd.resumed or out(k) for k in self._ranks) if rd else False
        if rd is not None and rd.closed_by is None and back:
            # every rank trains again: the round is over, whatever comes next
            rd.closed_by = "recovered" if rd.round.strategy in PROCESS_LEVEL else "restarted"
            rd.closed_at = max(e["time"] for e in rd.resumed.values())

    # ------------------------------------------------------------------ the view
    def view(self, now: float | None = None) -> RunView:
        """The run as known so far (`now`: the time open bars run to; default the last event)."""
        v = self.v
        v.now = now if now is not None else (v.end or self._last_time)
        v.nodes = [self._nodes[n] for n in sorted(self._nodes)]
        v.ranks = [self._ranks[r] for r in sorted(self._ranks)]
        if v.world_size is None and v.ranks:
            v.world_size = len(v.ranks)
        for series in v.progress.values():  # samples and step batches arrive interleaved
            series.sort(key=lambda p: p[0])
        builder = RoundBuilder(self._ranks, self._aware, v, self.world.outside)
        v.rounds = [builder.build(self._rounds[g], v.now) for g in sorted(self._rounds)]
        v.settle_time_lost()
        self.world.settle(v)
        cur = v.current_round
        if cur is not None:
            mark_recovering(v, cur, self._rounds[cur.generation])
        charge_faults(v)
        return v


def mark_recovering(v: RunView, cur: Round, rd: RoundData) -> None:
    """The ranks of the running round `cur` that have not resumed yet are in it."""
    for r in v.ranks:
        if r.rank not in rd.resumed and r.state not in ("finished", "failed"):
            r.state = "replacement" if r.rank in cur.restart_ranks else "recovering"


def _fault_row(ev: dict, t: float, **fields: Any) -> FaultRow:
    """A fault as a `worker-failed`, `worker-fault` or `decide` event tells it, seen at `t`
    (`fields` override)."""
    row: dict[str, Any] = {
        "time": t,
        "rank": ev.get("rank"),
        "node": ev.get("node"),
        "host": str(ev.get("host", "")),
        "kind": str(ev.get("fault_kind", "unknown")),
        "evidence": str(ev.get("message", "")),
        "generation": int(ev.get("generation", 0)),
        "detected": t,
        "exitcode": ev.get("exitcode") if isinstance(ev.get("exitcode"), int) else None,
        "signal": str(ev["signal"]) if ev.get("signal") else None,
    }
    return FaultRow(**{**row, **fields})


def _state_of(phase: str, waiting: bool, previous: str) -> str:
    if phase == "recovering":
        return "recovering"
    if phase in ("init",):
        return previous if previous in ("replacement", "starting") else "starting"
    if phase == "done":
        return "finished"
    return "waiting" if waiting else "training"


def node_lost_fault(ev: dict, t: float) -> FaultRow:
    """The fault row of a `world-shrink` event (a lost node nobody took over)."""
    node = ev.get("lost_node")
    return FaultRow(
        time=t,
        rank=None,
        node=node if isinstance(node, int) else None,
        host=str(ev.get("host", "")),
        kind="node-lost",
        evidence=str(ev.get("reason", "")),
        generation=int(ev.get("generation", 0)),
        detected=t,
        strategy=str(ev.get("strategy", "restart-all")),
        reason=str(ev.get("message", "")),
    )


def _closed_by(plan_ev: dict) -> str:
    """How the open round ended when the next plan came: a live grow back (`elastic-grow`)
    follows a live shrink that recovered (its dropped rank never resumes in it); any other plan
    supersedes it."""
    return "recovered" if plan_ev.get("strategy") == "elastic-grow" else "superseded"


_HANDLERS = {
    "start": Timeline._on_start,
    "rendezvous": Timeline._on_rendezvous,
    "store-address": Timeline._on_store_address,
    "job-done": Timeline._on_job_done,
    "summary": Timeline._on_job_failed,
    "internal-error": Timeline._on_job_failed,
    "node-done": Timeline._on_node_done,
    "signal": Timeline._on_signal,
    "node-lost": Timeline._on_node_lost,
    "node-joined": Timeline._on_node_joined,
    "world-shrink": Timeline._on_world_shrink,
    "round-joined": Timeline._on_round_joined,
    "spare": Timeline._on_spare,
    "spare-ready": Timeline._on_spare_ready,
    "spawn": Timeline._on_spawn,
    "hello": Timeline._on_hello,
    "exit": Timeline._on_exit,
    "progress": Timeline._on_progress,
    "steps": Timeline._on_steps,
    "worker-failed": Timeline._on_worker_failed,
    "worker-fault": Timeline._on_worker_fault,
    "hang": Timeline._on_hang,
    "inject": Timeline._on_inject,
    "decide": Timeline._on_decide,
    "fallback": Timeline._on_fallback,
    "plan": Timeline._on_plan,
    "round-superseded": Timeline._on_superseded,
    "plan-received": Timeline._on_plan_received,
    "restart-all-go": Timeline._on_restart_all_go,
    "restarted": Timeline._on_restarted,
    "repair-plan": Timeline._on_repair_plan,
    "dump-plan": Timeline._on_dump,
    "rank-stopped": Timeline._on_rank_stopped,
    "rank-recovered": Timeline._on_rank_recovered,
    "rank-resumed": Timeline._on_rank_resumed,
}
