"""scripts/bench_recovery.py end to end at a tiny size: one JSON line with the phases and how
the state came (same host: read from the replica's memory), and no run directory left behind
(a 1 GB state wrote ~8 GB of checkpoints per job into /tmp and filled the disk); with
--keep-logs the logs stay, the checkpoints still go."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "--no-torchrun",
    "--hidden",
    "64",
    "--layers",
    "2",
    "--steps",
    "16",
    "--kill-after-step",
    "6",
    "--no-wait-warm",
]


def _bench(tmp_path: Path, *extra: str) -> tuple[dict, str]:
    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_recovery.py"), *TINY, *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.mark.parametrize(
    "keep",
    # ~9 s each: the CI subset runs the default; --keep-logs is the slow subset's
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["default", "keep-logs"],
)
def test_a_run_reports_its_transfer_path_and_leaves_no_checkpoints(tmp_path, keep):
    row, err = _bench(tmp_path, *(["--keep-logs"] if keep else []))
    assert row["bench"] == "recovery" and row["ftrun_phases"]["detect_s"] >= 0
    assert row["ftrun_transfer_path"] == "memory" and row["ftrun_state_mb"] > 0
    left = sorted(p.name for p in tmp_path.glob("bench_recovery_*"))
    if keep:
        assert len(left) == 1 and f"run kept in {tmp_path / left[0]}" in err
        assert (tmp_path / left[0] / "logs").is_dir() and not (tmp_path / left[0] / "ckpt").exists()
    else:
        assert left == []


# ---- the scenario rows (scripts/bench_recovery_scenarios.py)

sys.path.insert(0, str(REPO / "scripts"))
import bench_recovery_scenarios as sc  # noqa: E402


def test_scenarios_parse_all_and_lists_and_name_a_bad_item():
    assert [s.name for s in sc.parse_scenarios("all")] == list(sc.ALL)
    got = sc.parse_scenarios("native:step1, megatron:during-recovery")
    assert [(s.path, s.point) for s in got] == [
        ("native", "step1"),
        ("megatron", "during-recovery"),
    ]
    for bad in ("native", "fsdp:step1", "ddp:step2", " , "):
        with pytest.raises(ValueError, match="--scenarios"):
            sc.parse_scenarios(bad)


def test_a_bad_scenario_is_one_line_and_exit_2():
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_recovery.py"), "--scenarios", "ddp:step9"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().count("\n") == 0 and "'ddp:step9'" in out.stderr


def _steps(rows: list[tuple[int, float, int]]) -> list[dict]:
    return [{"step": s, "time": t, "pid": p} for s, t, p in rows]


def _one_round(t_fail: float, t_back: float) -> list[dict]:
    """Events of a recover-in-place round on two ranks: rank 1 dies at t_fail (seen 1 ms
    later), both ranks commit again at t_back, which their heartbeats tell 0.15 s later."""
    ev = [{"time": 1.0 + r / 10, "event": "spawn", "rank": r, "generation": 0} for r in (0, 1)]
    ev += [
        {"time": t_fail + 0.001, "event": "worker-failed", "rank": 1, "detect_ms": 1.0},
        {"time": t_fail + 0.002, "event": "decide", "rank": 1, "strategy": "recover-in-place"},
        {
            "time": t_fail + 0.003,
            "event": "plan",
            "generation": 1,
            "strategy": "recover-in-place",
            "failed_ranks": [1],
            "restart_ranks": [1],
        },
        {
            "time": t_fail + 0.004,
            "event": "spawn",
            "rank": 1,
            "generation": 1,
            "replacement": True,
            "warm": True,
        },
        {
            "time": t_back - 0.5,
            "event": "rank-recovered",
            "rank": 1,
            "generation": 1,
            "replacement": True,
            "marks": {
                "exec": t_fail + 0.01,
                "imported": t_fail + 0.05,
                "registered": t_fail + 0.2,
                "repaired": t_back - 0.5,
            },
        },
        {"time": t_back - 0.5, "event": "rank-recovered", "rank": 0, "generation": 1},
    ]
    ev += [
        {"time": t_back + 0.15, "event": "rank-resumed", "rank": r, "generation": 1, "step": 5}
        for r in (0, 1)
    ]
    return ev


def test_ftrun_time_lost_comes_from_the_events_and_splits_into_the_redone_step_and_overhead():
    # steps 0.5 s apart; rank 1 killed at 12.1 during step 5 (step 4 done at 12.0); every rank
    # commits step 5 again at 13.2: lost 13.2 - 12.1 = 1.1 s (the events.jsonl figure ends at
    # the heartbeat that tells it: 1.25 s), of which the redone step is 0.5 s
    before = [(s, 10.0 + 0.5 * s, 100) for s in range(5)]
    after = [(s, 13.2 + 0.5 * (s - 5), 100) for s in range(5, 9)]
    job = {
        "kill_times": [12.1],
        "killed_steps": [5],
        "steps": {
            0: _steps(before + after),
            1: _steps([(s, t, 200) for s, t, _ in before] + [(s, t, 300) for s, t, _ in after]),
        },
        "events": _one_round(12.1, 13.2),
    }
    got = sc.lost_split(job, "ftrun")
    assert got["lost_s"] == pytest.approx(1.1, abs=1e-3) and got["rounds"] == 1
    assert got["lost_events_s"] == pytest.approx(1.25, abs=1e-3)
    assert got["step_s"] == pytest.approx(0.5) and got["redone_s"] == pytest.approx(0.5)
    assert got["overhead_s"] == pytest.approx(0.6, abs=1e-3) and got["recomputed"] == 0
    assert got["lost_s"] == pytest.approx(got["redone_s"] + got["overhead_s"])
    assert sc.trains_again_s(job, "ftrun") == pytest.approx(0.6, abs=1e-3)
    split = sc.startup_split(job["events"], 12.1)
    assert split["warm"] is True
    assert split["respawn_s"] == pytest.approx(0.006, abs=1e-3)
    assert split["imports_s"] == pytest.approx(0.04) and split["script_s"] == pytest.approx(0.15)
    assert split["repair_s"] == pytest.approx(0.4, abs=1e-3)
    path = sc.round_edges(job["events"], 12.101, 13.2)  # since the round's start (the exit)
    assert path["plan_published"] == pytest.approx(0.002) and path["spawn"] == pytest.approx(0.003)
    assert path["exec"] == pytest.approx(0.009) and path["registered"] == pytest.approx(0.199)
    assert path["repaired"] == pytest.approx(0.599) and path["trains_again"] == pytest.approx(1.099)
    assert list(path.values()) == sorted(path.values())  # in the order they happened


def test_torchrun_time_lost_holds_the_steps_since_the_checkpoint_as_redone():
    # checkpoint at step 3: killed in step 6 at 13.1, every rank back training at 20.0 (restart),
    # steps 4..5 computed again, step 6 done at 21.5
    before = [(s, 10.0 + 0.5 * s, 100) for s in range(6)]
    after = [(s, 20.0 + 0.5 * (s - 3), 101) for s in range(4, 10)]
    steps = {r: _steps([(s, t, p + r) for s, t, p in before + after]) for r in (0, 1)}
    job = {
        "kill_times": [13.1],
        "killed_steps": [6],
        "steps": steps,
        "events": [],
        "starts": {r: {100 + r: 9.9, 101 + r: 20.0} for r in (0, 1)},
    }
    got = sc.lost_split(job, "torchrun")
    assert got["recomputed"] == 2 and got["step_s"] == pytest.approx(0.5)
    assert got["lost_s"] == pytest.approx(21.5 - 13.1) and got["redone_s"] == pytest.approx(1.5)
    assert got["overhead_s"] == pytest.approx(21.5 - 13.1 - 1.5)
    assert sc.trains_again_s(job, "torchrun") == pytest.approx(20.0 - 13.1)


def test_scenario_row_native_kill_at_step_1_end_to_end(tmp_path):
    """The step-1 kill (right after the start, spares in whatever state) on the native loop,
    ftrun only: one round, the time lost split, the replacement's start-up by its marks."""
    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "bench_recovery.py"),
        "--scenarios",
        "native:step1",
        "--no-torchrun",
        "--hidden",
        "64",
        "--layers",
        "2",
        "--steps",
        "20",
        # steps of a few ms let rank 1 finish step 1 before the bench's poll sees every rank
        # past step 0 (the kill then lands at step 2: failed in CI once)
        "--step-time",
        "0.1",
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["bench"] == "recovery-scenario" and row["scenario"] == "native:step1"
    ft = row["ftrun"]
    assert ft["killed_step"] == 1 and ft["kills"] == 1 and ft["rounds"] == 1
    assert ft["lost_s"] > 0 and ft["redone_s"] > 0
    assert ft["lost_s"] == pytest.approx(ft["redone_s"] + ft["overhead_s"], abs=1e-3)
    assert ft["replacement"]["repair_s"] >= 0 and "torchrun" not in row
    # the redone step is step 1 of fault-free jobs of the same scenario (a first step): as many
    # as ftrun runs, at most 3, their median
    assert row["redone_from"] == "the same step of 1 fault-free ftrun job(s) (median)"
    assert len(row["fault_free_step_values"]) == 1
    assert ft["fault_free_step_s"] > 0 and "overhead_vs_median_s" in ft, ft
    edges = ft["critical_path"]
    assert 0 <= edges["plan_published"] <= edges["spawn"] <= edges["repaired"]
    assert edges["repaired"] <= edges["trains_again"] == pytest.approx(ft["lost_s"], abs=1e-3)
    assert row["goal_overhead_s"] in (0.1, 0.3) and isinstance(row["goal_met"], bool)
    assert list(tmp_path.glob("bench_recovery_*")) == []


def test_spare_readiness_reads_the_spare_ready_event_and_the_probe():
    evs = [
        {"time": 100.0, "event": "start"},
        {"time": 103.5, "event": "spare-ready", "since_job_s": 3.4, "since_pool_s": 3.1},
        {"time": 104.0, "event": "spare-ready", "since_job_s": 3.9, "since_pool_s": 3.6},
    ]
    got = sc.spare_readiness({"events": evs, "warm_at": 105.25, "t_start": 100.0})
    assert got == {
        "spare_ready_s": 3.4,
        "spare_ready_since_pool_s": 3.1,
        "spares_warm_after_s": 5.25,
    }
    assert sc.spare_readiness({"events": evs[:1], "warm_at": None, "t_start": 100.0}) == {}


@pytest.mark.slow
def test_the_scenarios_against_torchrun_at_a_tiny_size(tmp_path):
    """A kill during a recovery (two rounds), rt.ddp once the spares are ready and megatron-core
    at step 1 (when importable), each against torchrun restart-all of the same script: one row
    each, torchrun's time lost holding its restart."""
    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    names = ["native:during-recovery", "ddp:warm", "megatron:step1"]
    cmd = [sys.executable, str(REPO / "scripts" / "bench_recovery.py"), "--scenarios"]
    cmd += [",".join(names), "--hidden", "64", "--layers", "2", "--megatron-hidden", "32"]
    cmd += ["--steps", "150", "--step-time", "0.1", "--kill-after-step", "4"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    rows = {r["scenario"]: r for r in map(json.loads, out.stdout.strip().splitlines())}
    assert list(rows) == names
    two = rows["native:during-recovery"]
    assert two["ftrun"]["kills"] == 2 and two["ftrun"]["rounds"] == 2
    assert two["torchrun"]["kills"] == 2
    assert rows["ddp:warm"]["ftrun"]["replacement"]["warm"] is True
    for row in rows.values():
        if "skipped" in row:
            assert row["path"] == "megatron"
            continue
        ft, tr = row["ftrun"], row["torchrun"]
        assert ft["killed_step"] == tr["killed_step"]
        assert tr["lost_s"] == pytest.approx(tr["redone_s"] + tr["overhead_s"], abs=1e-3)
        assert tr["trains_again_s"] > 0 and tr["overhead_s"] > 0


# ---- the shrink row (scripts/bench_recovery_shrink.py)

import bench_recovery_shrink as shrink  # noqa: E402


def test_shrink_is_a_native_scenario_only():
    assert [(s.path, s.point) for s in sc.parse_scenarios("native:shrink")] == [
        ("native", "shrink")
    ]
    assert "native:shrink" in sc.ALL
    for bad in ("ddp:shrink", "megatron:shrink"):
        with pytest.raises(ValueError, match="only the native loop shrinks live"):
            sc.parse_scenarios(bad)
    args = type("A", (), {"step_time": 0.0, "hidden": 64, "layers": 2, "steps": 9})()
    cmd = sc.worker_command(sc.Scenario("native", "shrink"), args, "/o")
    assert "--micro-batches" in cmd and "--ddp" not in cmd


def _shrink_events(t_fail: float, t_back: float, grow: bool) -> list[dict]:
    """A live shrink of rank 1 (4 -> 3) whose survivors commit again at t_back (heartbeats tell
    it 0.15 s later), and, with `grow`, the live grow back that costs 0.8 s."""
    ev = [{"time": 1.0, "event": "rendezvous", "generation": 0, "world_size": 4}]
    ev += [{"time": 1.0, "event": "spawn", "rank": r, "generation": 0} for r in range(4)]
    ev += [
        {"time": t_fail + 0.001, "event": "worker-failed", "rank": 1, "detect_ms": 1.0},
        {"time": t_fail + 0.002, "event": "decide", "rank": 1, "strategy": "elastic-training"},
        {
            "time": t_fail + 0.003,
            "event": "plan",
            "generation": 1,
            "strategy": "elastic-training",
            "failed_ranks": [1],
        },
        {
            "time": t_fail + 0.01,
            "event": "world-shrink",
            "generation": 1,
            "world": [0, 2, 3],
            "world_size": 4,
            "new_world_size": 3,
        },
        {"time": t_fail + 0.02, "event": "repair-plan", "generation": 1, "resume_step": 5},
    ]
    ev += [
        {"time": t_back + 0.15, "event": "rank-resumed", "rank": r, "generation": 1, "step": 5}
        for r in (0, 2, 3)
    ]
    if grow:
        ev.append(
            {
                "time": t_back + 5,
                "event": "world-grow",
                "generation": 2,
                "world": [0, 1, 2, 3],
                "world_size": 3,
                "new_world_size": 4,
                "cost_s": 0.8,
            }
        )
    return ev


def test_a_shrinks_time_lost_is_the_survivors_and_its_redone_step_the_smaller_worlds():
    # steps 0.5 s apart in the world of 4, 0.6 s in the world of 3; rank 1 killed at 12.1
    # during step 5 (step 4 done at 12.0); ranks 0, 2, 3 commit step 5 at 12.8: lost 0.7 s, the
    # redone step 0.6 s; the events say 0.85 s (the heartbeat that tells the commit)
    before = [(s, 10.0 + 0.5 * s) for s in range(5)]
    after = [(s, 12.8 + 0.6 * (s - 5)) for s in range(5, 9)]
    steps = {r: _steps([(s, t, 100 + r) for s, t in before + after]) for r in (0, 2, 3)}
    steps[1] = _steps([(s, t, 101) for s, t in before])
    job = {"kill_times": [12.1], "killed_steps": [5], "steps": steps}
    got = shrink.shrink_split({**job, "events": _shrink_events(12.1, 12.8, grow=False)})
    assert got["lost_s"] == pytest.approx(0.7, abs=1e-3) and got["rounds"] == 1
    assert got["step_s"] == pytest.approx(0.5) and got["step_after_s"] == pytest.approx(0.6)
    assert got["redone_s"] == pytest.approx(0.6) and got["overhead_s"] == pytest.approx(0.1)
    assert got["events_cost_s"] == pytest.approx(0.85, abs=1e-3) == got["lost_events_s"]
    assert got["world_changes"] == [
        {
            "kind": "shrink",
            "world": [4, 3],
            "step": 5,
            "cost_s": got["events_cost_s"],
            "open": False,
        }
    ]
    assert got["processes_restarted"] == 0 and got["grow_cost_s"] == []
    assert got["strategies"] == ["elastic-training"]
    grown = shrink.shrink_split({**job, "events": _shrink_events(12.1, 12.8, grow=True)})
    assert grown["grow_cost_s"] == [0.8]
    assert [c["world"] for c in grown["world_changes"]] == [[4, 3], [3, 4]]


@pytest.mark.slow  # ~35 s: a 4-rank job at a tiny size on a loaded 2-core box
def test_the_shrink_row_end_to_end_without_torchrun(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    cmd = [sys.executable, str(REPO / "scripts" / "bench_recovery.py"), "--scenarios"]
    cmd += ["native:shrink", "--no-torchrun", "--hidden", "64", "--layers", "2"]
    cmd += ["--steps", "20", "--kill-after-step", "4", "--step-time", "0.05"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    ft = row["ftrun"]
    assert row["scenario"] == "native:shrink" and ft["strategies"] == ["elastic-training"]
    assert ft["processes_restarted"] == 0 and ft["world_changes"][0]["world"] == [4, 3]
    assert ft["lost_s"] == pytest.approx(ft["redone_s"] + ft["overhead_s"], abs=1e-3)
    assert ft["events_cost_s"] > 0 and "torchrun" not in row
    assert list(tmp_path.glob("bench_recovery_*")) == []


def test_a_grow_backs_time_lost_is_its_step_boundary_hold_beyond_one_step():
    """The shrunk world (ranks 0, 2, 3) halts after step 9 (committed at 15.2); the grow was
    asked for at 15.1 (its event at 15.5, cost 0.4 s) and every rank, rank 1's returned process
    too, commits step 10 by 16.2: 1.0 s from the boundary, of which one step of the full world
    (0.5 s) is work: 0.5 s lost, no step done again."""
    before = [(s, 10.0 + 0.5 * s) for s in range(5)]
    shrunk = [(s, 12.8 + 0.6 * (s - 5)) for s in range(5, 10)] + [(10, 16.2)]
    steps = {r: _steps([(s, t, 100 + r) for s, t in before + shrunk]) for r in (0, 2, 3)}
    steps[1] = _steps([(s, t, 101) for s, t in before] + [(10, 16.1, 201), (11, 16.6, 201)])
    ev = _shrink_events(12.1, 12.8, grow=True)
    ev[-1].update(time=15.5, cost_s=0.4, resume_step=10)
    job = {"kill_times": [12.1], "killed_steps": [5], "steps": steps, "events": ev}
    got = shrink.shrink_split(job)["grow"]
    assert got == {
        "cost_s": 0.4,
        "back_after_s": pytest.approx(3.0, abs=1e-3),
        "resume_step": 10,
        "halt_to_resume_s": pytest.approx(1.0, abs=1e-3),
        "lost_s": pytest.approx(0.5, abs=1e-3),
        "steps_redone": 0,
    }
    no_grow = {**job, "events": _shrink_events(12.1, 12.8, False)}
    assert shrink.shrink_split(no_grow)["grow"] is None


# ---- the hot switch row (scripts/bench_recovery_switch.py)
import bench_recovery_switch as switch  # noqa: E402


def test_the_switch_is_a_native_scenario_only():
    assert [(s.path, s.point) for s in sc.parse_scenarios("native:switch")] == [
        ("native", "switch")
    ]
    assert "native:switch" in sc.ALL
    with pytest.raises(ValueError, match="the hot switch row runs the native loop"):
        sc.parse_scenarios("ddp:switch")


def test_a_switchs_time_lost_is_its_step_boundary_hold_beyond_one_step():
    """4 ranks at 0.5 s a step; the switch asked to halt at 12.3 (switch-done at 12.7, cost
    0.4 s), every rank committed step 4 by 12.0 (the boundary) and step 5 by 13.1, rank 1 from
    its new process: 1.1 s from the boundary, one step (0.5 s) of it work: 0.6 s lost."""
    rows = [(s, 10.0 + 0.5 * s) for s in range(5)] + [(5, 13.1), (6, 13.6)]
    steps = {r: _steps([(s, t, 100 + r) for s, t in rows]) for r in (0, 2, 3)}
    steps[1] = _steps([(s, t, 101) for s, t in rows[:5]] + [(5, 13.05, 201), (6, 13.6, 201)])
    done = {"time": 12.7, "event": "switch-done", "moved": [1], "resume_step": 5, "cost_s": 0.4}
    done.update(prepare_s=0.8, halted_s=0.05)
    job = {"kill_times": [11.5], "killed_steps": [5], "steps": steps, "events": [done]}
    got = switch.switch_split(job)
    assert got["switched"] and got["moved"] == [1] and got["resume_step"] == 5
    assert got["halt_to_resume_s"] == pytest.approx(1.1, abs=1e-3)
    assert got["step_s"] == pytest.approx(0.5) and got["lost_s"] == pytest.approx(0.6, abs=1e-3)
    assert got["steps_redone"] == 0 and got["moved_pids"] == 2 and got["others_kept_pids"]
    gone = {"time": 12.0, "event": "switch-abandoned", "message": "hot switch #1 abandoned: x"}
    assert switch.switch_split({**job, "events": [gone]}) == {
        "switched": False,
        "why": "hot switch #1 abandoned: x",
    }


def test_repeat_runs_ftrun_k_times_reports_the_median_run_and_judges_the_goal_on_it(monkeypatch):
    overheads = iter([0.25, 0.05, 0.12])

    def fake_run(scenario, args):
        over = next(overheads)
        return {
            "overhead_s": over,
            "lost_s": over + 0.3,
            "killed_step": 16,
            "replacements_warm": [True],
            "state_mb": 171.6,
        }

    monkeypatch.setattr(sc, "ftrun_run", fake_run)
    args = SimpleNamespace(repeat=3, torchrun=False)
    row = sc.scenario_row(sc.Scenario("native", "warm"), args)
    assert row["runs"] == 3 and row["state_mb"] == 171.6
    assert row["overhead_s"] == {"median": 0.12, "values": [0.25, 0.05, 0.12]}
    assert row["lost_s"] == {"median": 0.42, "values": [0.55, 0.35, 0.42]}
    assert row["ftrun"]["overhead_s"] == 0.12  # the median run's whole record
    assert row["goal_overhead_s"] == 0.1 and row["goal_met"] is False
    overheads = iter([0.25, 0.05, 0.08])
    row = sc.scenario_row(sc.Scenario("native", "warm"), args)
    assert row["overhead_s"]["median"] == 0.08 and row["goal_met"] is True


def test_the_first_step_after_the_repair_is_set_against_each_ranks_median_step():
    def rec(step, t, pid, fwd, ar):
        return {"step": step, "time": t, "pid": pid, "phases": {"forward": fwd, "allreduce": ar}}

    steps = {
        0: [rec(0, 1, 10, 0.9, 0.9), rec(1, 2, 10, 0.1, 0.01), rec(2, 3, 10, 0.1, 0.01)]
        + [rec(3, 5, 10, 0.1, 0.04), rec(4, 6, 10, 0.1, 0.01)],
        1: [rec(0, 1, 11, 0.9, 0.9), rec(1, 2, 11, 0.1, 0.01), rec(2, 3, 11, 0.1, 0.01)]
        + [rec(3, 5, 99, 0.15, 0.01), rec(4, 6, 99, 0.1, 0.01)],
        2: [rec(0, 1, 12, 0.9, 0.9), rec(1, 2, 12, 0.1, 0.01), rec(2, 3, 12, 0.1, 0.01)]
        + [rec(3, 5, 12, 0.1, 0.02), rec(4, 6, 12, 0.1, 0.01)],
    }
    got = sc.first_step_penalty(steps, 4.0, 3)
    assert got["replacement"] == {"forward": pytest.approx(0.05), "allreduce": 0.0}
    assert got["survivors"] == {"forward": 0.0, "allreduce": pytest.approx(0.03)}


def test_a_step_1_kill_is_set_against_the_same_step_of_a_fault_free_job():
    """The fault-free job's step k runs from every rank's commit of k - 1 to every rank's commit
    of k; a run's redone step becomes that, its median split kept beside it."""
    steps = {
        0: [{"step": 0, "time": 10.0}, {"step": 1, "time": 11.0}, {"step": 2, "time": 11.5}],
        1: [{"step": 0, "time": 10.2}, {"step": 1, "time": 10.9}, {"step": 2, "time": 11.4}],
        2: [{"step": 0, "time": 10.1}],  # a rank without step 1: step 1 is not known
    }
    assert sc.step_durations(steps) == {}
    del steps[2]
    durations = sc.step_durations(steps)
    assert durations == pytest.approx({1: 0.8, 2: 0.5})
    run = {"killed_step": 1, "lost_s": 1.2, "redone_s": 0.5, "overhead_s": 0.7, "recomputed": 0}
    sc.against_fault_free(run, durations)
    assert run == pytest.approx(
        {
            "killed_step": 1,
            "lost_s": 1.2,
            "redone_s": 0.8,
            "overhead_s": 0.4,
            "overhead_vs_median_s": 0.7,
            "fault_free_step_s": 0.8,
            "recomputed": 0,
        }
    )
    # no redone step longer than the time lost; a step the job did not reach is left as it was
    short = {"killed_step": 1, "lost_s": 0.5, "redone_s": 0.3, "overhead_s": 0.2, "recomputed": 0}
    sc.against_fault_free(short, durations)
    assert (short["redone_s"], short["overhead_s"]) == (0.5, 0.0)
    far = {"killed_step": 7, "lost_s": 1.0, "redone_s": 0.5, "overhead_s": 0.5, "recomputed": 0}
    sc.against_fault_free(far, durations)
    assert "fault_free_step_s" not in far and far["overhead_s"] == 0.5


def test_the_redone_first_step_is_the_median_of_several_fault_free_jobs():
    """One fault-free job's step 1 scattered 0.62-1.20 s (megatron-core): the median of each
    step over the jobs that reached it."""
    jobs = [{1: 0.62, 2: 0.5}, {1: 1.2, 2: 0.4}, {1: 0.7}]
    assert sc.median_durations(jobs) == pytest.approx({1: 0.7, 2: 0.45})
    assert sc.median_durations([]) == {}
