"""What happened in a run, rebuilt from its events: nodes, ranks, faults and recovery rounds.

Owns: `Timeline`, which consumes events (the records of `events.jsonl`, in time order, from one or
more agents of one run) and answers `view()` with a `RunView`: the job summary, one `NodeRow` per
node, one `RankRow` per rank, every `FaultRow` with the strategy taken and what it cost, every
recovery `Round` with its per-rank phase `Bar`s, and the training progress of every rank. It is
fed a whole file by `ftctl status RUN_DIR` and `ftctl report`, and event by event (plus the
heartbeat observations) by the agent's observer, so the live view and the report agree.

Phases of a round, per rank (wall-clock edges from the events named):
  detect    the failed rank: fault time (exit time, or last progress of a hang) -> agent saw it
  decide    the failed rank: detection -> the controller's `plan`
  stop      survivors: their agent got the plan -> the rank left its collectives and posted its
            status (`rank-recovered.marks.status`); restart-all: plan -> every node stopped
  respawn   replacements: plan -> the new process posted its status (restart-all: -> `hello`)
  wait      every rank: status posted -> the controller's repair plan arrived (waiting on peers)
  rebuild   repair plan -> process groups of the new generation built
  transfer  groups built -> state restored or received (`transfer_bytes` moved)
  resume    state ready -> the first step after the round committed (`rank-resumed`)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

PHASES = ("detect", "decide", "stop", "respawn", "wait", "rebuild", "transfer", "resume")
PROCESS_LEVEL = ("retry", "recover-in-place")
TRAINING_PHASES = ("step", "forward", "backward", "optimizer", "committed", "resumed")
ENDED = ("succeeded", "failed")


@dataclass
class Bar:
    rank: int
    phase: str
    start: float
    end: float
    open: bool = False  # still running (a live view): `end` is "now"
    note: str = ""


@dataclass
class FaultRow:
    time: float
    rank: int | None
    node: int | None
    host: str
    kind: str
    evidence: str
    generation: int  # generation the fault happened in
    injected: bool = False
    detected: float | None = None
    strategy: str = ""
    reason: str = ""
    round: int | None = None  # the generation of the recovery round it started
    mttr_s: float | None = None
    steps_lost: int | None = None
    transfer_bytes: int = 0
    transfer_rate: float | None = None  # bytes per second
    stderr_file: str = ""  # the failed rank's stderr.log (--redirects/--tee)


@dataclass
class Round:
    generation: int
    strategy: str
    plan_time: float
    reason: str = ""
    fault: FaultRow | None = None
    failed_ranks: list[int] = field(default_factory=list)
    restart_ranks: list[int] = field(default_factory=list)
    start: float = 0.0
    end: float | None = None
    outcome: str = "in-progress"  # recovered | restarted | superseded | fallback | exit | dump
    phase: str = ""  # the phase now running (in-progress rounds)
    resume_step: int | None = None
    action: str | None = None
    pairs: list[list[int]] = field(default_factory=list)
    steps_lost: int | None = None
    transfer_bytes: int = 0
    transfer_s: float = 0.0
    bars: list[Bar] = field(default_factory=list)

    @property
    def mttr_s(self) -> float | None:
        return None if self.end is None else round(self.end - self.start, 4)


@dataclass
class RankRow:
    rank: int
    node: int | None = None
    local_rank: int | None = None
    pid: int | None = None
    generation: int = 0
    step: int | None = None
    committed_step: int | None = None
    phase: str = ""
    state: str = "starting"  # training waiting recovering replacement finished failed stopped
    steps_per_s: float | None = None
    replacement: bool = False
    restarts: int = 0
    last_seen: float = 0.0


@dataclass
class NodeRow:
    node: int
    host: str = ""
    state: str = "running"  # running done failed lost signalled
    last_seen: float = 0.0
    leader: bool = False
    spare: bool = False


@dataclass
class RunView:
    run_id: str = ""
    script: str = ""
    start: float | None = None
    end: float | None = None
    now: float | None = None
    outcome: str = "running"  # running succeeded failed
    world_size: int | None = None
    nnodes: int | None = None
    max_restarts: int = 0
    restarts_used: int = 0
    generation: int = 0
    store_addr: str = ""
    log_dirs: list[str] = field(default_factory=list)
    nodes: list[NodeRow] = field(default_factory=list)
    ranks: list[RankRow] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)
    faults: list[FaultRow] = field(default_factory=list)
    progress: dict[int, list[list[float]]] = field(default_factory=dict)  # rank -> [[t, step]]

    @property
    def current_round(self) -> Round | None:
        return self.rounds[-1] if self.rounds and self.rounds[-1].outcome == "in-progress" else None

    @property
    def time_lost_s(self) -> float:
        return round(sum(r.mttr_s or 0.0 for r in self.rounds if r.outcome != "superseded"), 4)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["progress"] = {str(k): v for k, v in self.progress.items()}
        d["time_lost_s"] = self.time_lost_s
        for r, rd in zip(self.rounds, d["rounds"]):
            rd["mttr_s"] = r.mttr_s
        return d


@dataclass
class _RoundData:
    """Raw edges of one round while events arrive; turned into a `Round` by `view()`."""

    round: Round
    node_plan: dict[int, float] = field(default_factory=dict)  # node -> plan-received time
    go: float | None = None
    restarted: dict[int, float] = field(default_factory=dict)  # node -> restarted time
    spawned: dict[int, dict] = field(default_factory=dict)  # rank -> spawn event
    hello: dict[int, float] = field(default_factory=dict)
    recovered: dict[int, dict] = field(default_factory=dict)  # rank -> rank-recovered event
    resumed: dict[int, dict] = field(default_factory=dict)  # rank -> rank-resumed event
    closed_by: str | None = None  # outcome set by a later event (superseded, fallback)
    closed_at: float | None = None
    hint: str | None = None  # fallback announced, the next plan closes it
    fallback_reason: str = ""


class Timeline:
    """Incremental: `feed(event)` in time order, `view()` at any point."""

    def __init__(self) -> None:
        self.v = RunView()
        self._ranks: dict[int, RankRow] = {}
        self._nodes: dict[int, NodeRow] = {}
        self._rounds: dict[int, _RoundData] = {}
        self._pending: dict[int | None, FaultRow] = {}  # detected, not decided yet
        self._hang: dict[int, float] = {}
        self._injected: set[int] = set()
        self._last_decided: FaultRow | None = None
        self._aware: set[int] = set()
        self._last_time = 0.0

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

    def _round(self, generation: int) -> _RoundData | None:
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
        restart-all in a new rendezvous round, whose `plan` follows without a `decide`)."""
        node = ev.get("lost_node")
        if isinstance(node, int):
            self._node(node).state = "lost"
        f = FaultRow(
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

    # ---- ranks
    def _on_spawn(self, ev: dict, t: float) -> None:
        r = self.rank(int(ev["rank"]))
        gen = int(ev.get("generation", 0))
        if r.pid is not None:
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
            self._node(ev["node"]).spare = False
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
        self._pending[rank] = FaultRow(
            time=began,
            rank=rank,
            node=ev.get("node"),
            host=str(ev.get("host", "")),
            kind=str(ev.get("fault_kind", "unknown")),
            evidence=str(ev.get("message", "")),
            generation=int(ev.get("generation", 0)),
            injected=rank in self._injected,
            detected=t,
            stderr_file=str(ev.get("stderr_file") or ""),
        )
        self._injected.discard(rank)

    def _on_worker_fault(self, ev: dict, t: float) -> None:
        rank = int(ev["rank"])
        self._pending[rank] = FaultRow(
            time=t,
            rank=rank,
            node=ev.get("node"),
            host=str(ev.get("host", "")),
            kind=str(ev.get("fault_kind", "unknown")),
            evidence=str(ev.get("message", "")),
            generation=int(ev.get("generation", 0)),
            injected=bool(ev.get("injected")),
            detected=t,
        )
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
            f = FaultRow(
                time=t,
                rank=rank,
                node=ev.get("node"),
                host=str(ev.get("host", "")),
                kind=str(ev.get("fault_kind", "unknown")),
                evidence=str(ev.get("message", "")),
                generation=int(ev.get("generation", 0)),
                detected=t,
            )
        f.injected = f.injected or bool(ev.get("injected"))
        f.strategy, f.reason = str(ev.get("strategy", "")), str(ev.get("reason", ""))
        self.v.faults.append(f)
        self._last_decided = f

    def _on_fallback(self, ev: dict, t: float) -> None:
        rd = self._latest_open()
        if rd is not None:
            rd.hint, rd.fallback_reason = "fallback", str(ev.get("reason", ""))

    def _latest_open(self) -> _RoundData | None:
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
            prev.closed_by, prev.closed_at = prev.hint or "superseded", t
        rd = self._rounds.get(g) or _RoundData(Round(generation=g, strategy="", plan_time=t))
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
        self.v.faults.append(f)
        self._last_decided = f

    def _on_plan_received(self, ev: dict, t: float) -> None:
        g = int(ev.get("generation", 0))
        rd = self._rounds.get(g)
        if rd is None:  # another node's view: the controller's events are not here
            prev = self._latest_open()
            if prev is not None:
                prev.closed_by, prev.closed_at = prev.hint or "superseded", t
            rd = self._rounds[g] = _RoundData(
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

    def _on_dump(self, ev: dict, t: float) -> None:
        rd = self._latest_open()
        if rd is not None:
            rd.hint = "dump"

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
        if rd is not None and rd.closed_by is None and all(k in rd.resumed for k in self._ranks):
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
        rounds = [self._rounds[g] for g in sorted(self._rounds)]
        v.rounds = [self._build(rd, v.now) for rd in rounds]
        self._mark_recovering(v)
        for ro in v.rounds:
            f = ro.fault
            if f is not None and f.round == ro.generation:
                f.mttr_s, f.steps_lost = ro.mttr_s, ro.steps_lost
                f.transfer_bytes = ro.transfer_bytes
                f.transfer_rate = (ro.transfer_bytes / ro.transfer_s) if ro.transfer_s > 0 else None
        for f in v.faults:  # a fallback round carries the cost of its fault to the end
            later = [ro for ro in v.rounds if ro.fault is f and ro.end is not None]
            if later:
                f.mttr_s = round(max(ro.end for ro in later) - f.time, 4)  # type: ignore[type-var]
        return v

    def _mark_recovering(self, v: RunView) -> None:
        cur = v.current_round
        if cur is None:
            return
        rd = self._rounds[cur.generation]
        for r in v.ranks:
            if r.rank not in rd.resumed and r.state not in ("finished", "failed"):
                r.state = "replacement" if r.rank in cur.restart_ranks else "recovering"

    def _build(self, rd: _RoundData, now: float) -> Round:
        ro = rd.round
        expected = sorted(self._ranks)
        self._close(rd, expected)
        until = ro.end if ro.end is not None else now
        bars: list[Bar] = []
        f = ro.fault
        if f is not None and f.rank is not None and f.round == ro.generation:
            detected = f.detected if f.detected is not None else f.time
            _add(bars, f.rank, "detect", f.time, detected, until, f"{f.kind}: {f.evidence[:120]}")
            _add(bars, f.rank, "decide", detected, ro.plan_time, until, f"-> {ro.strategy}")
        for rank in expected:
            if ro.strategy in PROCESS_LEVEL:
                self._process_bars(rd, rank, until, bars)
            elif ro.strategy == "restart-all":
                self._restart_bars(rd, rank, until, bars)
            else:
                start = self._plan_time(rd, rank)
                _add(
                    bars,
                    rank,
                    "stop",
                    start,
                    ro.end if ro.end is not None else until,
                    until,
                    ro.strategy,
                )
        if ro.end is None:
            for b in bars:
                if b.end >= until:
                    b.open = True
        ro.bars = sorted(bars, key=lambda b: (b.rank, b.start))
        open_bars = [b for b in ro.bars if b.open]
        ro.phase = (
            ""
            if ro.end is not None
            else (max(open_bars, key=lambda b: b.start).phase if open_bars else "decide")
        )
        rec = [e for e in rd.recovered.values()]
        ro.transfer_bytes = sum(int(e.get("transfer_bytes") or 0) for e in rec)
        ro.transfer_s = max(
            (float(e.get("transfer_s") or 0.0) for e in rec if e.get("transfer_bytes")), default=0.0
        )
        ro.steps_lost = self._steps_lost(rd)
        return ro

    def _plan_time(self, rd: _RoundData, rank: int) -> float:
        node = self._ranks[rank].node
        return (
            rd.node_plan.get(node, rd.round.plan_time)
            if isinstance(node, int)
            else rd.round.plan_time
        )

    def _process_bars(self, rd: _RoundData, rank: int, until: float, bars: list[Bar]) -> None:
        ro = rd.round
        marks = (rd.recovered.get(rank) or {}).get("marks") or {}
        start = self._plan_time(rd, rank)
        first = "respawn" if rank in ro.restart_ranks else "stop"
        spawn = rd.spawned.get(rank)
        note = (
            ("from the warm spare" if spawn and spawn.get("warm") else "new process")
            if first == "respawn"
            else ""
        )
        edges = [
            (first, start, marks.get("status"), note),
            ("wait", marks.get("status"), marks.get("plan"), ""),
            ("rebuild", marks.get("plan"), marks.get("rebuilt"), ""),
            ("transfer", marks.get("rebuilt"), marks.get("repaired"), self._moved(rd, rank)),
            (
                "resume",
                marks.get("repaired"),
                (rd.resumed.get(rank) or {}).get("time"),
                "first step",
            ),
        ]
        _chain(bars, rank, edges, until, ro.end is None)

    def _moved(self, rd: _RoundData, rank: int) -> str:
        e = rd.recovered.get(rank) or {}
        n = int(e.get("transfer_bytes") or 0)
        if n:
            srcs = [p[0] for p in rd.round.pairs if p and p[1] == rank] or [e.get("source")]
            who = (
                f"rank {srcs[0]}"
                if len(srcs) == 1
                else "ranks " + ", ".join(map(str, srcs)) + " (striped)"
            )
            how = " (read from its memory)" if e.get("transfer_path") == "memory" else ""
            return f"received {n / 1e6:.1f} MB from {who}{how} in {float(e.get('transfer_s') or 0):.3f} s"
        pairs = [p for p in rd.round.pairs if p and p[0] == rank]
        if pairs:
            return "sent state to rank " + ", ".join(str(p[1]) for p in pairs)
        return f"restored step {rd.round.resume_step} ({rd.round.action or 'rollback'})"

    def _restart_bars(self, rd: _RoundData, rank: int, until: float, bars: list[Bar]) -> None:
        ro = rd.round
        start = self._plan_time(rd, rank)
        spawn = (rd.spawned.get(rank) or {}).get("time")
        node = self._ranks[rank].node
        stopped = rd.go or (rd.restarted.get(node) if isinstance(node, int) else None) or spawn
        hello = rd.hello.get(rank) or spawn
        edges = [
            ("stop", start, stopped, "every node stops its workers"),
            ("respawn", stopped, hello, "new process"),
            (
                "resume",
                hello,
                (rd.resumed.get(rank) or {}).get("time"),
                "process groups, checkpoint load, first step",
            ),
        ]
        _chain(bars, rank, edges, until, ro.end is None)

    def _close(self, rd: _RoundData, expected: list[int]) -> None:
        ro = rd.round
        if rd.closed_by is not None:
            ro.outcome, ro.end = rd.closed_by, rd.closed_at
            return
        done = {r: e["time"] for r, e in rd.resumed.items()}
        for r in expected:  # a rank that finished the job after the round counts as back
            row = self._ranks[r]
            if r not in done and row.state == "finished" and row.last_seen >= ro.plan_time:
                done[r] = row.last_seen
        if ro.strategy in ("exit", "dump") or rd.hint == "dump":
            ro.outcome = "dump" if (ro.strategy == "dump" or rd.hint == "dump") else "exit"
            ro.end = self.v.end
            return
        if expected and all(r in done for r in expected):
            ro.outcome = "recovered" if ro.strategy in PROCESS_LEVEL else "restarted"
            ro.end = max(done.values())
        elif ro.strategy == "restart-all" and not (self._aware & set(expected)) and rd.restarted:
            ro.outcome, ro.end = "restarted", max(rd.restarted.values())  # unmodified workers
        elif self.v.outcome in ENDED:
            ro.outcome, ro.end = (
                ("failed" if self.v.outcome == "failed" else "recovered"),
                self.v.end,
            )
        else:
            ro.outcome, ro.end = "in-progress", None

    def _steps_lost(self, rd: _RoundData) -> int | None:
        ro = rd.round
        before = [s for pts in self.v.progress.values() for t, s in pts if t <= ro.plan_time]
        if not before:
            return 0 if ro.strategy in PROCESS_LEVEL else None
        committed = int(max(before))
        if ro.strategy in PROCESS_LEVEL and ro.resume_step is not None:
            resume = int(ro.resume_step)
        else:
            firsts = [int(e["step"]) for e in rd.resumed.values() if isinstance(e.get("step"), int)]
            if not firsts:
                return None
            resume = min(firsts)
        return max(0, committed + 1 - resume)


def _state_of(phase: str, waiting: bool, previous: str) -> str:
    if phase == "recovering":
        return "recovering"
    if phase in ("init",):
        return previous if previous in ("replacement", "starting") else "starting"
    if phase == "done":
        return "finished"
    return "waiting" if waiting else "training"


def _add(
    bars: list[Bar],
    rank: int,
    phase: str,
    start: float | None,
    end: float | None,
    until: float,
    note: str = "",
) -> None:
    if start is None:
        return
    bars.append(
        Bar(
            rank=rank,
            phase=phase,
            start=round(start, 4),
            end=round(max(start, end if end is not None else until), 4),
            note=note,
        )
    )


def _chain(bars: list[Bar], rank: int, edges: list[tuple], until: float, live: bool) -> None:
    """Consecutive phases: each starts where the previous ended; the first phase without an end
    runs to `until` when the round is still live, and the rest are left out."""
    for phase, start, end, note in edges:
        if start is None:
            return
        if end is None:
            if live:
                _add(bars, rank, phase, start, until, until, note)
            return
        _add(bars, rank, phase, start, end, until, note)


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
    "spawn": Timeline._on_spawn,
    "hello": Timeline._on_hello,
    "exit": Timeline._on_exit,
    "progress": Timeline._on_progress,
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
    "rank-recovered": Timeline._on_rank_recovered,
    "rank-resumed": Timeline._on_rank_resumed,
}
