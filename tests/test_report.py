"""`ftctl report` (launcher/observe/report.py): the page of one real 4-rank run with two faults
(a killed rank: recover-in-place; an injected UCE: retry), shared by the tests of this file,
loaded in a real headless Chromium (DOM after its scripts ran, and a PNG screenshot)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
from helpers_observe import ObservedJob, ftctl

from launcher.observe.report import render
from launcher.observe.run_view import PHASES, RunView
from launcher.observe.timeline import Timeline

FAULTS = [
    {"rank": 1, "step": 4, "phase": "forward", "kind": "kill", "generation": 0},
    {"rank": 2, "step": 9, "phase": "backward", "kind": "uce-high", "generation": 1},
]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("report_run")
    job = ObservedJob(work, steps=14, step_time=0.05, env={"FTRUN_FAULT_PLAN": json.dumps(FAULTS)})
    code = job.finish()
    assert code == 0, job.output()[-6000:]
    return job


@pytest.fixture(scope="module")
def page(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "report.html"
    res = ftctl("report", run.run_dir(), "-o", str(out))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"report written to {out}"
    return out


def browser(*args: str, tmp) -> subprocess.CompletedProcess[str]:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (scripts/setup.sh --test installs it)")
    return subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={tmp}", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


class Elements(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.found.append((tag, dict(attrs)))

    def all(self, tag: str, cls: str) -> list[dict]:
        return [a for t, a in self.found if t == tag and cls in (a.get("class") or "").split()]


def test_ftrun_prints_the_report_command(run):
    assert f"ftctl report {run.run_dir()}" in run.output()


def test_page_is_self_contained(page):
    text = page.read_text()
    assert "<script src" not in text and "<link" not in text and "@import" not in text
    assert not re.search(r"(src|href)=\"?(https?:)?//", text)
    assert [
        u for u in re.findall(r"https?://[^\"' )]+", text) if u != "http://www.w3.org/2000/svg"
    ] == []


def test_dom_has_every_round_and_phase_bar(run, page, tmp_path):
    res = browser(
        "--dump-dom", "--virtual-time-budget=5000", f"file://{page}", tmp=tmp_path / "profile"
    )
    assert res.returncode == 0, res.stderr[-3000:]
    dom = Elements()
    dom.feed(res.stdout)
    body = next(a for t, a in dom.found if t == "body")
    rounds = dom.all("g", "round")
    assert [r["data-generation"] for r in rounds] == ["1", "2"]
    bars = dom.all("rect", "bar")
    assert body["data-rounds"] == "2" and body["data-bars"] == str(
        len(bars)
    )  # set by the page's JS
    assert {b["data-phase"] for b in bars} <= set(PHASES)
    # each round is drawn in its own <svg>; split the bars by their position in the document
    per_round: list[list[dict]] = []
    for t, a in dom.found:
        if t == "g" and "round" in (a.get("class") or ""):
            per_round.append([])
        elif t == "rect" and "bar" in (a.get("class") or "").split():
            per_round[-1].append(a)
    expected = {
        1: ("respawn", 1),
        2: ("stop", 2),
    }  # round -> (first phase of the failed rank, rank)
    events = run.events()
    pairs = {e["generation"]: e["pairs"] for e in events if e["event"] == "repair-plan"}
    view = Timeline().feed_all(events).view()
    for n, round_bars in enumerate(per_round, 1):
        first, failed = expected[n]
        phases = {(int(b["data-rank"]), b["data-phase"]) for b in round_bars}
        movers = {r for p in pairs[n] for r in p}  # the ranks that sent or received state
        for rank in range(4):
            lead = first if rank == failed else "stop"
            for phase in (lead, "wait", "rebuild", "resume"):
                assert (rank, phase) in phases, (n, rank, phase)
            # transfer is the transfer itself: a rank that neither sent nor received waited
            moved = not pairs[n] or rank in movers
            assert ((rank, "transfer") in phases) == moved, (n, rank, pairs[n])
        assert (failed, "detect") in phases and (failed, "decide") in phases
        assert len(round_bars) == len(view.rounds[n - 1].bars)  # every bar of the round's view
        assert all("data-tip" in b for b in round_bars)
    assert len(dom.all("rect", "replacement-row")) == 1  # rank 1 in round 1
    assert len(dom.all("tr", "fault")) == 2
    assert len(dom.all("polyline", "rank-line")) == 4 and len(dom.all("line", "fault-mark")) == 2
    assert len(dom.all("rect", "lost")) == 2


def test_screenshot(page, tmp_path):
    png = tmp_path / "report.png"
    res = browser(
        f"--screenshot={png}",
        "--window-size=1150,1900",
        "--hide-scrollbars",
        f"file://{page}",
        tmp=tmp_path / "profile",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_fault_table_and_summary(run, page):
    text = page.read_text()
    assert "recover-in-place" in text and "retry" in text and "uce-high [injected]" in text
    assert "SIGKILL" in text and "Rounds by strategy: 1 recover-in-place, 1 retry" in text
    assert "2 of 3 used" in text


def test_fault_free_view_renders():
    text = render(RunView(run_id="x", outcome="succeeded", start=1.0, end=2.0), [])
    assert (
        "No recovery round" in text
        and "No progress samples" in text
        and "<h2>Faults</h2><p>None." in text
    )


def shrink_and_grow() -> list[dict]:
    """Hand-written events: rank 3 killed and dropped live (4 -> 3, 0.5 s), then grown back
    (3 -> 4, its cost_s 1.25 as the live grow logs it)."""
    from helpers_observe import event_at as at

    t = 1000.0
    return [
        at(t, "rendezvous", group_rank=0, world_size=4),
        *[at(t + 0.1, "spawn", rank=r, local_rank=r, pid=10 + r) for r in range(4)],
        at(t + 3, "worker-failed", rank=3, pid=13, fault_kind="signal", signal="SIGKILL"),
        at(t + 3.01, "decide", rank=3, fault_kind="signal", strategy="elastic-training"),
        at(t + 3.02, "plan", 1, strategy="elastic-training", failed_ranks=[3]),
        at(
            t + 3.1, "world-shrink", 1, dropped=[3], world=[0, 1, 2], world_size=4, new_world_size=3
        ),
        at(t + 3.12, "repair-plan", 1, resume_step=17, action="rollback", pairs=[]),
        *[at(t + 3.5, "rank-resumed", 1, rank=r, step=17) for r in range(3)],
        at(t + 9, "world-grow", 2, world=[0, 1, 2, 3], world_size=3, new_world_size=4, cost_s=1.25),
        at(t + 12, "job-done", 2),
    ]


def test_the_world_size_chart_and_its_changes_in_the_tables():
    v = Timeline().feed_all(shrink_and_grow()).view()
    text = render(v, [])
    p = Elements()
    p.feed(text)
    marks = [(m["data-kind"], m["data-size"]) for m in p.all("circle", "world-mark")]
    assert marks == [("shrink", "3"), ("grow", "4")]
    (line,) = p.all("polyline", "world-line")
    ys = [float(xy.split(",")[1]) for xy in line["points"].split()]
    # a step line: 4 ranks, down to 3 at the shrink, back to 4 at the grow, held to the end
    assert ys[0] == ys[-1] and max(ys) > ys[0] and len(set(ys)) == 2 and len(ys) == 6
    rows = [r["data-kind"] for r in p.all("tr", "world-row")]
    assert rows == ["start", "shrink", "grow"]
    assert [r["data-kind"] for r in p.all("tr", "world-change")] == ["shrink", "grow"]
    shrink = "shrink 4 -&gt; 3 at step 17 (rank 3&#x27;s replica left): 0.50 s lost"
    assert f"world: {shrink}" in text  # in its round's heading
    # its round's heading, the chart mark's hover and title, the world table, the fault table
    assert text.count(shrink) == 5
    assert "grow 3 -&gt; 4 (rank 3 joined): 1.25 s lost" in text
    assert "4 of 4 ranks (2 changes)" in text
