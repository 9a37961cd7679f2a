"""The agent's observer: what its ranks are doing, recorded for `ftctl status|report` and metrics.

Owns: `NodeObserver`, an event sink on the agent's `AgentLog` (it is fed every event and every
worker heartbeat observation; the agent never calls it per event). From them it keeps
  - a `Timeline` of the run as this agent sees it (the leader's includes the controller's
    decisions: faults, strategies, rounds),
  - each local rank's live progress: step, phase, committed step, steps per second,
and it records, in `events.jsonl`, `progress` samples (every `LaunchConfig.progress_interval`
s, i.e. `FTRUN_PROGRESS_INTERVAL`, default 5, when something changed, and at the start of every
round and a rank's exit), `steps` (the ranks' committed steps in compact batches,
`launcher.observe.step_points`: what the progress chart plots), `rank-stopped` (a rank entered
a round: a survivor's stop, a replacement joining) and `rank-resumed` (the first step a rank
commits after a recovery round: the end of the round's `resume` phase). Its thread publishes
the node's status to the store every second (`plan.node_status_key`; the controller's restart
budget is read only around a plan this agent received, else every 30 s) and refreshes the metrics
(`launcher.observe.metrics`, when a port is configured). At the end of a job that had faults
it prints the job's time lost to recovery (the rule of `launcher.observe.run_view`) and the
`ftctl report` command for the run.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from launcher.observe.logs import AgentLog
from launcher.observe.metrics import Metrics
from launcher.observe.run_view import RunView
from launcher.observe.step_points import StepPoints
from launcher.observe.timeline import Timeline
from launcher.protocol import plan as P
from launcher.protocol.budget import restarts_left

PUBLISH_INTERVAL = 1.0
# the controller's restart budget changes only with a round: read at the start, for this long
# after every plan this agent receives, and otherwise once per RESTARTS_REFRESH
RESTARTS_AFTER_PLAN = 5.0
RESTARTS_REFRESH = 30.0
RATE_WINDOW = 30.0  # seconds of heartbeats a steps-per-second figure is computed over
QUIET_PHASES = ("init", "recovering", "resumed")
# What the leader's status adds about the job (from its timeline's view)
JOB_KEYS = (
    "run_id",
    "script",
    "start",
    "world_size",
    "nnodes",
    "store_addr",
    "faults",
    "rounds",
    "outcome",
    "original_world_size",
    "world_history",
)


@dataclass
class LiveRank:
    """One local rank's progress from its heartbeats."""

    step: int = -1
    phase: str = "init"
    committed_step: int = -1
    waiting: bool = False
    time: float = 0.0
    samples: deque = field(default_factory=lambda: deque(maxlen=512))  # (time, committed_step)
    armed: tuple[int, int | None] | None = None  # (generation, resume step) awaiting a commit
    replacement: bool = False
    in_round: int = 0  # the newest generation whose round it was seen in (`rank-stopped`)

    def rate(self) -> float | None:
        pts = [p for p in self.samples if p[0] >= self.time - RATE_WINDOW]
        if len(pts) < 2 or pts[-1][0] - pts[0][0] <= 0 or self.phase in QUIET_PHASES:
            return None
        return round((pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0]), 3)


class NodeObserver:
    """Owned by the agent: `start()` it before anything is logged, `attach()` it once the store
    and the world are known, `stop()` it at shutdown."""

    def __init__(
        self,
        log: AgentLog,
        run_dir: str,
        max_restarts: int,
        port: int | None,
        progress_interval: float,
    ) -> None:
        self.log = log
        self.run_dir = run_dir
        self.max_restarts = max_restarts
        self.timeline = Timeline()
        self.metrics = Metrics(port) if port is not None else None
        self.progress_interval = progress_interval
        self._lock = threading.Lock()
        self._live: dict[int, LiveRank] = {}
        self._kv: Any = None
        self._node: int | None = None
        self._leader = False
        self._restarts_used = 0
        self._restarts_read_at = -RESTARTS_REFRESH  # monotonic time of the last read
        self._restarts_until = 0.0  # monotonic: read at every tick until then (a plan came)
        self._last_progress = 0.0
        self._last_sample: dict[int, tuple] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._injected: set[int] = set()  # local ranks an injection was sent to (metrics)
        self.steps = StepPoints()  # committed steps, recorded in `steps` batches

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def start(cls, cfg: Any, log: AgentLog, run_dir: str) -> "NodeObserver":
        """From the launch config (`metrics_port`, `progress_interval`, checked there);
        ValueError when the metrics port cannot be listened on (the agent exits 2 with it)."""
        obs = cls(
            log, run_dir, cfg.max_restarts, cfg.metrics_port, max(0.05, cfg.progress_interval)
        )
        # the agent logged its `start` before the observer existed
        obs.timeline.feed(
            {
                "event": "start",
                "time": time.time(),
                "node": cfg.node_rank,
                "config": cfg.public(),
            }
        )
        if obs.metrics is not None:
            obs.metrics.start()
            log.info(
                "metrics",
                f"Prometheus metrics on port {obs.metrics.port} (/metrics)",
                port=obs.metrics.port,
            )
        log.add_sink(obs.on_event)
        return obs

    def attach(self, kv: Any, node: int, leader: bool, store_stats: Any = None) -> None:
        """The store and this node's place are known: start publishing. Again in a new world
        (a new rendezvous round, a rejoin): the one publisher goes on with the new place."""
        self._kv, self._node, self._leader = kv, node, leader
        if self._thread is not None and self._thread.is_alive():
            return
        if self.metrics is not None and store_stats is not None:
            self.metrics.serve_store_stats(store_stats)
        self._thread = threading.Thread(target=self._run, name="ftrun-observer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self._record_steps()
        self._record_progress(force=False)
        self.log.remove_sink(self.on_event)
        if self.metrics is not None:
            self.metrics.stop()
        view = self.timeline.view()
        if view.rounds or view.faults:
            self.log.info(
                "report",
                f"{len(view.faults)} fault(s), {len(view.rounds)} recovery round(s), "
                f"{view.time_lost_s:.2f} s lost to recovery: see them with  "
                f"ftctl report {self.run_dir}",
                path=self.run_dir,
                time_lost_s=view.time_lost_s,
            )

    # ------------------------------------------------------------------ the sink
    def on_event(self, ev: dict) -> None:
        kind = ev.get("event")
        if kind == "heartbeat":
            self._on_heartbeat(ev)
            return
        with self._lock:
            self.timeline.feed(ev)
            rank = ev.get("rank")
            if kind == "spawn" and isinstance(rank, int):
                live = self._live[rank] = LiveRank(replacement=bool(ev.get("replacement")))
                gen = int(ev.get("generation", 0))
                live.armed = (gen, None) if gen > 0 else None
            elif kind == "rank-recovered" and isinstance(rank, int) and rank in self._live:
                resume = ev.get("resume_step")
                self._live[rank].armed = (
                    int(ev.get("generation", 0)),
                    int(resume) if isinstance(resume, int) else None,
                )
        if self.metrics is not None:
            self._count(kind, ev)
        if kind == "plan-received":
            self._restarts_until = time.monotonic() + RESTARTS_AFTER_PLAN
            self._record_progress(force=True)  # the steps reached when the round began
        elif kind == "exit":  # a rank's last steps, before anything else can go wrong
            self._record_steps()
            self._record_progress(force=False)

    def _count(self, kind: Any, ev: dict) -> None:
        """The metrics counted from events: faults (injected or not), state transferred."""
        m, rank = self.metrics, ev.get("rank")
        assert m is not None
        if kind == "inject" and isinstance(rank, int):
            self._injected.add(rank)
        elif kind in ("worker-failed", "worker-fault"):
            injected = bool(ev.get("injected")) or rank in self._injected
            self._injected.discard(rank)
            fault = str(ev.get("fault_kind", "unknown"))
            m.faults.labels(kind=fault, injected="true" if injected else "false").inc()
        elif kind == "rank-recovered" and int(ev.get("transfer_bytes") or 0) > 0:
            m.transfer_bytes.inc(int(ev["transfer_bytes"]))
            m.transfer_seconds.inc(max(0.0, float(ev.get("transfer_s") or 0.0)))

    def _on_heartbeat(self, hb: dict) -> None:
        rank = hb.get("rank")
        if not isinstance(rank, int):
            return
        resumed, stopped = None, None
        with self._lock:
            live = self._live.setdefault(rank, LiveRank())
            gen = int(hb.get("generation", -1))
            if hb.get("phase") == "recovering" and gen > live.in_round:
                live.in_round, stopped = gen, float(hb.get("time") or time.time())
            prev_phase, prev_committed = live.phase, live.committed_step
            live.step, live.phase = int(hb.get("step", -1)), str(hb.get("phase", ""))
            live.committed_step, live.waiting = (
                int(hb.get("committed_step", -1)),
                bool(hb.get("waiting")),
            )
            live.time = float(hb.get("time") or time.time())
            if live.committed_step != prev_committed:
                self.steps.note(rank, live.time, live.committed_step)
            if live.committed_step != prev_committed and live.phase not in QUIET_PHASES:
                live.samples.append((live.time, live.committed_step))
            if live.armed is not None and live.committed_step > prev_committed:
                gen, resume = live.armed
                if (
                    live.committed_step >= resume
                    if resume is not None
                    else prev_phase not in QUIET_PHASES and live.phase not in QUIET_PHASES
                ):
                    live.armed, resumed = None, (gen, live.committed_step)
        if stopped is not None:
            self._record_stopped(rank, gen, stopped)
        if resumed is not None:
            self.log.record(
                "rank-resumed",
                f"rank {rank} trains again: step {resumed[1]} committed",
                rank=rank,
                generation=resumed[0],
                step=resumed[1],
            )

    def _record_stopped(self, rank: int, generation: int, at: float) -> None:
        """The rank is in the round of `generation`, its status posted (its heartbeat said so):
        a survivor's stop, a replacement's start-up, recorded even when the round never ends
        with the rank's `rank-recovered` (superseded, failed)."""
        who = "joined the round" if self._live[rank].replacement else "stopped training"
        self.log.record(
            "rank-stopped",
            f"rank {rank} {who} of generation {generation} and posted its status",
            rank=rank,
            generation=generation,
            at=round(at, 4),
        )

    # ------------------------------------------------------------------ periodic work
    def _run(self) -> None:
        last_publish = 0.0
        while not self._stop.wait(min(PUBLISH_INTERVAL, self.progress_interval)):
            try:
                if time.time() - self._last_progress >= self.progress_interval:
                    self._record_steps()
                    self._record_progress(force=False)
                if time.monotonic() - last_publish >= PUBLISH_INTERVAL * 0.95:
                    last_publish = time.monotonic()
                    self._tick()
            except Exception as e:  # noqa: BLE001 - observing must never stop the agent
                if self._stop.is_set():
                    return
                self.log.warning("observer", f"status publication failed: {type(e).__name__}: {e}")
                self._stop.wait(5.0)

    def _tick(self) -> None:
        now = time.monotonic()
        if now < self._restarts_until or now - self._restarts_read_at >= RESTARTS_REFRESH:
            self._restarts_read_at = now
            self._restarts_used = int(
                self._timed("get", lambda: self._kv.present([P.RESTARTS_USED_KEY])[0]) or 0
            )
        snapshot = self.snapshot(time.time())
        self._timed(
            "set",
            lambda: self._kv.set(
                P.node_status_key(self._node or 0), json.dumps(snapshot, default=str).encode()
            ),
        )
        if self.metrics is not None:
            self._refresh_metrics(snapshot)

    def _timed(self, op: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception:
            if self.metrics is not None:
                self.metrics.store_errors.labels(op=op).inc()
            raise
        if self.metrics is not None:
            self.metrics.store_requests.labels(op=op).inc()
            self.metrics.store_seconds.labels(op=op).observe(time.perf_counter() - t0)
        return out

    def _record_steps(self) -> None:
        fields = self.steps.take()
        if fields is not None:
            self.log.record("steps", "committed steps of the local ranks", **fields)

    def _record_progress(self, force: bool) -> None:
        with self._lock:
            ranks = {
                str(r): {
                    "step": lv.step,
                    "committed_step": lv.committed_step,
                    "phase": lv.phase,
                    "waiting": lv.waiting,
                    "steps_per_s": lv.rate(),
                }
                for r, lv in sorted(self._live.items())
                if lv.time > 0
            }
            sample = {r: (p["step"], p["committed_step"], p["phase"]) for r, p in ranks.items()}
            changed = sample != self._last_sample
            self._last_sample = sample
            self._last_progress = time.time()
        if ranks and (changed or force):
            self.log.record("progress", "progress of the local ranks", ranks=ranks)

    # ------------------------------------------------------------------ what is published
    def snapshot(self, now: float | None = None) -> dict:
        """The node's status for `ftctl status` (the leader adds the job's faults and rounds)."""
        now = now or time.time()
        with self._lock:
            view = self.timeline.view(now)
            live = {
                r: (lv.step, lv.committed_step, lv.phase, lv.waiting, lv.time, lv.rate())
                for r, lv in self._live.items()
            }
        me = next((n for n in view.nodes if n.node == self._node), None)
        out: dict[str, Any] = {
            "node": self._node,
            "host": me.host if me else self.log.host,
            "time": now,
            "leader": self._leader,
            "state": (me.state if me else "running"),
            "recovering": view.current_round is not None,
            "spare": bool(me and me.spare),
            "spares_ready": me.spares_ready if me else 0,
            "spare_ready_s": me.spare_ready_s if me else None,
            "generation": view.generation,
            "max_restarts": self.max_restarts,
            "restarts_used": self._restarts_used,
            "log_dir": self.run_dir,
            "ranks": self._local_ranks(view, live),
        }
        if self._leader:
            d = view.to_dict()
            out["job"] = {k: d[k] for k in JOB_KEYS}
        return out

    def _local_ranks(self, view: RunView, live: dict[int, tuple]) -> list[dict]:
        """This node's rank rows, with the live figures of their heartbeats where running."""
        ranks = []
        for row in view.ranks:
            if row.node != self._node:
                continue
            d = dataclasses.asdict(row)
            if row.rank in live and row.state not in ("finished", "failed", "stopped"):
                step, committed, phase, waiting, seen, rate = live[row.rank]
                d.update(
                    step=step,
                    committed_step=committed,
                    phase=phase,
                    steps_per_s=rate,
                    last_seen=seen,
                )
                if seen > 0 and d["state"] not in ("recovering", "replacement"):
                    d["state"] = (
                        "waiting"
                        if waiting
                        else "paused"  # `ftctl pause`: halted between steps
                        if phase == "paused"
                        else ("training" if phase not in QUIET_PHASES else d["state"])
                    )
            ranks.append(d)
        return ranks

    def _refresh_metrics(self, snapshot: dict) -> None:
        m = self.metrics
        assert m is not None
        m.restarts_used.set(self._restarts_used)
        m.restarts_left.set(restarts_left(self._restarts_used, self.max_restarts))
        m.generation.set(snapshot["generation"])
        alive = 0
        for r in snapshot["ranks"]:
            alive += r["state"] not in ("finished", "failed", "stopped")
            rank = str(r["rank"])
            dead = r["state"] in ("failed", "stopped")
            m.rank_alive.labels(rank=rank).set(0 if dead else 1)
            if dead:  # its step is no longer news: no stale series
                for gauge in (m.step, m.steps_per_s):
                    try:
                        gauge.remove(rank)
                    except KeyError:
                        pass  # dropped already, or never set
                continue
            if r.get("committed_step") is not None and r["committed_step"] >= 0:
                m.step.labels(rank=rank).set(r["committed_step"])
            m.steps_per_s.labels(rank=rank).set(r.get("steps_per_s") or 0.0)
        m.workers_alive.set(alive)
        m.spares_ready.set(1 if snapshot.get("spare") else 0)
        with self._lock:
            view = self.timeline.view(snapshot["time"])  # a running round's time lost grows
        m.note_view(view)
