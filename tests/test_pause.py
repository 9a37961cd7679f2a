"""`ftctl pause` / `ftctl resume` (launcher.cli.pause): the records they write against a real
store, their refusals (one line, exit 2), finding the job by its run directory; and end to end
on a live 4-rank native-loop job: every rank halts after the same step, steps stop advancing
with the processes unchanged, `ftctl status` says so, and after `ftctl resume` the job ends with
parameters bit-identical to a run without a pause."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from helpers_faults import LiveJob, assert_same_params, run_job

from launcher.cli import ftctl
from launcher.cli.pause import job_addr
from launcher.observe.pause_state import pause_state
from launcher.observe.status import node_snapshots, rank_step
from launcher.protocol import plan as P
from rendezvous.store.client import StoreClient
from rendezvous.store.server import StoreServer
from tests.helpers_launch import env_with

FTCTL = [sys.executable, "-m", "launcher.cli.ftctl"]
STEPS = 8


@pytest.fixture
def store():
    with StoreServer(host="127.0.0.1") as s:
        yield s


def here(capsys, *args: str) -> tuple[int, str, str]:
    """`ftctl ARGS` in this process: (exit code, stdout, stderr)."""
    try:
        ftctl.main(list(args))
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_pause_writes_the_request_and_tells_every_agent(store: StoreServer, capsys) -> None:
    addr = f"127.0.0.1:{store.port}"
    code, out, err = here(capsys, "pause", "--addr", addr, "--max-duration", "60")
    assert code == 0, err
    assert out.startswith("pause #1 requested") and "at most 60 s" in out
    req = P.PauseRequest.from_json(store.kv.get(P.PAUSE_KEY, 1.0))
    assert (req.seq, req.max_s) == (1, 60.0) and abs(req.time - time.time()) < 30
    nudge = P.Injection.from_json(store.kv.get(P.inject_key(1), 1.0))
    assert (nudge.rank, nudge.kind) == (P.EVERY_RANK, P.PAUSE_KIND)
    state = pause_state(store.kv)
    assert state is not None and state.in_effect and state.halt_step is None


def test_one_pause_at_a_time_and_resume_ends_it(store: StoreServer, capsys) -> None:
    addr = f"127.0.0.1:{store.port}"
    assert here(capsys, "pause", "--addr", addr)[0] == 0
    code, out, err = here(capsys, "pause", "--addr", addr)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ftctl: error:") and "pause #1" in lines[0]
    assert store.kv.try_get(P.PAUSE_SEQ) == b"1"  # nothing written
    code, out, err = here(capsys, "resume", "--addr", addr)
    assert code == 0, err
    assert out.strip() == "pause #1 ended (ftctl resume): the ranks continue"
    assert store.kv.get(P.resume_key(1), 1.0) == b"ftctl resume"
    code, out, err = here(capsys, "resume", "--addr", addr)
    assert code == 2 and "no pause in effect (the last: pause #1 ended (ftctl resume))" in err
    assert here(capsys, "pause", "--addr", addr)[0] == 0  # a new one after the end
    assert P.PauseRequest.from_json(store.kv.get(P.PAUSE_KEY, 1.0)).seq == 2


def test_resume_keeps_the_reason_the_ranks_wrote_first(store: StoreServer, capsys) -> None:
    addr = f"127.0.0.1:{store.port}"
    here(capsys, "pause", "--addr", addr)
    store.kv.set(P.pause_step_key(1), b"4")
    state = pause_state(store.kv)
    assert state is not None and state.halt_step == 4
    assert "paused after step 4 (pause #1" in state.describe()


def test_the_job_is_found_by_its_run_directory(store: StoreServer, capsys, tmp_path) -> None:
    run = tmp_path / "logs" / "run-1"
    run.mkdir(parents=True)
    (run / P.STORE_ADDR_FILE).write_text(json.dumps({"addr": f"127.0.0.1:{store.port}"}))
    assert here(capsys, "pause", str(tmp_path / "logs"))[0] == 0  # the --log_dir base
    assert here(capsys, "resume", str(run))[0] == 0  # the run's own directory
    code, _, err = here(capsys, "pause", str(tmp_path))  # two levels up: not found
    assert code == 2 and "no store.json found" in err


@pytest.mark.parametrize("value", ["0", "-3", "1e9", "x"])
def test_a_bad_max_duration_is_one_line_exit_2(capsys, value: str) -> None:
    code, out, err = here(capsys, "pause", "--addr", "127.0.0.1:1", "--max-duration", value)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--max-duration" in lines[0]


# ---------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    job = run_job(tmp_path_factory.mktemp("pause_ref"), steps=STEPS)
    assert job.returncode == 0, job.describe()
    return job.params


def ftctl_run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        FTCTL + list(args), env=env_with(), capture_output=True, text=True, timeout=60
    )


def wait_paused(job: LiveJob, timeout: float = 30.0) -> list[int]:
    """The steps the 4 ranks said they halted after."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = [int(s) for s in re.findall(r"paused after step (\d+) \(pause #1", job.output())]
        if len(steps) == 4:
            return steps
        assert job.proc.poll() is None, job.output()[-4000:]
        time.sleep(0.05)
    raise AssertionError(f"the ranks did not all pause:\n{job.output()[-4000:]}")


def test_a_live_job_pauses_after_one_step_and_resumes_bit_identical(tmp_path, ref) -> None:
    job = LiveJob(tmp_path, script_args=["--step-time", "0.3"], steps=STEPS)
    try:
        job.wait_for("hello", 4)
        res = ftctl_run("pause", str(tmp_path / "logs"), "--max-duration", "120")
        assert res.returncode == 0, res.stdout + res.stderr
        halted = wait_paused(job)
        assert len(set(halted)) == 1 and halted[0] < STEPS - 1, halted
        kv = StoreClient("127.0.0.1", int(job.store_addr().rpartition(":")[2]), timeout=5.0)
        try:
            before = _steps(kv, want=[halted[0]] * 4)
            time.sleep(1.5)  # five steps' time: nobody moves
            after = _steps(kv)
            state = pause_state(kv)
        finally:
            kv.close()
        assert before == after == [halted[0]] * 4, (before, after)
        assert state is not None and state.in_effect and state.halt_step == halted[0]
        status = ftctl_run("status", "--addr", job.store_addr(), "--json")
        assert status.returncode == 0, status.stderr
        shown = json.loads(status.stdout)
        assert f"paused after step {halted[0]} (pause #1" in shown["source"]
        assert [r["state"] for r in shown["ranks"]] == ["paused"] * 4, shown["ranks"]
        pids = {e["rank"]: e["pid"] for e in job.wait_for("spawn", 4)}
        for pid in pids.values():
            os.kill(pid, 0)  # alive, never restarted
        res = ftctl_run("resume", "--addr", job.store_addr())
        assert res.returncode == 0, res.stdout + res.stderr
    except BaseException:
        ftctl_run("resume", str(tmp_path / "logs"))  # a failed check: not 120 s more paused
        raise
    finally:
        result = job.finish()
    assert result.returncode == 0, result.describe()
    assert result.strategies() == [] and result.restarted() == {}
    assert {r: p[0] for r, p in result.pids.items()} == pids
    assert result.output.count("(pause #1: ftctl resume)") == 4
    assert_same_params(result.params, ref)


def _steps(kv, ranks: int = 4, want: list[int] | None = None) -> list[int | None]:
    """Each rank's step, as its agent publishes it (`ftctl status`'s source), once fresh: all
    known, and `want` when given (the agent publishes every PUBLISH_INTERVAL, so the first
    snapshot after the halt may still show the step before it)."""
    deadline = time.monotonic() + 5
    while True:
        snaps = node_snapshots(kv)
        steps = [rank_step(snaps, r) for r in range(ranks)]
        ready = None not in steps and (want is None or steps == want)
        if ready or time.monotonic() > deadline:
            return steps
        time.sleep(0.1)


# ~11 s: slow; the pause itself is in CI above (a live job), the hooks' step end in
# test_runtime_callbacks
@pytest.mark.slow
def test_the_framework_hooks_pause_at_step_end_and_resume_bit_identical(tmp_path) -> None:
    """The same through launcher.runtime.callbacks (tests/scripts/callbacks_loop.py, 2 ranks):
    the ranks halt in `step_end` of one step and the run stays bit-identical."""
    from helpers_launch import FTRUN, script
    from helpers_runtime import assert_bit_identical, load_params
    from test_runtime_callbacks import tiny_reference

    out = open(tmp_path / "ftrun.out", "w+", encoding="utf-8")
    proc = subprocess.Popen(
        FTRUN
        + [
            "--nproc_per_node",
            "2",
            "--log_dir",
            str(tmp_path / "logs"),
            script("callbacks_loop.py"),
        ]
        + ["--steps", "8", "--step-time", "0.3", "--out", str(tmp_path / "out{rank}.pt")]
        + ["--events", str(tmp_path / "cb{rank}.jsonl")],
        env=env_with(FTRUN_STORE_TIMEOUT="60"),
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=str(tmp_path),
    )
    text = lambda: (tmp_path / "ftrun.out").read_text(errors="replace")  # noqa: E731
    try:
        deadline = time.monotonic() + 60
        while text().count("joined generation 0") < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, text()[-4000:]
            time.sleep(0.05)
        res = ftctl_run("pause", str(tmp_path / "logs"))
        assert res.returncode == 0, res.stdout + res.stderr
        while len(re.findall(r"paused after step (\d+)", text())) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, text()[-4000:]
            time.sleep(0.05)
        halted = {int(s) for s in re.findall(r"paused after step (\d+)", text())}
        host, _, port = job_addr(str(tmp_path / "logs"), None).rpartition(":")
        kv = StoreClient(host, int(port), timeout=5.0)
        try:
            before = _steps(kv, 2, want=[min(halted)] * 2)
            time.sleep(1.0)  # three steps' time: nobody moves
            after = _steps(kv, 2)
        finally:
            kv.close()
        assert len(halted) == 1 and before == after == [min(halted)] * 2, (halted, before, after)
        res = ftctl_run("resume", str(tmp_path / "logs"))
        assert res.returncode == 0, res.stdout + res.stderr
        assert proc.wait(120) == 0, text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        out.close()
    spawns = [e for e in _events(tmp_path / "logs") if e["event"] == "spawn"]
    assert sorted(e["rank"] for e in spawns) == [0, 1]  # nobody restarted
    ref = tiny_reference(8)
    for r in range(2):
        assert_bit_identical(load_params(tmp_path / f"out{r}.pt"), ref)


def _events(log_dir) -> list[dict]:
    from helpers_launch import events

    return events(str(log_dir))
