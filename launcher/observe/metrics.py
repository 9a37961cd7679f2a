"""Prometheus metrics of one agent (off unless a port is given).

Owns: the agent's private registry and its HTTP exporter thread (`start()`/`stop()`) on the
configured port (`LaunchConfig.metrics_port`: `--rdzv-conf metrics_port=PORT`, else
`FTRUN_METRICS_PORT`; 0 = any free port, logged), the metric names below, and `note_view`, which
takes the rounds' figures from the agent's view of the run once each. Values are set by the
agent's observer (`launcher.observe.observer`), which derives them from the agent's events and
its workers' heartbeats; nothing else calls in here. Time lost follows the one rule of
`launcher.observe.run_view` (fault -> every rank training again, whatever the round's outcome).

  ftrun_faults_total{kind,injected}            faults of this node's ranks, by fault kind;
                                               injected="true" for `ftctl inject` drills and
                                               the faults a rank's injector reports itself
  ftrun_recovery_rounds_total{strategy,outcome} rounds this agent took part in, once ended
  ftrun_recovery_phase_seconds{phase}          per-rank phase durations (the report's bars) of
                                               each round, once it ended (superseded ones too)
  ftrun_recovery_seconds                       each round's time lost (its fault -> every rank
                                               training again; a superseded or fallen-back
                                               round: until the round that took over ended),
                                               once known; overlapping rounds both count here
  ftrun_time_lost_seconds                      the job's time lost so far: the union of the
                                               rounds' spans, a running round counted to now
                                               (grows while a round runs; = `ftctl status
                                               --json` time_lost_s of this agent's view)
  ftrun_recovery_lost_seconds_total            the same as a counter (only grows; a running
                                               round's share may run up to one publication
                                               interval past its end): alert on its rate
  ftrun_recovery_in_progress                   1 while a recovery round runs, else 0
  ftrun_restarts_used, ftrun_restarts_left     the job-wide --max_restarts budget
  ftrun_workers_alive                          local worker processes running
  ftrun_generation                             the job's generation as this agent knows it
  ftrun_step{rank}, ftrun_steps_per_second{rank}  last committed step and training speed of a
                                               local rank that runs or finished (a failed or
                                               stopped rank's series are dropped)
  ftrun_rank_alive{rank}                       1 while the local rank's process runs or it
                                               finished, 0 once it failed or was stopped
  ftrun_state_transfer_bytes_total, ftrun_state_transfer_seconds_total  state received by this
                                               node's ranks in recovery rounds, and the time
                                               the transfers took
  ftrun_warm_spares_ready                      1 when this node's warm spare is ready
  ftrun_store_request_errors_total{op}         this agent's store requests that failed
  ftrun_world_size, ftrun_original_world_size  ranks in the world now (smaller after a live
                                               shrink, `launcher.observe.world_history`) and
                                               the world the job started with
  ftrun_world_changes_total{kind}              shrinks, grows and hot switches of the world
                                               (kind="shrink" | "grow" | "switch"), once each
  ftrun_job_info{version,run_id,world_size}    1, with the job's identity as labels (the world
                                               size it started with)
  ftrun_store_requests_total{op}, ftrun_store_request_seconds{op}  this agent's store requests
                                               (its status publication) and their latency
  ftrun_store_served_requests_total, ftrun_store_busy_seconds_total  requests the embedded
                                               store served and the time its loop spent on them
                                               (the node hosting the store only)
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    from launcher.observe.run_view import RunView

PHASE_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
STORE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class Metrics:
    """The metric objects of one agent and the exporter serving them."""

    def __init__(self, port: int, addr: str = "0.0.0.0") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = reg = CollectorRegistry(auto_describe=True)
        self.faults = Counter(
            "ftrun_faults", "Faults of this node's ranks", ["kind", "injected"], registry=reg
        )
        self._recovery_metrics(reg)
        self._alerting_metrics(reg)
        self.restarts_used = Gauge(
            "ftrun_restarts_used", "Recovery rounds counted against --max_restarts", registry=reg
        )
        self.restarts_left = Gauge(
            "ftrun_restarts_left", "Recovery rounds left in the --max_restarts budget", registry=reg
        )
        self.workers_alive = Gauge(
            "ftrun_workers_alive", "Local worker processes running", registry=reg
        )
        self.generation = Gauge("ftrun_generation", "The job's generation", registry=reg)
        self.step = Gauge("ftrun_step", "Last committed step", ["rank"], registry=reg)
        self.steps_per_s = Gauge(
            "ftrun_steps_per_second", "Training steps per second", ["rank"], registry=reg
        )
        self.store_requests = Counter(
            "ftrun_store_requests", "Store requests made by this agent", ["op"], registry=reg
        )
        self.store_seconds = Histogram(
            "ftrun_store_request_seconds",
            "Latency of this agent's store requests",
            ["op"],
            buckets=STORE_BUCKETS,
            registry=reg,
        )
        self._served: Callable[[], dict] | None = None
        reg.register(_ServedCollector(lambda: self._served))
        self._port = port
        self._addr = addr
        self._server = None
        self._thread: threading.Thread | None = None

    def _recovery_metrics(self, reg: Any) -> None:
        """The rounds' metrics (`note_view` sets them)."""
        from prometheus_client import Counter, Gauge, Histogram

        self.rounds = Counter(
            "ftrun_recovery_rounds",
            "Recovery rounds by strategy and outcome",
            ["strategy", "outcome"],
            registry=reg,
        )
        self.phase_seconds = Histogram(
            "ftrun_recovery_phase_seconds",
            "Per-rank recovery phase durations",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=reg,
        )
        self.recovery_seconds = Histogram(
            "ftrun_recovery_seconds",
            "Each round's time lost: its fault to every rank training again",
            buckets=PHASE_BUCKETS,
            registry=reg,
        )
        self.time_lost = Gauge(
            "ftrun_time_lost_seconds",
            "The job's time lost to recovery so far (overlapping rounds counted once)",
            registry=reg,
        )
        self._ended: set[int] = set()  # rounds (generations) counted once ended
        self._lost: set[int] = set()  # rounds whose time lost is observed (once known)

    def _alerting_metrics(self, reg: Any) -> None:
        """What an on-call engineer alerts on besides the rounds (see the user guide's rules)."""
        from prometheus_client import Counter, Gauge, Info

        self.time_lost_total = Counter(
            "ftrun_recovery_lost_seconds", "Time lost to recovery (only grows)", registry=reg
        )
        self.in_progress = Gauge(
            "ftrun_recovery_in_progress", "1 while a recovery round runs", registry=reg
        )
        self.rank_alive = Gauge(
            "ftrun_rank_alive", "1 while the local rank runs or finished", ["rank"], registry=reg
        )
        self.transfer_bytes = Counter(
            "ftrun_state_transfer_bytes", "State bytes received in recovery rounds", registry=reg
        )
        self.transfer_seconds = Counter(
            "ftrun_state_transfer_seconds", "Time the state transfers took", registry=reg
        )
        self.spares_ready = Gauge(
            "ftrun_warm_spares_ready", "1 when this node's warm spare is ready", registry=reg
        )
        self.store_errors = Counter(
            "ftrun_store_request_errors", "Store requests that failed", ["op"], registry=reg
        )
        self.info = Info("ftrun_job", "The job's identity", registry=reg)
        self.world_size = Gauge("ftrun_world_size", "Ranks in the world now", registry=reg)
        self.original_world_size = Gauge(
            "ftrun_original_world_size", "Ranks in the world the job started with", registry=reg
        )
        self.world_changes = Counter(
            "ftrun_world_changes",
            "Shrinks, grows and hot switches of the world",
            ["kind"],
            registry=reg,
        )
        for kind in ("shrink", "grow", "switch"):  # every series from the start, at 0
            self.world_changes.labels(kind=kind)
        self._changes_counted = 0  # the view's world changes counted so far
        self._counted_lost = 0.0
        self._identity: dict[str, str] = {}

    @property
    def port(self) -> int:
        return int(self._server.server_port) if self._server is not None else self._port

    def note_view(self, view: RunView) -> None:
        """The rounds' figures from the agent's view (settled as of its `now`): the job's time
        lost so far; each round's outcome and phase durations once it ended, and its time lost
        once every rank trains again (for a superseded round: when the round that took over
        ended), each once; whether a round runs; the job's identity."""
        self.time_lost.set(view.time_lost_s)
        if view.time_lost_s > self._counted_lost:  # the counter only grows
            self.time_lost_total.inc(view.time_lost_s - self._counted_lost)
            self._counted_lost = view.time_lost_s
        self.in_progress.set(1 if view.current_round is not None else 0)
        identity = {
            "version": _version(),
            "run_id": view.run_id,
            "world_size": str(view.original_world_size or view.world_size or ""),
        }
        if identity != self._identity:
            self._identity = identity
            self.info.info(identity)
        self._note_world(view)
        for ro in view.rounds:
            if ro.outcome != "in-progress" and ro.generation not in self._ended:
                self._ended.add(ro.generation)
                self.rounds.labels(strategy=ro.strategy, outcome=ro.outcome).inc()
                for b in ro.bars:
                    self.phase_seconds.labels(phase=b.phase).observe(max(0.0, b.end - b.start))
            lost = ro.time_lost_s
            if not ro.lost_open and lost is not None and ro.generation not in self._lost:
                self._lost.add(ro.generation)
                self.recovery_seconds.observe(lost)

    def _note_world(self, view: RunView) -> None:
        """The world's size now and the original, and each shrink or grow once (the view's
        changes only grow; a restart-all that brings every rank back is neither)."""
        if view.world_size:
            self.world_size.set(view.world_size)
        if view.original_world_size or view.world_size:
            self.original_world_size.set(view.original_world_size or view.world_size or 0)
        changes = view.world_changes
        for c in changes[self._changes_counted :]:
            if c.kind in ("shrink", "grow", "switch"):
                self.world_changes.labels(kind=c.kind).inc()
        self._changes_counted = max(self._changes_counted, len(changes))

    def serve_store_stats(self, stats: Callable[[], dict]) -> None:
        """Export the embedded store's request counters (the node that hosts it)."""
        self._served = stats

    def start(self) -> "Metrics":
        from prometheus_client import start_http_server

        try:
            self._server, self._thread = start_http_server(
                self._port, addr=self._addr, registry=self.registry
            )
        except OSError as e:
            raise ValueError(
                f"metrics_port={self._port}: cannot listen on {self._addr}: {e.strerror or e}"
            ) from None
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(5.0)
        self._server = self._thread = None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ftrun")
    except PackageNotFoundError:
        return "unknown"


class _ServedCollector:
    """Reads the store server's counters at scrape time (they live in the server's loop)."""

    def __init__(self, source: Callable[[], Callable[[], dict] | None]) -> None:
        self._source = source

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily

        stats_fn = self._source()
        if stats_fn is None:
            return
        stats = stats_fn()
        yield CounterMetricFamily(
            "ftrun_store_served_requests",
            "Requests the embedded store served",
            value=float(stats.get("requests", 0)),
        )
        yield CounterMetricFamily(
            "ftrun_store_busy_seconds",
            "Time the embedded store's loop spent serving requests",
            value=float(stats.get("busy_s", 0.0)),
        )
