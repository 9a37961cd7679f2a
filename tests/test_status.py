"""`ftctl status` (launcher/observe/status.py): a live 4-rank job read through its store while it
trains and while it recovers from an injected kill, then the finished run read from its
directory."""

from __future__ import annotations

import json
import time

from helpers_observe import ObservedJob, ftctl

from launcher.observe import status as S
from launcher.observe.run_view import PHASES


def status_json(*args: str) -> dict:
    res = ftctl("status", "--json", *args)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def wait_view(addr: str, pred, timeout: float = 120, what: str = ""):
    deadline = time.monotonic() + timeout
    view = None
    while time.monotonic() < deadline:
        try:
            view, _ = S.load(None, addr, None)
        except Exception:  # noqa: BLE001 - the job is still starting
            view = None
        if view is not None and pred(view):
            return view
        time.sleep(0.1)
    raise AssertionError(f"status never showed {what}: {view and view.to_dict()}")


def test_live_job_while_training_and_recovering_then_its_directory(tmp_path):
    # no warm spare: the replacement's start (import torch) makes the round last long enough to see
    job = ObservedJob(tmp_path, steps=150, step_time=0.04, env={"FTRUN_WARM_SPARE": "0"})
    try:
        addr = job.store_addr()
        wait_view(
            addr,
            lambda v: (
                len(v.ranks) == 4
                and all(r.state == "training" and (r.steps_per_s or 0) > 0 for r in v.ranks)
            ),
            what="4 ranks training",
        )
        live = status_json("--addr", addr)
        assert live["source"].startswith("live")
        assert [r["rank"] for r in live["ranks"]] == [0, 1, 2, 3]
        assert all(
            r["state"] == "training" and r["pid"] and r["generation"] == 0 for r in live["ranks"]
        )
        assert live["max_restarts"] == 3 and live["restarts_used"] == 0 and live["faults"] == []
        assert live["nodes"][0]["leader"] is True and live["run_id"]
        # an injection at a step the rank passed would never fire: refused, from its status
        res = ftctl("inject", "--addr", addr, "--rank", "2", "--kind", "kill", "--at-step", "0")
        assert res.returncode == 2, (res.stdout, res.stderr)
        assert "step 0 has already passed: rank 2 is at step" in res.stderr

        res = ftctl("inject", "--addr", addr, "--rank", "1", "--kind", "kill")
        assert res.returncode == 0, res.stderr
        during = wait_view(addr, lambda v: v.current_round is not None, what="a round in progress")
        cur = during.current_round
        assert cur.generation == 1 and cur.strategy == "recover-in-place"
        # the round's state names its phase: never detect or decide once its plan is out
        assert cur.phase in PHASES and cur.phase not in ("detect", "decide"), cur.phase
        assert during.restarts_used == 1
        assert during.time_lost_s > 0  # counted to now while the round runs
        assert {r.rank: r.state for r in during.ranks}[1] in ("replacement", "failed")
        assert {r.state for r in during.ranks if r.rank != 1} <= {
            "recovering",
            "training",
            "waiting",
        }
        text = ftctl("status", "--addr", addr)
        assert (
            text.returncode == 0
            and "ranks" in text.stdout
            and "restart budget: 1 used of 3" in text.stdout
        )
        after = wait_view(
            addr, lambda v: v.current_round is None and len(v.rounds) == 1, what="the round over"
        )
        assert after.rounds[0].outcome == "recovered" and after.faults[0].rank == 1
        assert after.faults[0].kind == "signal" and after.faults[0].strategy == "recover-in-place"
        assert job.finish() == 0, job.output()[-4000:]
    finally:
        job.stop()

    done = status_json(job.run_dir())
    assert done["source"].startswith("events of") and done["outcome"] == "succeeded"
    assert [r["state"] for r in done["ranks"]] == ["finished"] * 4
    assert [r["restarts"] for r in done["ranks"]] == [0, 1, 0, 0]
    (f,) = done["faults"]
    assert (
        f["rank"] == 1
        and f["strategy"] == "recover-in-place"
        and f["mttr_s"] > 0
        and f["steps_lost"] == 0
    )
    assert done["restarts_used"] == 1 and done["generation"] == 1
    shown = ftctl("status", "--watch", "--count", "2", "--interval", "0.1", str(tmp_path / "logs"))
    assert shown.returncode == 0 and shown.stdout.count("restart budget: 1 used of 3, 2 left") == 2


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    res = ftctl("status")
    assert res.returncode == 2 and "--addr" in res.stderr
    res = ftctl("status", str(tmp_path))
    assert res.returncode != 0 and "no events.jsonl" in res.stderr
    res = ftctl("status", "--addr", "nohostport")
    assert res.returncode == 2 and "host:port" in res.stderr


def test_a_ranks_step_comes_from_the_newest_status_that_lists_it_while_it_steps():
    snaps = [
        {"node": 1, "time": 10.0, "ranks": [{"rank": 2, "step": 90, "state": "training"}]},
        {"node": 0, "time": 12.0, "ranks": [{"rank": 0, "step": 7, "state": "waiting"}]},
        {"node": 3, "time": 11.0, "ranks": [{"rank": 2, "step": 95, "state": "training"}]},
        {"node": 2, "time": 9.0, "ranks": [{"rank": 1, "step": 200, "state": "finished"}]},
    ]
    assert S.rank_step(snaps, 2) == 95  # a node lost earlier left an older status behind
    assert S.rank_step(snaps, 0) == 7 and S.rank_step(snaps, 1) == 200
    assert S.rank_step(snaps, 5) is None and S.rank_step([], 0) is None
    for state in ("starting", "replacement", "recovering", "failed", "stopped"):
        snap = {"time": 1.0, "ranks": [{"rank": 0, "step": 40, "state": state}]}
        assert S.rank_step([snap], 0) is None, state  # its step may go back
    assert (
        S.rank_step([{"time": 1.0, "ranks": [{"rank": 0, "step": -1, "state": "training"}]}], 0)
        is None
    )


def test_the_world_now_against_the_original_from_a_run_directory_and_the_store(tmp_path):
    from helpers_observe import event_at
    from test_report import shrink_and_grow

    from launcher.observe.logs import AgentLog
    from launcher.observe.observer import NodeObserver
    from launcher.protocol import plan as P

    events = shrink_and_grow()[:-2]  # shrunk; not grown back yet
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "events.jsonl", "w", encoding="utf-8") as f:
        for e in events + [event_at(1012.0, "job-done", 1)]:
            f.write(json.dumps(e) + "\n")
    text = ftctl("status", str(run)).stdout
    since = time.strftime("%H:%M:%S", time.localtime(1003.1))
    assert f"world 3 of 4 ranks since {since} (shrunk at step 17)" in text
    assert "shrink 4 -> 3 at step 17 (rank 3's replica left): 0.50 s lost" in text
    d = status_json(str(run))
    assert d["world"] == {
        "size": 3,
        "original": 4,
        "since": 1003.1,
        "step": 17,
        "kind": "shrink",
        "changes": 1,
    }
    assert [c["world_size"] for c in d["world_history"]] == [4, 3]
    assert d["original_world_size"] == 4 and d["world_size"] == 3
    # live: the leader's published status carries the world's history to `ftctl status --addr`
    obs = NodeObserver(AgentLog(0, str(tmp_path / "e.jsonl"), quiet=True), str(run), 3, None, 1.0)
    obs._node, obs._leader = 0, True
    for e in events:
        obs.timeline.feed(e)
    snap = json.dumps(obs.snapshot(1004.0), default=str).encode()

    class Published:
        def try_get(self, key: str):
            return snap if key == P.node_status_key(0) else None

    live = S.from_store(Published(), now=1004.0)
    assert (
        live.world_now() == d["world"] and live.world_history == S.from_dir(str(run)).world_history
    )
    assert "world 3 of 4 ranks since" in str(S.render(live, "live").renderables[1])
