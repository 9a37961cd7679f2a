"""`ftctl report` of a real run with a superseded round, read back from a real headless Chromium
and checked number by number against the run's events.jsonl (computed here from the raw events,
not through the Timeline the page is made with).

The run (tests/data/report_superseded/events.jsonl, recorded once with `python
tests/test_report_browser.py --record DIR`): 4 ranks of scripts/examples/ddp_train.py without a
warm spare; rank 1 killed from outside (SIGKILL), then its replacement killed while it started
(its imports): the round of generation 1 is superseded by generation 2's, which repairs rank 1
from rank 0."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest
from helpers_observe import ftctl
from test_report import Elements, browser

FIXTURE = Path(__file__).parent / "data" / "report_superseded"


def events() -> list[dict]:
    return [json.loads(line) for line in (FIXTURE / "events.jsonl").read_text().splitlines()]


def named(evs: list[dict], name: str, **match: object) -> list[dict]:
    return [e for e in evs if e["event"] == name and all(e.get(k) == v for k, v in match.items())]


@pytest.fixture(scope="module")
def dom(tmp_path_factory) -> Elements:
    tmp = tmp_path_factory.mktemp("report_browser")
    run_dir = tmp / "run"
    shutil.copytree(FIXTURE, run_dir)
    res = ftctl("report", str(run_dir), "-o", str(tmp / "report.html"))
    assert res.returncode == 0, res.stderr
    shown = browser(
        "--dump-dom",
        "--virtual-time-budget=5000",
        f"file://{tmp / 'report.html'}",
        tmp=tmp / "profile",
    )
    assert shown.returncode == 0, shown.stderr[-3000:]
    page = Elements()
    page.text = shown.stdout  # type: ignore[attr-defined]
    page.feed(shown.stdout)
    return page


def rounds_of(page: Elements) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    current = None
    for tag, a in page.found:
        if tag == "g" and "round" in (a.get("class") or "").split():
            current = int(a["data-generation"])
            out[current] = []
        elif tag == "rect" and "bar" in (a.get("class") or "").split():
            out[current].append(a)  # type: ignore[index]
    return out


def fault_time(e: dict) -> float:
    return e["time"] - float(e.get("detect_ms") or 0.0) / 1000.0


def clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


def test_the_recorded_run_has_a_superseded_round():
    evs = events()
    assert [e["generation"] for e in named(evs, "round-superseded")] == [1]
    assert [e["generation"] for e in named(evs, "plan")] == [1, 2]
    assert len(named(evs, "worker-failed")) == 2


def test_the_time_lost_card_and_each_faults_mttr_match_the_events(dom):
    evs = events()
    first, second = named(evs, "worker-failed")
    back = max(e["time"] for e in named(evs, "rank-resumed", generation=2))
    text = dom.text  # type: ignore[attr-defined]
    # time lost: from the first fault until every rank trained again (the superseded round is
    # counted: it runs on into the round that took over)
    assert f"time lost<b>{back - fault_time(first):.2f} s</b>" in text
    rows = re.findall(r'<tr class="fault">(.*?)</tr>', text)
    cells = [re.findall(r"<td>([^<]*)</td>", row) for row in rows]
    assert [c[0] for c in cells] == [clock(fault_time(first)), clock(fault_time(second))]
    assert [c[1] for c in cells] == ["1", "1"]
    assert [c[6] for c in cells] == [
        f"{back - fault_time(first):.2f} s",  # its round was superseded: until the next ended
        f"{back - fault_time(second):.2f} s",
    ]
    (received,) = [e for e in named(evs, "rank-recovered", generation=2) if e["transfer_bytes"]]
    assert cells[1][8] == f"{received['transfer_bytes'] / 1e3:.1f} kB" and cells[0][8] == "-"
    assert "rank 1 was killed (SIGKILL), during the recovery of an earlier fault" in text
    steps = [s for e in named(evs, "steps") for pts in e["ranks"].values() for _, s in pts]
    assert f"last step<b>{max(steps)}</b>" in text


def test_the_superseded_round_is_drawn_on_every_rank_until_the_next_plan(dom):
    evs = events()
    first = named(evs, "worker-failed")[0]
    plan2 = named(evs, "plan", generation=2)[0]["time"]
    got = rounds_of(dom)
    assert sorted(got) == [1, 2]
    superseded = got[1]
    for rank in range(4):
        bars = [b for b in superseded if int(b["data-rank"]) == rank]
        assert bars, f"rank {rank} has no bar in the superseded round"
        assert abs(max(float(b["data-end"]) for b in bars) - plan2) < 2e-3, rank
    starts = [float(b["data-start"]) for b in superseded]
    assert abs(min(starts) - fault_time(first)) < 2e-3  # the axis spans the round, not 48 ms
    respawn = [b for b in superseded if b["data-rank"] == "1" and b["data-phase"] == "respawn"]
    spawned = named(evs, "spawn", rank=1, generation=1)
    assert respawn and spawned  # the replacement's respawn, though no rank-recovered followed
    assert "superseded in" in dom.text  # type: ignore[attr-defined]


def test_the_repair_rounds_transfer_is_the_transfer_and_every_rank_resumes(dom):
    evs = events()
    got = rounds_of(dom)[2]
    rec = {e["rank"]: e for e in named(evs, "rank-recovered", generation=2)}
    receiver = next(r for r, e in rec.items() if e["transfer_bytes"])
    marks = rec[receiver]["marks"]
    (bar,) = [b for b in got if int(b["data-rank"]) == receiver and b["data-phase"] == "transfer"]
    expected = marks["repaired"] - (marks["received"] - rec[receiver]["transfer_s"])
    assert abs(float(bar["data-end"]) - float(bar["data-start"]) - expected) < 2e-3
    resumed = {e["rank"]: e["time"] for e in named(evs, "rank-resumed", generation=2)}
    for rank in range(4):
        (last,) = [b for b in got if int(b["data-rank"]) == rank and b["data-phase"] == "resume"]
        assert abs(float(last["data-end"]) - resumed[rank]) < 2e-3
    movers = {r for p in named(evs, "repair-plan", generation=2)[0]["pairs"] for r in p}
    for rank in set(range(4)) - movers:  # neither sent nor received: no transfer drawn
        assert not [b for b in got if int(b["data-rank"]) == rank and b["data-phase"] == "transfer"]


def record(dest: str) -> None:
    """Run the scenario once and copy its events.jsonl to `dest` (the fixture)."""
    import signal

    sys.path.insert(0, str(Path(__file__).parent))
    from helpers_observe import ObservedJob

    work = Path(dest) / "work"
    job = ObservedJob(work, steps=150, step_time=0.05, env={"FTRUN_WARM_SPARE": "0"})
    try:
        job.wait_for("hello", count=4)
        pid = named(job.events(), "spawn", rank=1)[0]["pid"]
        time.sleep(3.0)
        os.kill(pid, signal.SIGKILL)
        replacement = job.wait_for("spawn", rank=1, replacement=True)[0]
        time.sleep(0.8)  # the replacement is starting (imports)
        os.kill(replacement["pid"], signal.SIGKILL)
        assert job.finish(timeout=300) == 0, job.output()[-4000:]
    finally:
        job.stop()
    shutil.copy(os.path.join(job.run_dir(), "events.jsonl"), os.path.join(dest, "events.jsonl"))
    shutil.rmtree(work)


if __name__ == "__main__" and sys.argv[1:2] == ["--record"]:
    record(sys.argv[2])
