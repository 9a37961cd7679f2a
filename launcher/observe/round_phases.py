"""One recovery round's derived figures: outcome, per-rank phase bars, transfer, steps lost.

Owns: `RoundBuilder`, which turns a round's raw edges (`RoundData`, collected by
`launcher.observe.timeline.Timeline` from the events) into its `Round`: whether and when it
ended (`recovered`, `restarted`, `exit`, `dump`, ... or still `in-progress`), the phase `Bar`s
of every rank (see the phases in `launcher.observe.timeline`), the bytes it moved and the steps
it lost; and `charge_faults`, which gives each fault the cost of the round it started.
"""

from __future__ import annotations

from typing import Callable

from launcher.observe.fault_words import describe
from launcher.observe.process_phases import live_phase, process_edges
from launcher.observe.run_view import (
    ENDED,
    PROCESS_LEVEL,
    Bar,
    RankRow,
    Round,
    RoundData,
    RunView,
)


class RoundBuilder:
    """Derives rounds from the run's rank rows (`ranks`), the ranks that said hello (`aware`:
    they use launcher.runtime), the run so far (`run`: its end, outcome and progress) and, for
    a round's generation, which ranks are outside its world (`outside`: they left it in a live
    shrink; the round neither waits for nor draws them)."""

    def __init__(
        self,
        ranks: dict[int, RankRow],
        aware: set[int],
        run: RunView,
        outside: Callable[[int], Callable[[int], bool]] | None = None,
    ) -> None:
        self.ranks = ranks
        self.aware = aware
        self.run = run
        self.outside = outside

    def build(self, rd: RoundData, now: float) -> Round:
        """`rd`'s round as of `now`: outcome and end, phase bars, transfer and steps lost."""
        ro = rd.round
        out = self.outside(ro.generation) if self.outside is not None else None
        expected = sorted(r for r in self.ranks if out is None or not out(r))
        self._close(rd, expected)
        until = ro.end if ro.end is not None else now
        # a round that ended before every rank came back (superseded, fell back, failed, the
        # job's end) draws each rank's last phase to its end: what the rank was doing then
        cut = ro.end is None or ro.outcome not in ("recovered", "restarted")
        bars: list[Bar] = []
        f = ro.fault
        if f is not None and f.rank is not None and f.round == ro.generation:
            detected = f.detected if f.detected is not None else f.time
            _add(bars, f.rank, "detect", f.time, detected, until, f"{f.kind}: {f.evidence[:120]}")
            _add(bars, f.rank, "decide", detected, ro.plan_time, until, f"-> {ro.strategy}")
        for rank in expected:
            start = self._plan_time(rd, rank)
            if ro.strategy in PROCESS_LEVEL:
                edges = process_edges(rd, rank, start, self._moved(rd, rank))
                _chain(bars, rank, edges, until, cut)
            elif ro.strategy == "restart-all":
                self._restart_bars(rd, rank, until, bars, cut)
            else:
                _add(bars, rank, "stop", start, until, until, ro.strategy)
        if ro.end is None:
            for b in bars:
                if b.end >= until:
                    b.open = True
        ro.bars = sorted(bars, key=lambda b: (b.rank, b.start))
        ro.phase = "" if ro.end is not None else live_phase(ro.bars)
        rec = [e for e in rd.recovered.values()]
        ro.transfer_bytes = sum(int(e.get("transfer_bytes") or 0) for e in rec)
        ro.transfer_s = max(
            (float(e.get("transfer_s") or 0.0) for e in rec if e.get("transfer_bytes")), default=0.0
        )
        ro.steps_lost = self._steps_lost(rd)
        return ro

    def _plan_time(self, rd: RoundData, rank: int) -> float:
        node = self.ranks[rank].node
        return (
            rd.node_plan.get(node, rd.round.plan_time)
            if isinstance(node, int)
            else rd.round.plan_time
        )

    def _moved(self, rd: RoundData, rank: int) -> str:
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
            took = float(e.get("transfer_s") or 0)
            return f"received {n / 1e6:.1f} MB from {who}{how} in {took:.3f} s"
        pairs = [p for p in rd.round.pairs if p and p[0] == rank]
        if pairs:
            return "sent state to rank " + ", ".join(str(p[1]) for p in pairs)
        return f"restored step {rd.round.resume_step} ({rd.round.action or 'rollback'})"

    def _restart_bars(
        self, rd: RoundData, rank: int, until: float, bars: list[Bar], cut: bool
    ) -> None:
        start = self._plan_time(rd, rank)
        spawn = (rd.spawned.get(rank) or {}).get("time")
        node = self.ranks[rank].node
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
        _chain(bars, rank, edges, until, cut)

    def _close(self, rd: RoundData, expected: list[int]) -> None:
        ro = rd.round
        if rd.closed_by is not None:
            ro.outcome, ro.end = rd.closed_by, rd.closed_at
            return
        done = {r: e["time"] for r, e in rd.resumed.items()}
        for r in expected:  # a rank that finished the job after the round counts as back
            row = self.ranks[r]
            if r not in done and row.state == "finished" and row.last_seen >= ro.plan_time:
                done[r] = row.last_seen
        if ro.strategy in ("exit", "dump") or rd.hint == "dump":
            ro.outcome = "dump" if (ro.strategy == "dump" or rd.hint == "dump") else "exit"
            ro.end = self.run.end
            return
        if expected and all(r in done for r in expected):
            ro.outcome = "recovered" if ro.strategy in PROCESS_LEVEL else "restarted"
            ro.end = max(done.values())
        elif ro.strategy == "restart-all" and not (self.aware & set(expected)) and rd.restarted:
            ro.outcome, ro.end = "restarted", max(rd.restarted.values())  # unmodified workers
        elif self.run.outcome in ENDED:
            ro.outcome, ro.end = (
                ("failed" if self.run.outcome == "failed" else "recovered"),
                self.run.end,
            )
        else:
            ro.outcome, ro.end = "in-progress", None

    def _steps_lost(self, rd: RoundData) -> int | None:
        ro = rd.round
        before = [s for pts in self.run.progress.values() for t, s in pts if t <= ro.plan_time]
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


def charge_faults(v: RunView) -> None:
    """Each fault carries, in words, what happened and what ftrun did (`fault_words`), what the
    round it started cost (steps lost, transfer) and, as its
    MTTR, that round's time lost once every rank trains again (the rule of
    `launcher.observe.run_view`: a round that was superseded or fell back counts until the round
    that took over ended). The rounds must be settled (`RunView.settle_time_lost`)."""
    started: dict[int, list[Round]] = {}  # id(fault) -> the rounds it started (fallbacks too)
    for ro in v.rounds:
        if ro.fault is not None:
            started.setdefault(id(ro.fault), []).append(ro)
    for f in v.faults:
        f.summary = describe(f, started.get(id(f), []))
    for ro in v.rounds:
        f = ro.fault
        if f is not None and f.round == ro.generation:
            f.mttr_s = None if ro.lost_open else ro.time_lost_s
            f.steps_lost = ro.steps_lost
            f.transfer_bytes = ro.transfer_bytes
            f.transfer_rate = (ro.transfer_bytes / ro.transfer_s) if ro.transfer_s > 0 else None


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


def _chain(bars: list[Bar], rank: int, edges: list[tuple], until: float, cut: bool) -> None:
    """Consecutive phases: each starts where the previous ended; the first phase without an end
    runs to `until` when the round is still live or was cut short (`cut`), and the rest are
    left out."""
    for phase, start, end, note in edges:
        if start is None:
            return
        if end is None:
            if cut:
                _add(bars, rank, phase, start, until, until, note)
            return
        _add(bars, rank, phase, start, end, until, note)
