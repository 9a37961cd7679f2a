"""launcher/observe/step_points.py: committed steps as compact batches, from the heartbeats the
observer sees to the `steps` records the Timeline turns into the progress chart's points and a
finished rank's last step (not a stale periodic sample)."""

from __future__ import annotations

import time

from launcher.observe.logs import AgentLog, read_event_file
from launcher.observe.observer import NodeObserver
from launcher.observe.step_points import StepPoints
from launcher.observe.timeline import Timeline


def test_points_are_spaced_and_the_newest_within_the_spacing_stands():
    sp = StepPoints(spacing=0.25)
    for i, t in enumerate((10.0, 10.1, 10.2, 10.3, 10.4, 10.9)):
        sp.note(0, t, i)
    sp.note(1, 10.05, 3)
    sp.note(1, 10.15, -1)  # not committed yet: no point
    got = sp.take()
    assert got == {
        "t0": 10.0,
        "ranks": {"0": [[0.0, 0], [0.2, 2], [0.4, 4], [0.9, 5]], "1": [[0.05, 3]]},
    }
    assert sp.take() is None  # drained


def beat(log, t, rank, committed, phase="committed"):
    log.observe(
        "heartbeat",
        op="heartbeat",
        rank=rank,
        step=committed + 1,
        phase=phase,
        committed_step=committed,
        time=t,
        generation=0,
    )


def test_a_finished_run_shows_every_ranks_last_step_and_the_chart_every_commit(tmp_path):
    path = tmp_path / "events.jsonl"
    log = AgentLog(0, str(path), quiet=True)
    obs = NodeObserver(log, str(tmp_path), max_restarts=3, port=None, progress_interval=5.0)
    log.add_sink(obs.on_event)
    log.info("rendezvous", "r", group_rank=0, world_size=2)
    for r in (0, 1):
        log.info("spawn", "s", rank=r, local_rank=r, pid=10 + r, generation=0)
    base = time.time() - 4.5  # the heartbeats' times: the last 4.5 s
    for i in range(40):  # 40 steps in 4 s: no periodic sample in between (every 5 s)
        for r in (0, 1):
            beat(log, base + i * 0.1, r, i)
    beat(log, base + 4.05, 1, 40)  # rank 1 commits one more, then both finish
    log.info("exit", "rank 0 finished", rank=0, pid=10, exitcode=0)
    log.info("exit", "rank 1 finished", rank=1, pid=11, exitcode=0)
    log.info("job-done", "done")
    obs.stop()
    events = read_event_file(str(path))
    assert any(e["event"] == "steps" for e in events)
    v = Timeline().feed_all(events).view()
    assert {r.rank: (r.committed_step, r.state) for r in v.ranks} == {
        0: (39, "finished"),
        1: (40, "finished"),
    }
    series = v.progress[1]
    assert series[-1][1] == 40 and abs(series[-1][0] - (base + 4.05)) < 1e-3
    steps = [s for _, s in series]
    assert steps == sorted(steps) and len(series) >= 15  # every ~0.25 s, not one per 5 s
    gaps = [b[0] - a[0] for a, b in zip(series, series[1:]) if b[1] > a[1]]
    assert max(gaps) < 0.5  # no flat stretch where training went on
