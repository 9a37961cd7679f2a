"""One hang is one fault (issue 13), end to end through the real CLI.

4 ranks of scripts/examples/ddp_train.py (gloo), and unmodified tests/scripts/ddp_plain.py:
  - `kill -STOP` of a random rank with default flags (the 30 s floor): that rank, and only it, is
    replaced in one round, the run ends bit-identical to a fault-free one;
  - an injected hang with the FTRUN_HANG_FLOOR knob: likewise;
  - three survivors timing out in the collective the hung rank never joins: one fault (a hang of
    that rank, blamed by the controller), one round;
  - a survivor that stays blocked in a collective after a round's stop (`stuck-wait`): killed as
    hung FTRUN_HANG_STOP after the stop and repaired in a superseding round, no fallback;
  - a budget exhausted by a hang after a repaired UCE: the summary names the hang;
  - an unmodified script with one rank stopped: detected within --hang-timeout, stacks dumped,
    that rank blamed, restart-all, the job completes;
  - (slow) an unmodified script whose peers' gloo collectives time out on a sleeping rank: their
    exits are consequences, the rank that went silent first is blamed;
  - a rank that hangs at exit after its goodbye (rt.finish()): killed after --hang-timeout of
    silence, stacks dumped, counted as finished: the job ends with 0, nothing restarted (before:
    the job waited for it forever).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import pytest
from helpers_faults import LiveJob, assert_same_params, run_job
from helpers_launch import FTRUN, env_with, events, script

from launcher.control.progress import read_progress
from launcher.protocol.plan import progress_key
from rendezvous.store.client import StoreClient

STEPS = 40
STEP_TIME = "0.1"  # seconds of sleep per step (does not change the numbers)


def hang(rank: int, step: int, generation: int = 0, kind: str = "hang") -> dict:
    return {"rank": rank, "step": step, "phase": "forward", "kind": kind, "generation": generation}


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    job = run_job(tmp_path_factory.mktemp("hang_ref"), steps=STEPS)
    assert job.returncode == 0, job.describe()
    return job.params


def wait_for_step(job: LiveJob, step: int, timeout: float = 120.0) -> None:
    """Until every rank's progress record (the agents' records in the store) is at `step`."""
    host, port = job.store_addr().rsplit(":", 1)
    kv = StoreClient(host, int(port), timeout=10.0)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            recs = read_progress(kv, 1)
            if len(recs) == 4 and all(r.aware and r.phase and r.idle_s < 5 for r in recs):
                raw = kv.try_get(progress_key(0))
                if raw and min(v["step"] for v in json.loads(raw)["ranks"].values()) >= step:
                    return
            time.sleep(0.2)
    finally:
        kv.close()
    raise AssertionError(f"the ranks did not reach step {step}\n{job.output()[-4000:]}")


def one_round_for(job, rank: int) -> dict:
    """The job used exactly one round, recover-in-place of `rank` for a hang; its decide event."""
    assert job.returncode == 0, job.describe()
    assert job.strategies() == ["recover-in-place"], job.describe()
    assert job.plans()[0]["failed_ranks"] == [rank] and job.restarted() == {rank: 1}
    decide = job.first("decide")
    assert decide["rank"] == rank and decide["fault_kind"] == "hang", decide
    return decide


# ~40 s (the default hang timeout runs out): slow; detection of a stopped rank is in CI below
# (the floor knob, an unmodified script's stopped rank, survivors timing out in one collective)
@pytest.mark.slow
def test_sigstop_of_a_random_rank_is_found_with_default_flags(tmp_path, ref):
    victim = random.Random().randrange(4)
    job = LiveJob(tmp_path, script_args=["--step-time", STEP_TIME], steps=STEPS)
    spawns = job.wait_for("spawn", 4)
    pid = next(e["pid"] for e in spawns if e["rank"] == victim)
    wait_for_step(job, 3)  # the step times are known: the first-step allowance is over
    os.kill(pid, signal.SIGSTOP)
    stopped = time.time()
    result = job.finish(timeout=300)
    one_round_for(result, victim)
    found = result.first("hang", rank=victim)
    assert "SIGSTOP, state T" in found["basis"] and found["proc_state"] == "T", found
    assert found["timeout_s"] == 30.0  # the floor: steps are far below 3 s
    assert 28.0 <= found["time"] - stopped <= 30.0 + 15.0, found["time"] - stopped
    assert result.first("hang-stacks", rank=victim)["how"].startswith("faulthandler")
    assert (
        "most recent call first" in result.output[result.output.index("hangs: process stopped") :]
    )
    assert_same_params(result.params, ref)


def test_an_injected_hang_is_found_with_the_floor_knob(tmp_path, ref):
    job = run_job(
        tmp_path,
        [hang(2, step=5)],
        script_args=["--step-time", STEP_TIME],
        steps=STEPS,
        env={"FTRUN_HANG_FLOOR": "3"},
    )
    one_round_for(job, 2)
    found = job.first("hang", rank=2)
    assert "while not waiting in a collective" in found["basis"] and found["timeout_s"] >= 3.0
    assert job.first("hang-policy")["message"].startswith("hang detection: max(3s, 10 x slowest")
    assert_same_params(job.params, ref)


def test_survivors_timing_out_in_one_collective_are_one_fault_of_the_hung_rank(tmp_path, ref):
    # the hang watch is off: only the survivors' collective timeouts (4 s) tell of the hang
    job = run_job(
        tmp_path,
        [hang(1, step=4)],
        ["--hang-timeout", "0"],
        steps=STEPS,
        script_args=["--step-time", STEP_TIME],
        env={"FTRUN_COLLECTIVE_TIMEOUT": "4"},
    )
    one_round_for(job, 1)  # exactly one recovery round for rank 1 (it asserts)
    reports = [e for e in job.events if e["event"] == "worker-fault"]
    assert reports and {e["fault_kind"] for e in reports} == {"network"}, reports
    assert {e["rank"] for e in reports} <= {0, 2, 3}
    merged = job.first("fault-merged")
    assert (
        merged["rank"] == 1
        and merged["fault_kind"] == "hang"
        and set(merged["reporters"]) <= {0, 2, 3}
    )
    absorbed = [e for e in job.events if e["event"] == "fault-absorbed"]
    assert len(reports) == merged["reports"] + len(absorbed), (reports, absorbed)
    assert job.first("hang-stacks", rank=1)  # the controller's culprit is dumped before the kill
    assert_same_params(job.params, ref)


def test_a_survivor_that_stays_in_a_collective_after_the_stop_is_repaired_in_the_same_round(
    tmp_path, ref
):
    """Rank 2 blocks in step 4's backward as inside a collective a stop cannot break (it says
    `waiting`, deaf to stops; CI saw a survivor do this in DDP's C++ all-reduce), then rank 1 is
    killed there. Before, rank 2 held the round for the controller's 120 s phase timeout and the
    job fell back to restart-all; now the agent finds it still waiting FTRUN_HANG_STOP (2 s) after
    the stop, kills it as hung, and the round is superseded by one that repairs both."""
    plan = [
        {"rank": 2, "step": 4, "phase": "backward", "kind": "stuck-wait"},
        {"rank": 1, "step": 4, "phase": "backward", "kind": "kill"},
    ]
    job = run_job(
        tmp_path,
        plan,
        script_args=["--step-time", STEP_TIME],
        steps=STEPS,
        env={"FTRUN_HANG_STOP": "2"},
        timeout=240,
    )
    assert job.returncode == 0, job.describe()
    assert job.strategies() == ["recover-in-place", "recover-in-place"], job.describe()
    assert job.plans()[-1]["failed_ranks"] == [1, 2] and job.restarted() == {1: 1, 2: 1}, (
        job.describe()
    )
    found = job.first("hang", rank=2)
    assert "after the stop for generation 1" in found["basis"] and found["waiting"], found
    # sent_at: when the survivors' stops went out (the event itself is logged after the respawns)
    stop = job.first("stop-sent")["sent_at"]
    assert 2.0 <= found["time"] - stop <= 2.0 + 10.0, found["time"] - stop
    assert job.first("round-superseded", rank=2)["fault_kind"] == "hang"
    assert not [e for e in job.events if e["event"] in ("phase-timeout", "fallback")], (
        job.describe()
    )
    assert_same_params(job.params, ref)


def test_a_budget_spent_on_a_hang_names_the_hang_not_the_repaired_uce(tmp_path):
    plan = [hang(2, step=2, kind="uce-low"), hang(1, step=4, generation=1)]
    job = run_job(
        tmp_path,
        plan,
        ["--max_restarts", "1"],
        steps=STEPS,
        script_args=["--step-time", STEP_TIME],
        env={"FTRUN_HANG_FLOOR": "3"},
    )
    assert job.returncode == 1, job.describe()
    assert job.strategies() == ["retry", "exit"], job.describe()
    out = job.output
    head = out[out.index("Root Cause") : out.index("Earlier faults")]
    assert "the fault whose handling failed" in head and "kind      : hang" in head, head
    assert "rank      : 1" in head and "handling  : exit (gen 2): failed: " in head, head
    hist = out[out.index("Earlier faults") : out.index("Other Failures")]
    assert "rank 2 uce-low [injected]" in hist and "retry (gen 1): recovered" in hist, hist
    summary = job.first("summary")
    assert summary["root_cause"]["kind"] == "hang" and summary["root_cause"]["rank"] == 1


def test_an_unmodified_script_with_a_stopped_rank_is_restarted_blaming_that_rank(tmp_path):
    victim = 1
    out = tmp_path / "result.json"
    cmd = FTRUN + [
        "--nproc_per_node",
        "3",
        "--max_restarts",
        "1",
        "--hang-timeout",
        "5",
        "--monitor_interval",
        "0.5",
        "--log_dir",
        str(tmp_path / "logs"),
        script("ddp_plain.py"),
        "--steps",
        "150",
        "--step-time",
        "0.05",
        "--out",
        str(out),
        "--started-dir",
        str(tmp_path / "started"),
    ]
    log = open(tmp_path / "ftrun.out", "w+", encoding="utf-8")
    proc = subprocess.Popen(
        cmd, env=env_with(), stdout=log, stderr=subprocess.STDOUT, cwd=str(tmp_path)
    )
    try:
        deadline = time.monotonic() + 120
        pid = None
        while pid is None and time.monotonic() < deadline:
            pid = next(
                (
                    e["pid"]
                    for e in events(str(tmp_path / "logs"))
                    if e["event"] == "spawn" and e["rank"] == victim
                ),
                None,
            )
            time.sleep(0.1)
        assert pid is not None
        # every rank has finished a step (a fixed sleep from its spawn could stop rank 1 while
        # it still waited for its peers' `import torch`: the silence began earlier, a CI risk)
        while len(list((tmp_path / "started").glob("rank*"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(list((tmp_path / "started").glob("rank*"))) == 3, (
            "the ranks never finished step 0"
        )
        time.sleep(1.0)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.time()
        code = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    text = (tmp_path / "ftrun.out").read_text(errors="replace")
    ev = events(str(tmp_path / "logs"))
    assert code == 0, text[-6000:]
    assert json.loads(out.read_text())["restart_count"] == 1
    found = next(e for e in ev if e["event"] == "hang")
    assert found["rank"] == victim and found["proc_state"] == "T" and not found["weak"], found
    assert 5.0 <= found["time"] - stopped <= 5.0 + 10.0
    stacks = next(e for e in ev if e["event"] == "hang-stacks")
    assert stacks["rank"] == victim and stacks["how"] == "faulthandler (SIGABRT)"
    assert "Fatal Python error: Aborted" in text and "most recent call first" in text
    plans = [e for e in ev if e["event"] == "plan"]
    assert [p["strategy"] for p in plans] == ["restart-all"]
    decide = next(e for e in ev if e["event"] == "decide")
    assert decide["rank"] == victim and decide["fault_kind"] == "hang"


@pytest.mark.slow  # extra coverage of item 6 (the SIGSTOP test above is the CI one)
def test_an_unmodified_scripts_backend_timeouts_blame_the_rank_that_went_silent_first(tmp_path):
    out = tmp_path / "result.json"
    cmd = FTRUN + [
        "--nproc_per_node",
        "3",
        "--max_restarts",
        "1",
        "--monitor_interval",
        "0.5",
        "--log_dir",
        str(tmp_path / "logs"),
        script("plain_hang.py"),
        "--hang-rank",
        "1",
        "--timeout",
        "5",
        "--work",
        "2",
        "--out",
        str(out),
    ]
    res = subprocess.run(
        cmd, env=env_with(), capture_output=True, text=True, timeout=240, cwd=str(tmp_path)
    )
    ev = events(str(tmp_path / "logs"))
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-6000:]
    assert json.loads(out.read_text()) == {"sum": 3.0, "restart_count": 1}
    failed = [e for e in ev if e["event"] == "worker-failed"]
    assert failed and {e["fault_kind"] for e in failed} == {"network"}, (
        failed
    )  # the victims' timeouts
    assert {e["rank"] for e in failed} <= {0, 2}
    merged = next(e for e in ev if e["event"] == "fault-merged")
    assert merged["rank"] == 1 and merged["fault_kind"] == "hang", merged
    decide = next(e for e in ev if e["event"] == "decide")
    assert decide["rank"] == 1 and decide["fault_kind"] == "hang"
    assert [e["strategy"] for e in ev if e["event"] == "plan"] == ["restart-all"]
    stacks = next(e for e in ev if e["event"] == "hang-stacks")
    # py-spy when installed (it attaches to a running process), else faulthandler via SIGABRT
    assert stacks["rank"] == 1 and stacks["how"] in ("faulthandler (SIGABRT)", "py-spy"), stacks
    if stacks["how"] == "py-spy":
        assert "dumped by py-spy" in text
    else:
        assert "Fatal Python error: Aborted" in text


def test_a_rank_hanging_at_exit_after_its_goodbye_is_killed_and_the_job_ends(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    cmd = FTRUN + [
        "--nproc_per_node",
        "3",
        "--max_restarts",
        "2",
        "--hang-timeout",
        "3",
        "--monitor_interval",
        "0.5",
        "--tee",
        "3",
        "--log_dir",
        str(tmp_path / "logs"),
        script("hangs_at_exit.py"),
        "--victim",
        "1",
    ]
    t0 = time.monotonic()
    res = subprocess.run(
        cmd,
        env=env_with(OUT_DIR=str(out)),
        capture_output=True,
        text=True,
        timeout=90,
        cwd=str(tmp_path),
    )
    took = time.monotonic() - t0
    text = res.stdout + res.stderr
    ev = events(str(tmp_path / "logs"))
    assert res.returncode == 0, text[-6000:]
    hung = next(e for e in ev if e["event"] == "exit-hang")
    assert (
        hung["rank"] == 1
        and hung["pid"] == int((out / "hung.1").read_text())
        and hung["idle_s"] >= 3.0
    )  # rounded to ms
    # found soon after the allowance although gloo's event-loop thread still wakes on its timers
    # (a clock tick of CPU every few seconds; it used to restart the silence clock: 10-25 s here)
    assert hung["time"] - (out / "hung.1").stat().st_mtime < 3.0 + 5.0, hung
    stacks = next(e for e in ev if e["event"] == "hang-stacks")
    assert stacks["rank"] == 1 and "hangs_at_exit.py" in (stacks["stacks"] or text), stacks
    assert [e["rank"] for e in ev if e["event"] == "spawn"] == [0, 1, 2]  # nothing restarted
    assert not [e for e in ev if e["event"] in ("worker-failed", "plan", "decide")], text[-4000:]
    assert "killed after hanging at exit" in text and "job finished successfully" in text
    print(f"job with a rank hanging at exit: {took:.1f}s")
