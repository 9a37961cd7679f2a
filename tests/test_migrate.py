"""`ftctl migrate` (launcher.cli.migrate) and the hot switch end to end
(launcher.control.hot_switch, launcher.agent.hot_switch): the request it writes, its refusals
(one line, non-zero exit), and on a live 4-rank native-loop job: rank 1 moves to a new process
at a step boundary, the others keep their pids, no step is recomputed, no restart is counted,
the parameters are bit-identical to a run without a switch; a switch whose new process dies
before the halt is abandoned and the ranks keep running."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
from helpers_faults import LiveJob, assert_same_params, run_job

from launcher.cli import ftctl
from launcher.protocol import plan as P
from rendezvous.store.server import StoreServer
from tests.helpers_launch import env_with

FTCTL = [sys.executable, "-m", "launcher.cli.ftctl"]
STEPS = 12


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
    assert_same_params(result.params, ref)
