"""Prometheus metrics of one agent (off unless a port is given).

Owns: the agent's private registry and its HTTP exporter thread (`start()`/`stop()`) on the
configured port (`LaunchConfig.metrics_port`: `--rdzv-conf metrics_port=PORT`, else
`FTRUN_METRICS_PORT`; 0 = any free port, logged), the metric names below, and `note_view`, which
takes the rounds' figures from the agent's view of the run once each. Values are set by the
agent's observer (`launcher.observe.observer`), which derives them from the agent's events and
its workers' heartbeats; nothing else calls in here. Time lost follows the one rule of
`launcher.observe.run_view` (fault -> every rank training again, whatever the round's outcome).

  ftrun_faults_total{kind}                     faults of this node's ranks, by fault kind
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
  ftrun_restarts_used, ftrun_restarts_left     the job-wide --max_restarts budget
  ftrun_workers_alive                          local worker processes running
  ftrun_generation                             the job's generation as this agent knows it
  ftrun_step{rank}, ftrun_steps_per_second{rank}  last committed step and training speed
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
        self.faults = Counter("ftrun_faults", "Faults of this node's ranks", ["kind"], registry=reg)
        self._recovery_metrics(reg)
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

    @property
    def port(self) -> int:
        return int(self._server.server_port) if self._server is not None else self._port

    def note_view(self, view: RunView) -> None:
        """The rounds' figures from the agent's view (settled as of its `now`): the job's time
        lost so far; each round's outcome and phase durations once it ended, and its time lost
        once every rank trains again (for a superseded round: when the round that took over
        ended), each once."""
        self.time_lost.set(view.time_lost_s)
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
