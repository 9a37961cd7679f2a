"""The view of a run that `ftctl status`, `ftctl report` and the metrics read: plain records.

Owns: the records a `launcher.observe.timeline.Timeline` fills from a run's events: the job
summary `RunView`, one `NodeRow` per node, one `RankRow` per rank, every `FaultRow` with the
strategy taken and what it cost, every recovery `Round` with its per-rank phase `Bar`s (and the
one rule for a round's time lost, `Round.time_lost_s`), the phase names, and `RoundData`, the raw
edges of one round while its events arrive (turned into its `Round` by
`launcher.observe.round_phases`). `ftctl status` rebuilds the same records from the JSON the
agents publish (`RunView.to_dict`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

PHASES = ("detect", "decide", "stop", "respawn", "wait", "rebuild", "transfer", "resume")
PROCESS_LEVEL = ("retry", "recover-in-place")
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

    @property
    def time_lost_s(self) -> float | None:
        """The training time this round cost, as the status, the report and the metrics count
        it: its MTTR once it ended; None while it runs, and for a superseded round (the round
        that took over counts from its own start)."""
        return None if self.outcome == "superseded" else self.mttr_s


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
        """The job's time lost to recovery: the sum of its rounds' `Round.time_lost_s`."""
        return round(sum(r.time_lost_s or 0.0 for r in self.rounds), 4)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["progress"] = {str(k): v for k, v in self.progress.items()}
        d["time_lost_s"] = self.time_lost_s
        for r, rd in zip(self.rounds, d["rounds"]):
            rd["mttr_s"] = r.mttr_s
        return d


@dataclass
class RoundData:
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
