"""launcher.runtime end to end under a minimal supervisor (tests/helpers_runtime.MiniJob):
4 real gloo workers, real SIGKILLs, replacement ranks, peer repair, restart-all fallback.
The acceptance criterion everywhere: final parameters bit-identical to a fault-free run."""
from __future__ import annotations

import pytest

from helpers_runtime import EXAMPLES, MiniJob, assert_bit_identical, load_params

STEPS = 8


def run_job(tmp_path, name, script, fault_plan=None, extra_args=(), timeout=150, fallback=None):
    wd = tmp_path / name
    wd.mkdir()
    args = ["--steps", str(STEPS), "--out", str(wd / "out{rank}.pt"), *extra_args]
    job = MiniJob(EXAMPLES / script, args, 4, wd, fault_plan=fault_plan, fallback=fallback)
    try:
        rc = job.run(timeout)
        assert rc == 0, job.logs()
        return job, [load_params(wd / f"out{r}.pt") for r in range(4)]
    finally:
        job.close()


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    _, params = run_job(tmp_path_factory.mktemp("ref"), "ref", "ddp_train.py")
    return params


@pytest.fixture(scope="module")
def hybrid_reference(tmp_path_factory):
    _, params = run_job(tmp_path_factory.mktemp("href"), "href", "hybrid_train.py")
    return params


def restarted(job) -> dict[int, int]:
    return {r: len(job.pids(r)) - 1 for r in range(4) if len(job.pids(r)) > 1}


@pytest.mark.slow  # the same through the real CLI runs by default in test_runtime_recovery.py
@pytest.mark.parametrize("phase", ["forward", "backward", "optimizer"])
def test_sigkill_one_rank_only_it_restarts_and_result_is_bit_identical(tmp_path, ddp_reference, phase):
    job, params = run_job(tmp_path, "kill", "ddp_train.py",
                          [{"rank": 2, "step": 4, "phase": phase, "kind": "kill"}])
    assert restarted(job) == {2: 1}
    plans = [e for e in job.events if e["op"] == "plan"]
    assert len(plans) == 1 and plans[0]["pairs"] == [[0, 2]]
    assert plans[0]["resume_step"] == (5 if phase == "optimizer" else 4)
    for r in range(4):
        assert_bit_identical(params[r], ddp_reference[0])


@pytest.mark.slow
def test_exception_is_retried_in_place_without_restarting_anyone(tmp_path, ddp_reference):
    job, params = run_job(tmp_path, "exc", "ddp_train.py",
                          [{"rank": 1, "step": 3, "phase": "backward", "kind": "exception"},
                           {"rank": 3, "step": 5, "phase": "optimizer", "kind": "uce-high", "generation": 1}])
    assert restarted(job) == {}
    faults = [e for e in job.events if e["op"] == "fault"]
    assert [(f["rank"], f["kind"], f["injected"]) for f in faults] == [(1, "exception", True), (3, "uce-high", True)]
    plans = [e for e in job.events if e["op"] == "plan"]
    assert plans[0]["pairs"] == [] and plans[1]["pairs"] == [[0, 3]]  # dirty rank 3 repaired
    for r in range(4):
        assert_bit_identical(params[r], ddp_reference[0])


@pytest.mark.slow
def test_three_faults_including_the_same_rank_twice(tmp_path, ddp_reference):
    job, params = run_job(tmp_path, "three", "ddp_train.py",
                          [{"rank": 1, "step": 2, "phase": "forward", "kind": "kill"},
                           {"rank": 1, "step": 4, "phase": "backward", "kind": "segv", "generation": 1},
                           {"rank": 3, "step": 6, "phase": "optimizer", "kind": "exit", "generation": 2}])
    assert restarted(job) == {1: 2, 3: 1}
    for r in range(4):
        assert_bit_identical(params[r], ddp_reference[0])


def test_hybrid_two_ranks_of_different_replica_groups_at_once(tmp_path, hybrid_reference):
    job, params = run_job(tmp_path, "two", "hybrid_train.py",
                          [{"rank": 0, "step": 3, "phase": "forward", "kind": "kill"},
                           {"rank": 3, "step": 3, "phase": "forward", "kind": "kill"}])
    assert restarted(job) == {0: 1, 3: 1}
    plans = [e for e in job.events if e["op"] == "plan"]
    assert plans[-1]["pairs"] == [[2, 0], [1, 3]]  # each from its own replica
    for r in range(4):
        assert_bit_identical(params[r], hybrid_reference[r])


@pytest.mark.slow
def test_no_healthy_replica_falls_back_to_restart_all_from_checkpoint(tmp_path, hybrid_reference):
    job, params = run_job(tmp_path, "fallback", "hybrid_train.py",
                          [{"rank": 0, "step": 5, "phase": "backward", "kind": "kill"},
                           {"rank": 2, "step": 5, "phase": "backward", "kind": "kill"}],
                          extra_args=["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2"])
    plans = [e for e in job.events if e["op"] == "plan"]
    assert plans[0]["fallback"] == "restart-all" and "tp0-pp0" in plans[0]["reason"]
    assert all(len(job.pids(r)) >= 2 for r in range(4))  # everyone restarted
    assert "loaded checkpoint iteration 4" in job.logs()
    for r in range(4):
        assert_bit_identical(params[r], hybrid_reference[r])


@pytest.mark.slow
def test_dying_gasp_dump_saves_the_current_step_and_the_next_launch_resumes_from_it(tmp_path, hybrid_reference):
    ckpt = tmp_path / "ckpt"
    job, params = run_job(tmp_path, "dump", "hybrid_train.py",
                          [{"rank": 0, "step": 5, "phase": "forward", "kind": "kill"}],
                          extra_args=["--checkpoint-dir", str(ckpt)], fallback="dump")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "5\n"
    assert sorted(p.name for p in (ckpt / "iter_0000005").iterdir()) == ["mp_rank_00", "mp_rank_01"]
    logs = job.logs()
    assert "checkpoint shard mp_rank_00 of iteration 5 written" in logs  # by rank 2, rank 0's replica
    assert "loaded checkpoint iteration 5" in logs
    for r in range(4):
        assert_bit_identical(params[r], hybrid_reference[r])


@pytest.mark.slow
def test_plain_torchrun_trains_without_recovery_and_resumes_from_checkpoints(tmp_path):
    """No agent: one log line says so; a run resumed from a checkpoint equals an uninterrupted one."""
    import subprocess
    import sys

    from helpers_runtime import base_env

    def torchrun(name, steps, ckpt):
        out = tmp_path / f"{name}.pt"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(EXAMPLES / "ddp_train.py"), "--steps", str(steps), "--out", str(out),
               "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3"]
        res = subprocess.run(cmd, env=base_env(), capture_output=True, text=True, timeout=180, cwd=tmp_path)
        assert res.returncode == 0, res.stdout + res.stderr
        return res.stdout + res.stderr, out

    log, whole = torchrun("whole", 6, tmp_path / "c1")
    assert "no FTRUN_AGENT_SOCKET: running without an ftrun agent, so no process-level recovery" in log
    torchrun("first", 3, tmp_path / "c2")
    log, resumed = torchrun("resumed", 6, tmp_path / "c2")
    assert "loaded checkpoint iteration 3" in log
    assert_bit_identical(load_params(resumed), load_params(whole))
