"""`ftctl report RUN_DIR`: one self-contained HTML page that tells what happened in a run.

Owns: rendering a `RunView` (`launcher.observe.run_view`, built by `launcher.observe.timeline`
from the run's events.jsonl) as an HTML file that needs no network: inline CSS, inline SVG drawn
here, and a few lines of inline JS for the hover boxes. Sections: the job summary; one Gantt
chart per recovery round (a row per rank, a bar per phase, the replacement's row marked, the
phase durations beneath it); training progress (committed step vs wall clock for every rank,
from the `steps` records of `launcher.observe.step_points`, faults marked, the time each one
cost shaded); the world's size over time (a step line from the start through every shrink and
grow, `launcher.observe.world_history`, each change with its cost in a table beneath); the fault
table (a row of figures per fault and, under it across the page, what happened and what ftrun
did in words; a world change is a row of its own there, in time order). Written atomically
(temp name, fsync, rename).
"""

from __future__ import annotations

import html
import os
import time
from collections import Counter
from typing import Callable

import click

from launcher.observe.run_view import PHASES, FaultRow, Round, RunView, WorldChange
from launcher.observe.status import from_dir
from launcher.observe.world_history import change_words

COLORS = {
    "detect": "#d62728",
    "decide": "#ff7f0e",
    "stop": "#8c564b",
    "respawn": "#9467bd",
    "imports": "#c5b0d5",
    "start-up": "#e377c2",
    "wait": "#c7c7c7",
    "rebuild": "#1f77b4",
    "transfer": "#17becf",
    "resume": "#2ca02c",
}
RANK_COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
WIDTH, LABEL_W, ROW_H = 1040, 170, 22
CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,sans-serif;margin:24px;color:#222;
max-width:1100px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin:18px 0 4px} .muted{color:#777} .ok{color:#1a7f37} .bad{color:#cf222e}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:12px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:120px}
.card b{display:block;font-size:18px} table{border-collapse:collapse;margin:6px 0}
td,th{border-bottom:1px solid #eee;padding:3px 8px;text-align:left;
vertical-align:top;font-size:13px}
th{background:#f6f8fa} td.num{text-align:right;font-variant-numeric:tabular-nums}
table.faults{width:100%} table.faults tr.fault td{border-bottom:none;white-space:nowrap}
tr.fault-words td{white-space:normal;overflow-wrap:anywhere;padding-bottom:8px}
tr.fault-words .what{font-size:14px}
.legend span{display:inline-block;margin-right:12px;font-size:12px}
.legend i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-2px}
svg text{font-size:11px;fill:#333} .bar:hover,.fault-mark:hover{stroke:#000;stroke-width:1.5}
#tip{position:fixed;pointer-events:none;background:#222;color:#fff;padding:6px 8px;
border-radius:4px;font-size:12px;white-space:pre;display:none;z-index:9}
"""
JS = """
(function(){var tip=document.getElementById('tip');
document.querySelectorAll('[data-tip]').forEach(function(el){
 el.addEventListener('mousemove',function(e){tip.textContent=el.getAttribute('data-tip');
  tip.style.display='block';tip.style.left=(e.clientX+14)+'px';tip.style.top=(e.clientY+14)+'px';});
 el.addEventListener('mouseleave',function(){tip.style.display='none';});});
var n=document.querySelectorAll('g.round').length, b=document.querySelectorAll('rect.bar').length;
document.body.setAttribute('data-rounds',n); document.body.setAttribute('data-bars',b);})();
"""


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _clock(t: float | None, ms: bool = True) -> str:
    if t is None:
        return "-"
    s = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    return s + (f".{int(t % 1 * 1000):03d}" if ms else "")


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1:
        return f"{s * 1000:.1f} ms"
    if s < 120:
        return f"{s:.2f} s"
    return f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.2f} h"


def _bytes(n: int) -> str:
    return "-" if not n else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


# ---------------------------------------------------------------------- sections
def summary(v: RunView) -> str:
    dur = (v.end or v.now or 0) - v.start if v.start else None
    by = Counter(r.strategy for r in v.rounds)
    outcome = f'<span class="{"ok" if v.outcome == "succeeded" else "bad"}">{_e(v.outcome)}</span>'
    cards = [
        ("outcome", outcome),
        ("duration", _e(_dur(dur))),
        ("faults", str(len(v.faults))),
        ("recovery rounds", str(len(v.rounds))),
        ("time lost", _e(_dur(v.time_lost_s))),
        ("restart budget", f"{v.restarts_used} of {v.max_restarts} used"),
        ("world", _e(_world_card(v)) + f", {len(v.nodes)} node(s)"),
        (
            "last step",
            _e(
                max(
                    (r.committed_step for r in v.ranks if r.committed_step is not None), default="-"
                )
            ),
        ),
    ]
    rounds = ", ".join(f"{n} {_e(s)}" for s, n in sorted(by.items())) or "none"
    return (
        f"<h1>ftrun run {_e(v.run_id)}</h1><div class=muted>{_e(v.script)} &middot; "
        f"{_e(_clock(v.start, False))} &rarr; {_e(_clock(v.end, False))} &middot; generation "
        f"{v.generation}</div><div class=cards>"
        + "".join(f"<div class=card>{_e(k)}<b>{val}</b></div>" for k, val in cards)
        + f"</div><div>Rounds by strategy: {rounds}</div>"
    )


def _world_card(v: RunView) -> str:
    """The summary's world: "4 ranks", or "3 of 4 ranks (1 change)" after shrinks or grows."""
    n = len(v.world_changes)
    if not n or v.original_world_size is None:
        return f"{v.world_size or '?'} ranks"
    return f"{v.world_size} of {v.original_world_size} ranks ({n} change{'s' if n > 1 else ''})"


def legend() -> str:
    return (
        "<div class=legend>"
        + "".join(f'<span><i style="background:{COLORS[p]}"></i>{p}</span>' for p in PHASES)
        + "</div>"
    )


def gantt(ro: Round, index: int, v: RunView) -> str:
    """One round: a row per rank, a bar per phase, hover for the exact times."""
    ranks = sorted({b.rank for b in ro.bars} | {r.rank for r in v.ranks})
    if not ro.bars:
        return f'<g class="round" data-generation="{ro.generation}"></g>'
    t0 = min(b.start for b in ro.bars)
    t1 = max(b.end for b in ro.bars)
    span = max(t1 - t0, 1e-3)
    plot_w = WIDTH - LABEL_W - 20
    height = ROW_H * len(ranks) + 30
    x = lambda t: LABEL_W + (t - t0) / span * plot_w  # noqa: E731
    out = [
        f'<svg class="gantt" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" '
        f'xmlns="http://www.w3.org/2000/svg"><g class="round" data-generation="{ro.generation}" '
        f'data-index="{index}">'
    ]
    for i, rank in enumerate(ranks):
        y = i * ROW_H
        repl = rank in ro.restart_ranks and ro.strategy != "restart-all"
        if repl:
            out.append(
                f'<rect class="replacement-row" x="0" y="{y}" width="{WIDTH}" height="{ROW_H}" '
                'fill="#f3ecff"/>'
            )
        label = (
            f"rank {rank}"
            + (" \u21bb replacement" if repl else "")
            + (" \u2717 failed" if rank in ro.failed_ranks and not repl else "")
        )
        weight = "bold" if repl else "normal"
        out.append(f'<text x="4" y="{y + 15}" font-weight="{weight}">{_e(label)}</text>')
    for b in ro.bars:
        y = ranks.index(b.rank) * ROW_H + 4
        w = max(2.0, x(b.end) - x(b.start))
        tip = (
            f"rank {b.rank} \u00b7 {b.phase}{' (still running)' if b.open else ''}\n"
            f"{_clock(b.start)} \u2192 {_clock(b.end)}\n{_dur(b.end - b.start)}"
            + (f"\n{b.note}" if b.note else "")
        )
        out.append(
            f'<rect class="bar" data-phase="{b.phase}" data-rank="{b.rank}" '
            f'data-start="{b.start:.4f}" data-end="{b.end:.4f}" x="{x(b.start):.1f}" '
            f'y="{y}" width="{w:.1f}" height="{ROW_H - 8}" fill="{COLORS.get(b.phase, "#999")}" '
            f'data-tip="{_e(tip)}"><title>{_e(tip)}</title></rect>'
        )
    axis_y = ROW_H * len(ranks) + 14
    for k in range(6):
        t = t0 + span * k / 5
        out.append(
            f'<text x="{x(t):.1f}" y="{axis_y}" text-anchor="middle">+{_e(_dur(t - t0))}</text>'
        )
    out.append("</g></svg>")
    return "".join(out)


def phase_table(ro: Round) -> str:
    """Longest per-rank duration of each phase of a round (the critical path, phase by phase)."""
    longest: dict[str, float] = {}
    for b in ro.bars:
        longest[b.phase] = max(longest.get(b.phase, 0.0), b.end - b.start)
    cells = "".join(f"<th>{p}</th>" for p in PHASES if p in longest)
    vals = "".join(f'<td class="num">{_e(_dur(longest[p]))}</td>' for p in PHASES if p in longest)
    return f"<table class=phases><tr><th>longest</th>{cells}</tr><tr><td></td>{vals}</tr></table>"


def rounds_section(v: RunView) -> str:
    if not v.rounds:
        return "<h2>Recovery rounds</h2><p>No recovery round: the run had no fault.</p>"
    parts = ["<h2>Recovery rounds</h2>", legend()]
    for i, ro in enumerate(v.rounds, 1):
        f = ro.fault
        cause = (
            f"rank {f.rank} on node {f.node}: {f.kind}" + (" [injected]" if f.injected else "")
            if f is not None
            else "unknown cause"
        )
        extra = (
            f", resumed at step {ro.resume_step} ({ro.action})"
            if ro.resume_step is not None
            else ""
        )
        steps_lost = ro.steps_lost if ro.steps_lost is not None else "-"
        lost = _dur(ro.time_lost_s) + (" so far" if ro.lost_open else "")
        parts.append(
            f"<h3>Round {i} &middot; generation {ro.generation} &middot; {_e(ro.strategy)} "
            f"&middot; {_e(ro.outcome)} in {_e(_dur(ro.mttr_s))}</h3><div class=muted>"
            f"{_e(cause)}{_e(extra)}; time lost (until every rank trained again): {_e(lost)}; "
            f"steps lost: {_e(steps_lost)}; "
            f"state moved: {_e(_bytes(ro.transfer_bytes))}.<br>"
            f'<span title="{_e(ro.reason)}">{_e(f.summary if f is not None else ro.reason)}'
            "</span>"
            + "".join(
                f'<br><span class="world-change-words">world: {_e(change_words(c))}</span>'
                for c in v.world_changes
                if c.round == ro.generation
            )
            + "</div>"
        )
        parts.append(gantt(ro, i, v))
        parts.append(phase_table(ro))
    return "".join(parts)


def _lost_time_and_faults(
    v: RunView, x: Callable[[float], float], t1: float, base: float
) -> list[str]:
    """The progress chart's shaded time lost, a rect per round from its fault until every rank
    trained again (`Round.lost_until`: overlapping rounds overlap, so the shaded time is the
    job's time lost the summary shows), and fault marks; `base`: the x axis' y."""
    out = []
    for ro in v.rounds:
        if ro.lost_until is None:
            continue
        tip = (
            f"generation {ro.generation} {ro.strategy} ({ro.outcome}): {_dur(ro.time_lost_s)} "
            f"lost{' so far' if ro.lost_open else ''}, until every rank trained again"
        )
        width = max(1.5, x(min(ro.lost_until, t1)) - x(ro.start))
        out.append(
            f'<rect class="lost" x="{x(ro.start):.1f}" y="10" width="{width:.1f}" '
            f'height="{base - 10}" fill="#ffd8d8" data-tip="{_e(tip)}">'
            f"<title>{_e(tip)}</title></rect>"
        )
    for f in v.faults:
        tip = f"{_clock(f.time)} rank {f.rank} {f.kind} -> {f.strategy}"
        out.append(
            f'<line class="fault-mark" x1="{x(f.time):.1f}" x2="{x(f.time):.1f}" y1="10" '
            f'y2="{base}" stroke="#d62728" stroke-width="2" data-tip="{_e(tip)}">'
            f"<title>{_e(tip)}</title></line>"
        )
        out.append(
            f'<text x="{x(f.time) + 3:.1f}" y="22" fill="#d62728">\u26a1 rank {_e(f.rank)}</text>'
        )
    return out


def _rank_lines(v: RunView, x: Callable[[float], float], y: Callable[[float], float]) -> list[str]:
    """One step line per rank: its committed step over time (held until the next sample)."""
    out = []
    for i, (rank, series) in enumerate(sorted(v.progress.items())):
        color = RANK_COLORS[i % len(RANK_COLORS)]
        steps = [
            p
            for i, (t, s) in enumerate(series)  # the step holds until the next sample
            for p in ([(t, series[i - 1][1])] if i else []) + [(t, s)]
        ]
        line = " ".join(f"{x(t):.1f},{y(s):.1f}" for t, s in steps)
        out.append(
            f'<polyline class="rank-line" data-rank="{rank}" fill="none" stroke="{color}" '
            f'stroke-width="1.5" points="{line}"><title>rank {rank}</title></polyline>'
        )
    return out


def progress_chart(v: RunView) -> str:
    """Committed step vs wall clock for every rank; faults marked, lost time shaded."""
    pts = [(t, s) for series in v.progress.values() for t, s in series]
    if not pts or v.start is None:
        return "<h2>Training progress</h2><p>No progress samples were recorded.</p>"
    first = min([t for t, _ in pts] + [f.time for f in v.faults])
    t0, t1 = max(v.start, first - 1.0), max(v.end or 0, max(t for t, _ in pts))
    smax = max(1, max(s for _, s in pts))
    w, h, left, bottom = WIDTH, 320, 50, 30
    x = lambda t: left + (t - t0) / max(t1 - t0, 1e-3) * (w - left - 20)  # noqa: E731
    y = lambda s: 10 + (1 - s / smax) * (h - bottom - 10)  # noqa: E731
    out = [
        f'<svg class="progress" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
        'xmlns="http://www.w3.org/2000/svg">'
    ]
    out += _lost_time_and_faults(v, x, t1, h - bottom)
    out += _rank_lines(v, x, y)
    out.append(
        f'<line x1="{left}" x2="{w - 20}" y1="{h - bottom}" y2="{h - bottom}" stroke="#999"/>'
        f'<text x="{left}" y="{h - 8}">{_e(_clock(t0, False))}</text>'
        f'<text x="{w - 20}" y="{h - 8}" text-anchor="end">+{_e(_dur(t1 - t0))}</text>'
        f'<text x="4" y="{y(smax) + 4:.1f}">{smax}</text><text x="4" y="{y(0):.1f}">0</text>'
    )
    out.append("</svg>")
    keys = "".join(
        f'<span><i style="background:{RANK_COLORS[i % len(RANK_COLORS)]}"></i>rank {r}</span>'
        for i, r in enumerate(sorted(v.progress))
    )
    return (
        "<h2>Training progress</h2><div class=muted>committed step vs wall clock; red lines: "
        f"faults; shaded: time until every rank trained again</div>{''.join(out)}"
        f"<div class=legend>{keys}</div>"
    )


def fault_table(v: RunView) -> str:
    """A row of figures per fault, and under it, across the page, what happened and what ftrun
    did in words, the evidence and the controller's reason (sentences that wrap)."""
    if not v.faults:
        return "<h2>Faults</h2><p>None.</p>"
    head = (
        "time",
        "rank",
        "node",
        "kind",
        "strategy",
        "generation",
        "MTTR",
        "steps lost",
        "state moved",
        "rate",
    )
    rows = "".join(
        _fault_row(x, len(head)) if isinstance(x, FaultRow) else _change_row(x, len(head))
        for x in sorted([*v.faults, *v.world_changes], key=lambda x: x.time)
    )
    return (
        "<h2>Faults</h2><table class=faults><tr>"
        + "".join(f"<th>{h}</th>" for h in head)
        + f"</tr>{rows}</table>"
    )


def _fault_row(f: FaultRow, width: int) -> str:
    rate = "-" if not f.transfer_rate else f"{f.transfer_rate / 1e6:.1f} MB/s"
    gen = f"{f.generation} \u2192 {f.round}" if f.round is not None else str(f.generation)
    cells = [
        _clock(f.time),
        "node" if f.rank is None else f.rank,
        f.node,
        f.kind + (" [injected]" if f.injected else "") + (" (by ftrun)" if f.cause else ""),
        f.strategy or "-",
        gen,
        _dur(f.mttr_s),
        "-" if f.steps_lost is None else f.steps_lost,
        _bytes(f.transfer_bytes),
        rate,
    ]
    evidence = f.evidence[:300] + (
        f" (its stderr: {f.stderr_file})"
        if f.stderr_file and f.stderr_file not in f.evidence[:300]
        else ""
    )
    words = (
        f'<div class="what">{_e(f.summary or f.reason or "-")}</div>'
        f'<div class="muted">evidence: {_e(evidence or "-")}'
        + (f"<br>the controller's reason: {_e(f.reason)}" if f.reason else "")
        + "</div>"
    )
    return (
        "<tr class=fault>"
        + "".join(f"<td>{_e(c)}</td>" for c in cells)
        + f'</tr><tr class=fault-words><td colspan="{width}">{words}</td></tr>'
    )


def _change_row(c: WorldChange, width: int) -> str:
    """A world change in the fault table: its figures (its cost as the MTTR), then its words."""
    cells = [
        _clock(c.time),
        ", ".join(map(str, c.ranks)) or "-",
        "-" if c.node is None else c.node,
        f"world {c.kind}",
        "live" if c.live else "restart-all",
        str(c.generation)
        if c.round in (None, c.generation)
        else f"{c.generation} \u2192 {c.round}",
        _dur(c.cost_s) + (" so far" if c.cost_open else ""),
        "-",
        "-",
        "-",
    ]
    return (
        f'<tr class="fault world-change" data-kind="{_e(c.kind)}">'
        + "".join(f"<td>{_e(x)}</td>" for x in cells)
        + f'</tr><tr class=fault-words><td colspan="{width}"><div class="what">'
        f"{_e(change_words(c))}</div></td></tr>"
    )


def world_section(v: RunView) -> str:
    """The world's size over time: a step line (the progress chart's style), a mark per change
    (hover: the change and its cost), and the table of the changes."""
    h = v.world_history
    if not h:
        return "<h2>World size</h2><p>The world's size was not recorded.</p>"
    rows = "".join(
        f'<tr class="world-row" data-kind="{_e(c.kind)}"><td>{_e(_clock(c.time))}</td>'
        f'<td class="num">{_e("-" if c.step is None else c.step)}</td>'
        f'<td class="num">{c.world_size}</td>'
        f"<td>{_e(c.why if c.kind == 'start' else change_words(c))}</td></tr>"
        for c in h
    )
    return (
        '<h2>World size</h2><div class="muted">ranks in the world over time; red marks: '
        f"shrinks and grows (hover for their cost)</div>{world_chart(v)}"
        "<table class=world><tr><th>time</th><th>step</th><th>world</th><th>why, and what it "
        f"cost</th></tr>{rows}</table>"
    )


def world_chart(v: RunView) -> str:
    """The world's size as a step line from the start to the run's end (or now)."""
    h = v.world_history
    t0 = h[0].time
    t1 = max([v.end or v.now or t0] + [c.time for c in h])
    top = max(c.world_size for c in h) or 1
    w, ht, left, bottom = WIDTH, 170, 50, 30
    x = lambda t: left + (t - t0) / max(t1 - t0, 1e-3) * (w - left - 20)  # noqa: E731
    y = lambda n: 10 + (1 - n / top) * (ht - bottom - 10)  # noqa: E731
    pts = [(c.time, c.world_size) for c in h]
    held = [p for i, (t, n) in enumerate(pts) for p in [(t, pts[i - 1][1])][: i > 0] + [(t, n)]]
    held.append((t1, pts[-1][1]))
    out = [
        f'<svg class="world" width="{w}" height="{ht}" viewBox="0 0 {w} {ht}" '
        'xmlns="http://www.w3.org/2000/svg">',
        f'<polyline class="world-line" fill="none" stroke="#1f77b4" stroke-width="2" '
        f'points="{" ".join(f"{x(t):.1f},{y(n):.1f}" for t, n in held)}"/>',
    ]
    for c in v.world_changes:
        tip = f"{_clock(c.time)} {change_words(c)}"
        was = "?" if c.before is None else c.before
        out.append(
            f'<circle class="world-mark" data-kind="{_e(c.kind)}" data-size="{c.world_size}" '
            f'cx="{x(c.time):.1f}" cy="{y(c.world_size):.1f}" r="5" fill="#d62728" '
            f'data-tip="{_e(tip)}"><title>{_e(tip)}</title></circle>'
            f'<text x="{x(c.time) + 7:.1f}" y="{y(c.world_size) - 6:.1f}">'
            f"{_e(was)} \u2192 {c.world_size}</text>"
        )
    out.append(
        f'<line x1="{left}" x2="{w - 20}" y1="{ht - bottom}" y2="{ht - bottom}" stroke="#999"/>'
        f'<text x="{left}" y="{ht - 8}">{_e(_clock(t0, False))}</text>'
        f'<text x="{w - 20}" y="{ht - 8}" text-anchor="end">+{_e(_dur(t1 - t0))}</text>'
        + "".join(
            f'<text x="4" y="{y(n) + 4:.1f}">{n}</text>' for n in sorted({c.world_size for c in h})
        )
        + f'<text x="4" y="{y(0):.1f}">0</text></svg>'
    )
    return "".join(out)


def render(v: RunView, sources: list[str]) -> str:
    body = (
        summary(v)
        + rounds_section(v)
        + progress_chart(v)
        + world_section(v)
        + fault_table(v)
        + f"<p class=muted>Made by <code>ftctl report</code> at {_e(_clock(time.time(), False))} "
        f"from {_e(', '.join(sources))}.</p>"
    )
    return (
        f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>ftrun run "
        f"{_e(v.run_id)}</title><style>{CSS}</style></head><body>{body}<div id=tip></div>"
        f"<script>{JS}</script></body></html>"
    )


def write(path: str, text: str) -> None:
    """Atomic: temp name in the same directory, fsync, rename."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def build(run_dir: str, out: str | None = None) -> str:
    """Write the report of `run_dir`; returns its path (default `<run_dir>/report.html`)."""
    from launcher.observe.logs import run_event_files

    view = from_dir(run_dir)
    path = out or os.path.join(run_dir, "report.html")
    write(path, render(view, run_event_files(run_dir)))
    return path


@click.command("report")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option(
    "-o",
    "--output",
    default=None,
    type=click.Path(dir_okay=False),
    help="Where to write the page (default: RUN_DIR/report.html).",
)
def report(run_dir: str, output: str | None) -> None:
    """Write one self-contained HTML page about the run in RUN_DIR: summary, a timeline of every
    recovery round, training progress, the world's size over time, and the fault table."""
    path = build(run_dir, output)
    click.echo(f"report written to {path}")
