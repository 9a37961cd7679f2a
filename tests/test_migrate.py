"""`ftctl migrate` (launcher.cli.migrate) and the hot switch end to end
(launcher.control.hot_switch, launcher.agent.hot_switch): the request it writes, its refusals
(one line, non-zero exit), and on a live 4-rank native-loop job: rank 1 moves to a new process
at a step boundary, the others keep their pids, no step is recomputed, no restart is counted,
the parameters are bit-identical to a run without a switch; a switch whose new process dies
before the halt is abandoned and the ranks keep running."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from helpers_faults import LiveJob, assert_same_params, run_job

from launcher.protocol import plan as P
from tests.helpers_launch import env_with

FTCTL = [sys.executable, "-m", "launcher.cli.ftctl"]
STEPS = 30  # 9 s of 0.3 s steps: time for the switch on a loaded machine


def ftctl_run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        FTCTL + list(args), env=env_with(), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    job = run_job(tmp_path_factory.mktemp("migrate_ref"), steps=STEPS)
    assert job.returncode == 0, job.describe()
    return job.params


def test_a_rank_moves_live_with_no_rollback_and_bit_identical_params(tmp_path, ref) -> None:
    job = LiveJob(tmp_path, script_args=["--step-time", "0.3"], steps=STEPS)
    try:
        job.wait_for("hello", 4)
        pids = {e["rank"]: e["pid"] for e in job.wait_for("spawn", 4)}
        t0 = time.monotonic()
        res = ftctl_run("migrate", str(tmp_path / "logs"), "--rank", "1")
        took = time.monotonic() - t0
        assert res.returncode == 0, res.stdout + res.stderr + job.output()[-6000:]
        assert res.stdout.startswith("hot switch #1: ranks [1] moved to new processes"), res.stdout
    finally:
        result = job.finish()
    assert result.returncode == 0, result.describe()
    print(res.stdout, f"ftctl migrate took {took:.2f}s")
    assert result.strategies() == [P.SWITCH]
    assert result.restarted() == {1: 1}
    assert {r: p[0] for r, p in result.pids.items()} == pids
    done = result.first("switch-done")
    assert done["moved"] == [1] and done["cost_s"] > 0
    plan = result.first("plan")
    assert plan["charged"] is False and plan["restart_ranks"] == [1]
    assert "restarts used 0/3" in plan["message"]  # --max_restarts untouched
    halted = {int(s) for s in re.findall(r"paused after step (\d+) \(pause #1", result.output)}
    assert len(halted) == 1, halted  # every rank halted after the same step
    repair = result.first("repair-plan")
    assert repair["resume_step"] == halted.pop() + 1 and repair["action"] == "commit"  # no rollback
    moved = result.first("switch-moved")
    assert (moved["old_pid"], moved["pid"]) == (pids[1], result.pids[1][1])
    run = [p for p in (tmp_path / "logs").iterdir() if p.is_dir()][0]
    shown = json.loads(ftctl_run("status", str(run), "--json").stdout)
    assert [c["kind"] for c in shown["world_history"]] == ["start", "switch"]
    assert shown["world_history"][1]["ranks"] == [1] and shown["restarts_used"] == 0
    assert shown["faults"] == []  # a switch is no fault
    report = ftctl_run("report", str(run), "-o", str(tmp_path / "report.html"))
    assert report.returncode == 0, report.stderr
    assert "rank 1 moved to new processes" in (tmp_path / "report.html").read_text()
    assert_same_params(result.params, ref)


# ~15 s: slow; an abandoned switch is in CI in test_handoff and test_hot_switch (units)
@pytest.mark.slow
def test_a_switch_whose_new_process_dies_is_abandoned_and_the_ranks_keep_running(
    tmp_path, ref
) -> None:
    """Rank 2 is frozen (SIGSTOP) so that no step ends while rank 1's new process is killed:
    the switch is abandoned (one line), nothing restarts, the job ends bit-identical. Bad
    requests against the same job: one line, exit 2, nothing moves."""
    job = LiveJob(tmp_path, script_args=["--step-time", "0.3"], steps=STEPS)
    frozen = None
    try:
        job.wait_for("hello", 4)
        pids = {e["rank"]: e["pid"] for e in job.wait_for("spawn", 4)}
        for bad, says in (
            (["--rank", "9"], "rank(s) [9] not in the job"),
            (["--node", "5"], "unknown node 5"),
        ):
            res = ftctl_run("migrate", "--addr", job.store_addr(), *bad)
            lines = res.stderr.strip().splitlines()
            assert res.returncode == 2 and len(lines) == 1 and says in lines[0], res.stderr
        frozen = pids[2]
        os.kill(frozen, signal.SIGSTOP)
        migrate = subprocess.Popen(
            FTCTL + ["migrate", "--addr", job.store_addr(), "--rank", "1", "--timeout", "60"],
            env=env_with(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        incoming = job.wait_for("switch-incoming", 1)[0]["pid"]
        os.kill(incoming, signal.SIGKILL)
        time.sleep(0.3)
        os.kill(frozen, signal.SIGCONT)
        frozen = None
        out, err = migrate.communicate(timeout=90)
        lines = err.strip().splitlines()
        assert migrate.returncode == 1 and len(lines) == 1, (out, err)
        assert "hot switch #2 abandoned" in lines[0] and "ended with code -9" in lines[0], err
    finally:
        if frozen is not None:
            os.kill(frozen, signal.SIGCONT)
        result = job.finish()
    assert result.returncode == 0, result.describe()
    assert result.strategies() == []  # no round: nothing recovered, nothing charged
    assert {r: p[0] for r, p in result.pids.items()} == pids
    finished = {e["rank"]: e["pid"] for e in result.events if e["event"] == "exit"}
    assert finished == pids  # every rank ended in the process it had
    lines = [e["message"] for e in result.events if e["event"] == "switch-abandoned"]
    assert "hot switch #1 refused: unknown node 5" in lines[0] and "nothing moves" in lines[0]
    assert len(lines) >= 2 and all("running" in line for line in lines[1:]), lines
    assert_same_params(result.params, ref)
