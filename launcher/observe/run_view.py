"""The view of a run that `ftctl status`, `ftctl report` and the metrics read: plain records.

Owns: the records a `launcher.observe.timeline.Timeline` fills from a run's events: the job
summary `RunView`, one `NodeRow` per node, one `RankRow` per rank, every `FaultRow` with the
strategy taken and what it cost, every recovery `Round` with its per-rank phase `Bar`s, the
phase names, and `RoundData`, the raw edges of one round while its events arrive (turned into
its `Round` by `launcher.observe.round_phases`). `ftctl status` rebuilds the same records from
the JSON the agents publish (`RunView.to_dict`). And `WorldChange`, one entry of the world's
size over time (the start, each shrink and grow, a restart-all that brings every rank back;
kept by `launcher.observe.world_history`), with `RunView.world_now`, the world as it is now.

And the one rule for time lost, which the report, `ftctl status`, the metrics and the job's
last line all read (`RunView.settle_time_lost`): a round's time lost runs from its fault (the
round's start) until every rank trains again, whatever the round's outcome. A round that ended
the recovery (recovered, restarted, exit, dump, failed) ends there; a round that was superseded
(a fault during it) or fell back ends when the round that took over from it ends, following on
as far as it goes; a round nothing has ended yet runs to now. The job's time lost is the length
of the union of its rounds' spans (`LostSpan`): rounds that overlap are not counted twice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

PHASES = (
    "detect",
    "decide",
    "stop",
    "respawn",
    "imports",
    "start-up",
    "wait",
    "rebuild",
    "transfer",
    "resume",
)
PROCESS_LEVEL = ("retry", "recover-in-place", "elastic-training")
ENDED = ("succeeded", "failed")
TAKEN_OVER = ("superseded", "fallback")  # outcomes whose time lost runs on into the next round


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
    exitcode: int | None = None
    signal: str | None = None
    during_recovery: bool = False  # it happened while an earlier fault's round ran
    summary: str = ""  # what happened and what ftrun did, in words (`fault_words.describe`)
    cause: str = ""  # ftrun itself ended the process, and why (`ftrun_exits`); "": not ftrun


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
    # when every rank trained again after this round's fault (`RunView.settle_time_lost`);
    # while that has not happened (`lost_open`), the view's `now`
    lost_until: float | None = None
    lost_open: bool = False

    @property
    def mttr_s(self) -> float | None:
        """How long the round itself ran (its start to its own end, also when superseded)."""
        return None if self.end is None else round(self.end - self.start, 4)

    @property
    def time_lost_s(self) -> float | None:
        """The training time this round cost: from its fault until every rank trained again
        (so far, while `lost_open`); None before the view settled it."""
        if self.lost_until is None:
            return None
        return round(max(0.0, self.lost_until - self.start), 4)


@dataclass(frozen=True)
class LostSpan:
    """A stretch of time lost to recovery: one round's span, or overlapping ones merged."""

    start: float
    end: float
    generations: tuple[int, ...]
    open: bool = False  # a round in it still costs time: `end` is the view's now

    @property
    def seconds(self) -> float:
        return self.end - self.start


def settle_time_lost(rounds: list[Round], now: float | None) -> None:
    """Set every round's `lost_until` and `lost_open` by the rule (module docstring): its own
    end when it ended the recovery; the next round's when it was taken over (superseded, fell
    back); `now` while nothing ended it yet."""
    until: float | None = None
    still_open = True
    for ro in sorted(rounds, key=lambda r: r.generation, reverse=True):
        if ro.outcome in TAKEN_OVER and until is not None:
            ro.lost_until, ro.lost_open = until, still_open
        elif ro.outcome not in TAKEN_OVER and ro.outcome != "in-progress" and ro.end is not None:
            ro.lost_until, ro.lost_open = ro.end, False
        else:  # running, or ended without an end yet (exit, dump: the job's end), or no successor
            ro.lost_until, ro.lost_open = max(ro.start, now if now is not None else ro.start), True
        until, still_open = ro.lost_until, ro.lost_open


def lost_spans(rounds: list[Round]) -> list[LostSpan]:
    """The union of the settled rounds' spans [start, lost_until], as disjoint spans in time
    order."""
    spans: list[LostSpan] = []
    for ro in sorted(rounds, key=lambda r: r.start):
        if ro.lost_until is None:
            continue
        end = max(ro.start, ro.lost_until)
        last = spans[-1] if spans else None
        if last is not None and ro.start <= last.end:
            spans[-1] = LostSpan(
                last.start,
                max(last.end, end),
                last.generations + (ro.generation,),
                last.open or ro.lost_open,
            )
        else:
            spans.append(LostSpan(ro.start, end, (ro.generation,), ro.lost_open))
    return spans


@dataclass
class WorldChange:
    """The world's size from `time` on, and why (`launcher.observe.world_history`)."""

    time: float
    world_size: int
    # start | shrink | grow | restart-all (every rank back after a live shrink) | switch (hot)
    kind: str
    why: str  # in words: "rank 3's replica left", "node 1 lost; restart-all", ...
    before: int | None = None  # the world's size before (None: the start)
    step: int | None = None  # the first step the new world ran, when known
    generation: int = 0  # the generation of the event that changed it
    round: int | None = None  # the recovery round it belongs to (its cost)
    ranks: list[int] = field(default_factory=list)  # the ranks that left (shrink) or joined
    node: int | None = None  # the lost node of a shrink by restart-all
    live: bool = True  # no rank restarted (elastic-training); False: by a restart-all
    cost_s: float | None = None  # the time it cost (a shrink: its round's time lost)
    cost_open: bool = False  # its round still costs time: `cost_s` so far


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
    spares_ready: int = 0  # warm spares ready to take a rank now (`spare-ready`)
    spare_ready_s: float | None = None  # the first one was ready this long after the workers

    def spares_now_ready(self, ready: int, since_job_s: object) -> None:
        """A `spare-ready` event: `ready` spares can take a rank now."""
        self.spares_ready, self.spare = ready, ready > 0
        if self.spare_ready_s is None and isinstance(since_job_s, (int, float)):
            self.spare_ready_s = float(since_job_s)

    def spare_taken(self) -> None:
        """A warm spare became a rank."""
        self.spares_ready = max(0, self.spares_ready - 1)
        self.spare = self.spares_ready > 0


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
    original_world_size: int | None = None  # the world the job started with
    world_history: list[WorldChange] = field(default_factory=list)  # the start, then changes

    @property
    def current_round(self) -> Round | None:
        return self.rounds[-1] if self.rounds and self.rounds[-1].outcome == "in-progress" else None

    def settle_time_lost(self) -> None:
        """Apply the rule for time lost to the rounds as of `now` (`settle_time_lost`)."""
        settle_time_lost(self.rounds, self.now if self.now is not None else self.end)

    @property
    def lost_spans(self) -> list[LostSpan]:
        """The time lost to recovery as disjoint spans (overlapping rounds merged)."""
        return lost_spans(self.rounds)

    @property
    def time_lost_s(self) -> float:
        """The job's time lost to recovery: the length of the union of its rounds' spans from
        their fault until every rank trained again (a round still running counts to `now`)."""
        return round(sum(s.seconds for s in self.lost_spans), 4)

    @property
    def world_changes(self) -> list[WorldChange]:
        """The shrinks and grows (and restart-alls that brought every rank back), in order."""
        return [c for c in self.world_history if c.kind != "start"]

    def world_now(self) -> dict[str, Any] | None:
        """The world as it is now: its size, the original's, since when and by which change
        (None before the world's size is known)."""
        if not self.world_history:
            return None
        last = self.world_history[-1]
        return {
            "size": last.world_size,
            "original": self.original_world_size,
            "since": last.time,
            "step": last.step,
            "kind": last.kind,
            "changes": len(self.world_changes),
        }

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["progress"] = {str(k): v for k, v in self.progress.items()}
        d["time_lost_s"] = self.time_lost_s
        d["world"] = self.world_now()
        for r, rd in zip(self.rounds, d["rounds"]):
            rd["mttr_s"], rd["time_lost_s"] = r.mttr_s, r.time_lost_s
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
    stopped: dict[int, float] = field(default_factory=dict)  # rank -> status posted (rank-stopped)
    repair_planned: float | None = None  # the controller's repair plan out (repair-plan)
    recovered: dict[int, dict] = field(default_factory=dict)  # rank -> rank-recovered event
    resumed: dict[int, dict] = field(default_factory=dict)  # rank -> rank-resumed event
    closed_by: str | None = None  # outcome set by a later event (superseded, fallback)
    closed_at: float | None = None
    hint: str | None = None  # fallback announced, the next plan closes it
    fallback_reason: str = ""
