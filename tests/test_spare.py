"""Warm spares: a pre-imported process runs the assigned script like `python -u script args`."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable

import pytest
from helpers_priority import nice_and_policy
from helpers_procs import proc_state, settles

from launcher.workers.spare import REPAIR_BOOST_NICE, SparePool, may_return_to


def _run_nice() -> int:
    """The niceness a taken spare runs its rank at until the rank recovered: REPAIR_BOOST_NICE
    above the agent where this user may lower niceness, else the agent's."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    boost = max(-20, base - REPAIR_BOOST_NICE)
    return boost if boost < base and may_return_to(boost) else base


def _checks_until(
    pool: SparePool, env: dict[str, str], done: Callable[[], object], timeout: float = 60.0
) -> bool:
    """The agent's health check (`ensure`) every 20 ms until `done()` or `timeout` s: whether
    it is done."""
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        pool.ensure(env)
        time.sleep(0.02)
    return bool(done())


def _fill(pool: SparePool, env: dict[str, str], timeout: float = 60.0) -> None:
    """The agent's health check until the pool has its spares (a fork server imports torch
    first)."""
    _checks_until(pool, env, lambda: pool.ready() >= pool.count, timeout)
    assert pool.ready() == pool.count


def _pool_with_imports(
    tmp_path, modules: list[str], count: int
) -> tuple[SparePool, list[str], str, dict[str, str]]:
    """A forking pool of `count` spares (logging into the list returned) whose server imports
    `modules` from `tmp_path` (the `--imports` file, path returned), and the workers' env."""
    from launcher.workers.spare_process import write_imports

    imports = str(tmp_path / "imports.json")
    write_imports(imports, modules, [str(tmp_path)])
    logs: list[str] = []
    pool = SparePool(sys.executable, logs.append, count=count, fork=True)
    pool.extend_imports(imports)
    return pool, logs, imports, dict(os.environ, PYTHONPATH=os.getcwd())


@pytest.mark.parametrize("fork", [False, True])
def test_spare_runs_the_assigned_script_with_its_env_and_argv(
    tmp_path, monkeypatch, fork: bool
) -> None:
    script = tmp_path / "job.py"
    out = tmp_path / "out.json"
    script.write_text(
        "import gc, json, os, sys\n"
        f"json.dump({{'argv': sys.argv, 'path0': sys.path[0], 'rank': os.environ.get('RANK'),"
        f" 'frozen': gc.get_freeze_count() > 1000,"
        f" 'torch': 'torch' in sys.modules, 'name': __name__, 'cwd': os.getcwd(),"
        f" 'sid': os.getsid(0) == os.getpid()}}, open({str(out)!r}, 'w'))\n"
    )
    logs: list[str] = []
    pool = SparePool(sys.executable, logs.append, count=1, start_delay=0.0, fork=fork)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        _fill(pool, env)
        assert "warm spare started" in logs[-1] and ("forked in" in logs[-1]) == fork
        run_in = tmp_path / "cwd"
        run_in.mkdir()
        monkeypatch.chdir(run_in)
        proc = pool.take(dict(env, RANK="3"), [str(script), "--x", "1"], module=False)
        assert proc is not None and proc.wait(timeout=120) == 0
        res = json.loads(out.read_text())
        # the warm imports' objects are out of the collector's sight (gc.freeze): no ~50 ms full
        # collection over them while the replacement starts
        assert res == {
            "argv": [str(script), "--x", "1"],
            "path0": str(tmp_path),
            "rank": "3",
            "frozen": True,
            "torch": True,
            "name": "__main__",
            "cwd": str(run_in),
            "sid": True,
        }
        assert (
            pool.take(env, [str(script)], module=False) is None
        )  # used up until the next ensure()
    finally:
        pool.stop()


def test_idle_spare_is_stopped_at_once() -> None:
    pool = SparePool(sys.executable, lambda m: None, count=1, start_delay=0.0)
    pool.ensure(dict(os.environ, PYTHONPATH=os.getcwd()))
    t0 = time.monotonic()
    pool.stop()
    assert time.monotonic() - t0 < 2.0


def test_pool_keeps_count_spares_and_a_taken_one_is_replaced_at_the_next_ensure(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys\nopen(sys.argv[1], 'w').write(str(os.getpriority(os.PRIO_PROCESS, 0)))\n"
    )
    logs: list[str] = []
    pool = SparePool(sys.executable, logs.append, count=2, start_delay=0.0, fork=False)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        pool.ensure(env)
        assert pool.ready() == 2 and len(logs) == 2 and "2 of 2" in logs[1]
        first = pool.take(env, [str(script), str(tmp_path / "a")], module=False)
        assert first is not None and pool.ready() == 1  # the second spare is still there
        pool.ensure(env)  # its successor starts at once: no refill delay
        assert pool.ready() == 2 and len(logs) == 3
        second = pool.take(env, [str(script), str(tmp_path / "b")], module=False)
        assert second is not None and second.pid != first.pid
        assert first.wait(timeout=120) == 0 and second.wait(timeout=120) == 0
        # the spare warmed up nicer, then runs the rank at the agent's own priority (boosted
        # until the agent hears that its rank recovered)
        assert (tmp_path / "a").read_text() == str(_run_nice())
    finally:
        pool.stop()
    assert pool.ready() == 0


def test_spare_warms_up_nicer_than_the_agent() -> None:
    pool = SparePool(sys.executable, lambda m: None, count=1, start_delay=0.0, fork=False)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        pool.ensure(env)
        pid = pool._procs[0].pid
        deadline = time.monotonic() + 10
        base = os.getpriority(os.PRIO_PROCESS, 0)
        while os.getpriority(os.PRIO_PROCESS, pid) == base and time.monotonic() < deadline:
            time.sleep(0.01)
        expected = min(19, base + 10) if may_return_to(base) else base
        assert os.getpriority(os.PRIO_PROCESS, pid) == expected
    finally:
        pool.stop()


def test_pool_of_zero_starts_nothing_and_a_negative_count_is_refused() -> None:
    pool = SparePool(sys.executable, lambda m: None, count=0, start_delay=0.0)
    pool.ensure(dict(os.environ))
    assert pool.ready() == 0 and pool.take({}, ["x.py"], module=False) is None
    import pytest

    with pytest.raises(ValueError):
        SparePool(sys.executable, lambda m: None, count=-1)


# ~13 s: slow; one fault from a warm spare is in CI (test_faults_e2e, test_runtime_recovery)
@pytest.mark.slow
def test_two_faults_in_a_row_on_one_node_both_start_from_a_warm_spare(tmp_path) -> None:
    """Issue 12 (spares under churn): with the default two spares, a second kill soon after the
    first recovery also gets a warm replacement (before: one spare, refilled 5 s later, so the
    second replacement imported torch cold)."""
    from helpers_faults import run_job

    plan = [
        {"rank": 1, "step": 14, "phase": "forward", "kind": "kill", "generation": 0},
        {"rank": 2, "step": 17, "phase": "forward", "kind": "kill", "generation": 1},
    ]
    job = run_job(tmp_path, plan, script_args=["--step-time", "0.4"], steps=20)
    assert job.returncode == 0, job.describe()
    assert job.strategies() == ["recover-in-place", "recover-in-place"], job.describe()
    spawns = [e for e in job.events if e["event"] == "spawn" and e.get("replacement")]
    assert [(e["rank"], e.get("warm")) for e in spawns] == [(1, True), (2, True)], job.describe()
    started = [
        e for e in job.events if e["event"] == "spare" and "warm spare started" in e["message"]
    ]
    assert len(started) >= 3, (
        started
    )  # two at the start, the used one's successor after the first fault


def test_spare_taken_while_warming_up_returns_to_the_agent_priority_at_once(tmp_path) -> None:
    """A spare assigned before its imports finished used to finish `import torch` at its warm-up
    priority (seconds on a busy node); it now returns to the agent's priority on assignment."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if not may_return_to(base) or not hasattr(os, "SCHED_IDLE"):
        import pytest

        pytest.skip("this user may not lower a process's niceness again")
    script = tmp_path / "job.py"
    out = tmp_path / "out.json"
    script.write_text(
        "import json, os, sys\n"
        "json.dump({'nice': os.getpriority(os.PRIO_PROCESS, 0), "
        "'policy': os.sched_getscheduler(0)},"
        f" open({str(out)!r}, 'w'))\n"
    )
    pool = SparePool(sys.executable, lambda m: None, count=1, start_delay=0.0, fork=False)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        pool.ensure(env)
        pid = pool._procs[0].pid
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (
            os.getpriority(os.PRIO_PROCESS, pid) != base
            and os.sched_getscheduler(pid) == os.SCHED_IDLE
        ):
            time.sleep(0.002)
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE  # warming up: only idle CPU time
        proc = pool.take(env, [str(script)], module=False)
        assert proc is not None
        deadline = time.monotonic() + 5
        while os.getpriority(os.PRIO_PROCESS, pid) != _run_nice() and time.monotonic() < deadline:
            time.sleep(0.002)
        assert os.getpriority(os.PRIO_PROCESS, pid) == _run_nice()
        assert os.sched_getscheduler(pid) == os.SCHED_OTHER
        assert not out.exists()  # back to normal priority before `import torch` had finished
        assert proc.wait(timeout=120) == 0
        assert json.loads(out.read_text()) == {"nice": _run_nice(), "policy": os.SCHED_OTHER}
    finally:
        pool.stop()


def test_spare_still_importing_after_the_idle_limit_continues_at_the_agent_priority() -> None:
    """Issue 12 (spares under churn): under SCHED_IDLE a spare on a node whose training keeps
    every CPU busy got no time and was still importing torch at the next fault (0.8-2.5 s lost
    instead of ~0.2 s); after `idle_limit` the pool now moves it to the agent's priority."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if not may_return_to(base) or not hasattr(os, "SCHED_IDLE"):
        import pytest

        pytest.skip("this user may not lower a process's niceness again")
    pool = SparePool(
        sys.executable, lambda m: None, count=1, start_delay=0.0, idle_limit=0.3, fork=False
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        pool.ensure(env)
        pid = pool._procs[0].pid
        t0 = time.monotonic()
        while time.monotonic() < t0 + 20 and os.sched_getscheduler(pid) != os.SCHED_IDLE:
            time.sleep(0.002)
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        while time.monotonic() < t0 + 10 and (
            os.sched_getscheduler(pid) != os.SCHED_OTHER
            or os.getpriority(os.PRIO_PROCESS, pid) != base
        ):
            pool.ensure(env)  # the agent's health check
            time.sleep(0.01)
        assert (
            os.sched_getscheduler(pid) == os.SCHED_OTHER
            and os.getpriority(os.PRIO_PROCESS, pid) == base
        )
        assert pool._procs[0].poll() is None  # not assigned, still a spare
    finally:
        pool.stop()
    import pytest

    with pytest.raises(ValueError):
        SparePool(sys.executable, lambda m: None, idle_limit=-1)


def test_no_spare_leaves_idle_priority_during_a_round_and_its_resume_step() -> None:
    """Issue 12 (spares under churn): a successor's `import torch` at the agent's priority must
    not land in the next round's state transfer or redone step (the second of two faults lost
    0.5-1 s instead of ~0.2 s): the hold lasts until the round's ranks committed their resume
    step."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if not may_return_to(base) or not hasattr(os, "SCHED_IDLE"):
        import pytest

        pytest.skip("this user may not lower a process's niceness again")
    pool = SparePool(
        sys.executable, lambda m: None, count=1, start_delay=0.0, idle_limit=0.2, fork=False
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        pool.ensure(env)
        pid = pool._procs[0].pid
        pool.hold(7, {0, 1})
        t0 = time.monotonic()
        while time.monotonic() < t0 + 20 and os.sched_getscheduler(pid) != os.SCHED_IDLE:
            time.sleep(0.002)
        time.sleep(0.3)  # past idle_limit
        pool.ensure(env)
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE  # held: still idle
        pool.recovered(0, 7, resume_step=12)
        pool.recovered(1, 7, resume_step=12)
        pool.progressed(0, 12)
        pool.progressed(1, 11)  # round over, but rank 1 still redoes its resume step
        pool.ensure(env)
        assert pool.held() and os.sched_getscheduler(pid) == os.SCHED_IDLE
        pool.progressed(1, 12)
        assert not pool.held()
        pool.ensure(env)
        assert (
            os.sched_getscheduler(pid) == os.SCHED_OTHER
            and os.getpriority(os.PRIO_PROCESS, pid) == base
        )
    finally:
        pool.stop()


def test_recovery_round_holds_back_new_spares_until_its_ranks_recovered() -> None:
    """A successor spare's `import torch` used to start during the state transfer it competes
    with."""
    logs: list[str] = []
    pool = SparePool(sys.executable, logs.append, count=1, start_delay=0.0, fork=False)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        pool.hold(3, {0, 1})
        pool.ensure(env)
        assert pool.ready() == 0 and pool.held()
        pool.recovered(0, 2)  # an older round's report does not count
        pool.recovered(0, 3)
        pool.ensure(env)
        assert pool.ready() == 0
        pool.recovered(1, 4)  # a later round covers this one
        assert not pool.held()
        pool.ensure(env)
        assert pool.ready() == 1 and "warm spare started" in logs[0]
        pool.hold(5, {2}, timeout=0.05)  # a round whose ranks never report holds only so long
        time.sleep(0.06)
        assert not pool.held()
        # a rank of a round that ran out reports its resumed step after all (it used to fail an
        # assertion in the agent: its resume step was kept past the hold)
        pool.hold(6, {3}, timeout=0.05)
        pool.recovered(3, 6, resume_step=9)
        time.sleep(0.06)
        assert not pool.held()
        pool.progressed(3, 9)
        assert not pool.held()
        pool.hold(7, {4}, timeout=5.0)  # the next round is held as usual
        pool.recovered(4, 7, resume_step=2)
        pool.progressed(4, 2)
        assert not pool.held()
    finally:
        pool.stop()


# ------------------------------------------------------------- spares forked from a fork server
def _gone(pids: list[int], timeout: float = 10.0) -> dict[int, str | None]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(proc_state(p) not in (None, "Z") for p in pids):
        time.sleep(0.02)
    return {p: proc_state(p) for p in pids if proc_state(p) not in (None, "Z")}


def test_forked_successor_is_ready_at_once_without_importing_torch(tmp_path) -> None:
    """Issue 12 (spares under churn): a used spare's successor used to import torch again
    (1.5-2 CPU-s, slowing the steps around the next fault); forked from the warm server it is
    ready within milliseconds of the next health check."""
    logs: list[str] = []
    pool = SparePool(sys.executable, logs.append, count=2, start_delay=0.0, fork=True)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    script = tmp_path / "job.py"
    script.write_text("import sys, time\nopen(sys.argv[1], 'w').write(repr(time.time()))\n")
    try:
        _fill(pool, env)
        first = pool.take(env, [str(script), str(tmp_path / "a")], module=False)
        assert first is not None and pool.ready() == 1
        pool.hold(4, {1})  # the round that used it: no fork beside it
        pool.ensure(env)
        assert pool.ready() == 1
        pool.recovered(1, 4)
        t0 = time.monotonic()
        pool.ensure(env)  # asks the server for a fork; a later check adds the spare
        while pool.ready() < 2 and time.monotonic() - t0 < 0.5:
            time.sleep(0.01)
            pool.ensure(env)
        took = time.monotonic() - t0
        assert pool.ready() == 2 and took < 0.5, (took, logs)
        assert "forked in" in logs[-1]
        for name in "bc":  # both, the old one and the successor, run a job at once
            t1 = time.time()
            proc = pool.take(env, [str(script), str(tmp_path / name)], module=False)
            assert proc is not None and proc.wait(timeout=30) == 0
            assert float((tmp_path / name).read_text()) - t1 < 0.5  # no `import torch` first
        assert first.wait(timeout=30) == 0
    finally:
        pool.stop()


def test_sigkill_of_a_forked_spare_turned_worker_is_reported_as_minus_9(tmp_path) -> None:
    """The fault the tests inject: the Reaper must see -9 for a spare the agent adopted, and
    the stop path (signal its process group, wait) must work on it too."""
    import queue
    import signal

    from launcher.workers.workers import Reaper, Worker, stop_workers

    pool = SparePool(sys.executable, lambda m: None, count=2, start_delay=0.0, fork=True)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    script = tmp_path / "job.py"
    script.write_text("import time\ntime.sleep(60)\n")
    events: "queue.Queue[object]" = queue.Queue()
    reaper = Reaper(events)
    try:
        _fill(pool, env)
        w = Worker(local_rank=1, rank=1)
        w.attach(pool.take(env, [str(script)], module=False))
        reaper.watch(w)
        time.sleep(0.2)
        os.kill(w.pid, signal.SIGKILL)
        ev = events.get(timeout=5)
        assert (ev.pid, ev.code) == (w.pid, -9) and w.exit_code == -9
        w2 = Worker(local_rank=2, rank=2)
        w2.attach(pool.take(env, [str(script)], module=False))
        reaper.watch(w2)
        time.sleep(0.2)
        stop_workers([w2], signal.SIGTERM, grace=5.0)
        ev = events.get(timeout=5)
        assert (ev.pid, ev.code) == (w2.pid, -15)
    finally:
        reaper.stop()
        pool.stop()


_AGENT = """
import json, os, sys, time
from launcher.workers.spare import SparePool
pool = SparePool(
    sys.executable, lambda m: print(m, file=sys.stderr), count=2, start_delay=0.0, fork=True
)
env = dict(os.environ)
deadline = time.monotonic() + 60
while pool.ready() < 2 and time.monotonic() < deadline:
    pool.ensure(env); time.sleep(0.02)
worker = pool.take(env, [sys.argv[1]], module=False)
if sys.argv[2] == "paused":  # a round holds the pool: the successor forked meanwhile is stopped
    pool.ensure(env)  # asks the server for the successor; the round's check collects it
    pool.hold(1, {0}, timeout=60)
paused = lambda: sys.argv[2] != "paused" or pool.pause.paused  # once it dies with the agent
while not (pool.ready() >= 2 and paused()) and time.monotonic() < deadline:  # its successor
    pool.ensure(env); time.sleep(0.02)
print(json.dumps({"server": pool._server.proc.pid, "spares": [p.pid for p in pool._procs],
                  "worker": worker.pid}), flush=True)
if sys.argv[2] == "stop":
    time.sleep(0.5)
    worker.kill(); worker.wait(timeout=5)
    pool.stop()
    print("stopped", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("how", ["stop", "sigkill", "paused"])
def test_no_process_outlives_the_agent(tmp_path, how: str) -> None:
    """The fork server, idle forked spares and a forked spare-turned-worker (with a child of its
    own) all end with the agent: at `stop()`, and when the agent is SIGKILLed (death signals),
    also a spare a round has stopped (SIGSTOP: the death signal is SIGKILL)."""
    import signal
    import subprocess

    job = tmp_path / "job.py"
    job.write_text(
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(tmp_path / 'grandchild.tmp')!r}, 'w').write(str(p.pid))\n"
        f"import os; os.replace({str(tmp_path / 'grandchild.tmp')!r}, "
        f"{str(tmp_path / 'grandchild')!r})\n"  # whole once it exists (CI once read '')
        "time.sleep(60)\n"
    )
    agent = subprocess.Popen(
        [sys.executable, "-c", _AGENT, str(job), how],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    try:
        info = json.loads(agent.stdout.readline())
        deadline = time.monotonic() + 10
        while not (tmp_path / "grandchild").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        grandchild = int((tmp_path / "grandchild").read_text())
        pids = [info["server"], info["worker"], *info["spares"]]
        assert len(info["spares"]) == 2 and all(proc_state(p) not in (None, "Z") for p in pids)
        if how == "paused":
            assert settles(info["spares"][-1], stopped=True)
        if how == "stop":
            assert agent.stdout.readline().strip() == "stopped"
            assert _gone(pids, 5) == {}  # reaped by the agent itself
            agent.kill()
        else:
            agent.kill()
        agent.wait(timeout=10)
        assert _gone(pids) == {}
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(timeout=10)
        # the worker's own child has no death signal (as with a Popen'd worker): not ours to check
        try:
            os.kill(grandchild, signal.SIGKILL)
        except (ProcessLookupError, NameError):
            pass


def test_pool_falls_back_to_importing_spares_when_the_fork_server_is_gone(tmp_path) -> None:
    import signal

    logs: list[str] = []
    pool = SparePool(sys.executable, logs.append, count=1, start_delay=0.0, fork=True)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    script = tmp_path / "job.py"
    script.write_text("import sys, torch\nopen(sys.argv[1], 'w').write('ok')\n")
    try:
        _fill(pool, env)
        assert pool._server is not None
        server = pool._server.proc
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=5)
        used = pool.take(env, [str(script), str(tmp_path / "a")], module=False)  # forked earlier
        assert used is not None and used.wait(timeout=30) == 0
        pool.ensure(env)
        assert any("fork server unusable" in m for m in logs), logs
        assert "warm spare started" in logs[-1] and "forked" not in logs[-1]
        assert pool.ready() == 1 and not pool.fork and pool._server is None
        proc = pool.take(env, [str(script), str(tmp_path / "b")], module=False)
        assert proc is not None and proc.wait(timeout=120) == 0
        assert (tmp_path / "b").read_text() == "ok"
    finally:
        pool.stop()


def test_fork_server_switch(tmp_path) -> None:
    """FTRUN_SPARE_FORK is read by the config (tests/test_config.py) and reaches the pool
    through the spawner; the pool forks by default."""
    from launcher.cli.ftrun import parse
    from launcher.config import build_config
    from launcher.observe.logs import AgentLog, RunLogDir
    from launcher.workers.spawner import Spawner, WorkerWorld

    assert SparePool(sys.executable, lambda m: None).fork
    assert not SparePool(sys.executable, lambda m: None, fork=False).fork
    script = tmp_path / "job.py"
    script.write_text("")
    for env, fork in (
        ({"FTRUN_SPARE_FORK": "0"}, False),
        ({"FTRUN_SPARE_FORK": "1"}, True),
        ({}, True),
    ):
        cfg = build_config(parse(["--log_dir", str(tmp_path / "logs"), str(script)]), env=env)
        run_dir = RunLogDir.create(cfg.log_dir, cfg.rdzv_id)
        world = WorkerWorld(0, 1, 1, "127.0.0.1", 1, str(tmp_path / "agent.sock"))
        log = AgentLog(0, None, quiet=True)
        spawner = Spawner(cfg, world, run_dir, log, "h", None, lambda w: None)  # type: ignore[arg-type]
        try:
            assert spawner.spares is not None and spawner.spares.fork is fork
        finally:
            spawner.stop()


def test_forked_spare_runs_the_job_as_a_fresh_interpreter_would(tmp_path, capfd) -> None:
    """No trace of the fork server in the job: no exception being handled, its own exceptions'
    tracebacks without the server's frames, the exit code of an uncaught exception."""
    pool = SparePool(sys.executable, lambda m: None, count=1, start_delay=0.0, fork=True)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    script = tmp_path / "job.py"
    script.write_text(
        "import sys\nprint('handling', sys.exc_info()[0], flush=True)\nraise ValueError('boom')\n"
    )
    try:
        _fill(pool, env)
        proc = pool.take(env, [str(script)], module=False)
        assert proc is not None and proc.wait(timeout=30) == 1
    finally:
        pool.stop()
    out, err = capfd.readouterr()
    assert "handling None" in out
    assert "ValueError: boom" in err and "During handling" not in err and "_Forked" not in err, err


class _Undying:
    """A spare that SIGKILL does not end (D-state, or starved of CPU): its wait times out."""

    def __init__(self, pid: int) -> None:
        self.pid, self.stdin = pid, None

    def kill(self) -> None:
        pass

    def poll(self) -> None:
        return None

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        time.sleep(timeout or 0.0)
        raise subprocess.TimeoutExpired(["spare"], timeout or 0.0)


def test_stop_gives_all_spares_one_bound_and_names_the_ones_left_behind(monkeypatch) -> None:
    """Three spares that do not exit after SIGKILL: stop() waited 5 s for each in turn (15 s,
    past the agent's 10 s shutdown bound); now they share one STOP_S."""
    from launcher.workers import spare as spare_mod

    monkeypatch.setattr(spare_mod, "STOP_S", 0.6, raising=False)
    logs: list[str] = []
    pool = SparePool(sys.executable, logs.append, count=3, start_delay=0.0)
    pool._procs = [_Undying(101), _Undying(102), _Undying(103)]
    t0 = time.monotonic()
    pool.stop()
    assert time.monotonic() - t0 < 1.5
    assert [m.split(" did not exit")[0] for m in logs] == [
        "warm spare pid 101",
        "warm spare pid 102",
        "warm spare pid 103",
    ], logs
    assert all("left behind" in m for m in logs) and pool._procs == []


def test_a_spare_that_does_not_read_its_assignment_is_killed_and_the_next_one_used(
    tmp_path, monkeypatch
) -> None:
    """take() wrote the assignment line with a blocking write: a spare that does not read it
    (stopped, starved) held up the agent's loop forever once the line (its environment) is
    longer than the pipe holds. Now it gets ASSIGN_TIMEOUT_S, is killed, and the next spare
    takes the rank."""
    import subprocess
    import threading

    from launcher.workers import spare as spare_mod

    monkeypatch.setattr(spare_mod, "ASSIGN_TIMEOUT_S", 0.5, raising=False)
    deaf = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.PIPE
    )
    out = tmp_path / "line"
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; open(sys.argv[1], 'w').write(sys.stdin.readline())",
            str(out),
        ],
        stdin=subprocess.PIPE,
    )
    logs: list[str] = []
    pool = SparePool(sys.executable, logs.append, count=2, start_delay=0.0, fork=False)
    pool._procs = [deaf, reader]
    env = {"BIG": "x" * 200_000}  # more than a pipe holds (64 KiB)
    got: list = []
    t = threading.Thread(
        target=lambda: got.append(pool.take(env, ["job.py"], module=False)), daemon=True
    )
    try:
        t.start()
        t.join(5.0)
        assert not t.is_alive(), "take() blocked on a spare that does not read its stdin"
        assert got == [reader]
        assert reader.wait(timeout=10) == 0
        assert json.loads(out.read_text())["env"] == env
        assert deaf.wait(timeout=5) == -9
        assert any(m.startswith(f"warm spare pid {deaf.pid} not used (it took ") for m in logs), (
            logs
        )
    finally:
        for p in (deaf, reader):
            if p.poll() is None:
                p.kill()
                p.wait(timeout=5)
        t.join(5.0)


@pytest.mark.parametrize("fork", [False, True])
def test_a_taken_spare_runs_boosted_until_its_rank_recovered(tmp_path, fork: bool) -> None:
    """The replacement is what every other rank waits for: it runs REPAIR_BOOST_NICE levels
    above the agent (every thread) until the agent hears its rank recovered."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    boost = max(-20, base - REPAIR_BOOST_NICE)
    if boost >= base or not may_return_to(boost):
        pytest.skip("may not lower niceness here (needs root or RLIMIT_NICE)")
    script = tmp_path / "job.py"
    script.write_text(
        "import sys, threading\nthreading.Thread(target=lambda: None).start()\n"
        "print('up', flush=True)\nsys.stdin.readline()\n"
    )
    pool = SparePool(sys.executable, lambda m: None, count=1, start_delay=0.0, fork=fork)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        _fill(pool, env)
        proc = pool.take(dict(env, RANK="2"), [str(script)], module=False)
        assert proc is not None

        def nices() -> set[int]:
            return {
                os.getpriority(os.PRIO_PROCESS, int(t))
                for t in os.listdir(f"/proc/{proc.pid}/task")
            }

        deadline = time.monotonic() + 30
        while nices() != {boost} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert nices() == {boost}
        pool.recovered(1, generation=1)  # another rank: no change
        assert nices() == {boost}
        pool.recovered(2, generation=1)
        assert nices() == {base}
    finally:
        pool.stop()


def _run_on_a_forked_spare(argv: list[str], setup=lambda pool: None) -> None:
    """Run `argv` (a script and its arguments) on a spare forked from a fork server, after
    `setup(pool)`, once the spare is prepared (ready: a spare assigned while it prepares stops
    preparing); it must exit 0."""
    pool = SparePool(sys.executable, lambda m: None, count=1, start_delay=0.0, fork=True)
    setup(pool)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        _fill(pool, env)
        deadline = time.monotonic() + 60
        while pool.ready_count() < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.ready_count() == 1
        proc = pool.take(env, argv, module=False)
        assert proc is not None and proc.wait(timeout=120) == 0
    finally:
        pool.stop()


SHARED_PAGES = r"""
import json, os, sys
page = os.sysconf("SC_PAGE_SIZE")
shared = 0
fd = os.open("/proc/self/pagemap", os.O_RDONLY)
for line in open("/proc/self/maps"):
    parts = line.split()
    if parts[1][:2] != "rw" or parts[1][3] != "p" or parts[-1] == "[vsyscall]":
        continue
    lo, hi = (int(x, 16) for x in parts[0].split("-"))
    raw = os.pread(fd, (hi - lo) // page * 8, lo // page * 8)
    for i in range(0, len(raw), 8):
        v = int.from_bytes(raw[i:i + 8], "little")
        if v >> 63 and not (v >> 56) & 1:  # present, not exclusively mapped: shared copy-on-write
            shared += 1
json.dump({"shared_bytes": shared * page}, open(sys.argv[1], "w"))
"""


def test_a_forked_spare_owns_its_pages_before_it_is_assigned(tmp_path) -> None:
    """Pages a forked spare still shared with the fork server cost the replacement a
    copy-on-write fault on its first write each (~15 ms of its start, inside the recovery)."""
    script = tmp_path / "job.py"
    script.write_text(SHARED_PAGES)
    out = tmp_path / "out.json"
    _run_on_a_forked_spare([str(script), str(out)])
    # a forked spare without own_pages() shares ~150-250 MB with its server
    assert json.loads(out.read_text())["shared_bytes"] < 8 << 20


def test_a_forked_spare_faults_in_the_heap_the_largest_state_needs(tmp_path) -> None:
    """Once a rank reported its state size, spares forked from then on grow and fault in that
    much heap while they wait, and tell their replacement (FTRUN_SPARE_HEAP) to settle it."""
    script = tmp_path / "job.py"
    out = tmp_path / "out.json"
    script.write_text(
        "import json, os, sys\n"
        f"json.dump({{'heap': os.environ.get('FTRUN_SPARE_HEAP')}}, open({str(out)!r}, 'w'))\n"
    )

    def sizes(pool: SparePool) -> None:
        pool.heap_needed(48 << 20)
        pool.heap_needed(16 << 20)  # the largest one counts

    _run_on_a_forked_spare([str(script)], sizes)
    assert int(json.loads(out.read_text())["heap"]) >= 48 << 20


def _recording_pool(records: list[tuple[str, str, dict]]) -> tuple[SparePool, dict[str, str]]:
    """A pool of 2 forked spares whose events land in `records`, and the env to fill it with."""
    pool = SparePool(
        sys.executable,
        lambda m: None,
        count=2,
        fork=True,
        record=lambda kind, msg, **f: records.append((kind, msg, f)),
    )
    return pool, dict(os.environ, PYTHONPATH=os.getcwd())


def test_the_pool_records_when_its_spares_are_ready(tmp_path) -> None:
    """Issue 32, item 2: `spare-ready` says how many spares are ready and how soon after the
    job's workers and the pool started; a spare taken makes its successor's readiness news."""
    records: list[tuple[str, str, dict]] = []
    pool, env = _recording_pool(records)
    pool.starting({0, 1}, time.monotonic() - 1.0)  # the workers started a second ago

    def all_ready() -> None:  # a forked spare is ready once it owns its pages
        _checks_until(pool, env, lambda: pool.ready_count() >= 2)
        pool.ensure(env)

    try:
        _fill(pool, env)
        all_ready()
        assert pool.ready_count() == 2 and pool.available()
        kind, msg, f = records[-1]
        assert kind == "spare-ready" and "2 of 2 warm spare(s) ready" in msg
        assert f["ready"] == 2 and f["count"] == 2
        assert f["since_job_s"] >= f["since_pool_s"] + 0.9 and f["since_pool_s"] > 0
        assert pool.readiness.first_ready_s is not None
        n = len(records)
        proc = pool.take(env, [sys.executable, "-c", "pass"], module=False)
        assert proc is not None
        all_ready()
        assert pool.ready_count() == 2 and len(records) == n + 1  # the successor's news
        proc.kill()
        proc.wait(timeout=30)
    finally:
        pool.stop()


def test_spare_ready_counts_fresh_spares_and_names_the_older_ones_serving(tmp_path) -> None:
    """Issue 32: when a rank's first step needs more heap than the idle spares prepared, fresh
    ones are forked while the thin ones serve; `spare-ready` said "3 of 2" and "5 of 2" then. The
    count is now of fresh spares (never more than asked for), the older ones named beside it,
    and the fresh ones' readiness is news even when the older ones leave at the same time."""
    records: list[tuple[str, str, dict]] = []
    pool, env = _recording_pool(records)

    def ready_until(done: Callable[[], bool]) -> None:
        assert _checks_until(pool, env, done)

    try:
        _fill(pool, env)
        ready_until(lambda: pool.ready_count() == 2)
        thin = {p.pid for p in pool._procs}
        # one fresh spare at a time: two forked within one check of the pool are both ready at
        # the next, the older ones retired there, and "1 of 2" is never seen (CI, stop 43)
        server = pool._server
        assert server is not None
        forks = {"open": 1}
        real_request = server.request_fork

        def gated_request(*args, **kwargs) -> None:
            if forks["open"] > 0:
                forks["open"] -= 1
                real_request(*args, **kwargs)

        server.request_fork = gated_request  # type: ignore[method-assign]
        pool.heap_needed(8 << 20)  # the first step's report: both idle spares are thin now
        ready_until(lambda: pool.ready_count() == 3)  # one fresh spare ready, the thin ones serve
        forks["open"] = 1
        ready_until(lambda: not thin & {p.pid for p in pool._procs})  # retired, fresh ready
        said = [(m, f) for k, m, f in records if k == "spare-ready"]
        counts = [int(m.split(" of ")[0]) for m, _ in said]
        assert max(counts) <= 2, said
        serving = [m for m, f in said if f["older"]]
        assert serving and "1 of 2 warm spare(s) ready" in serving[-1], said
        assert "(and 2 older one(s) serving until then)" in serving[-1], said
        assert all(f["ready"] == int(m.split(" of ")[0]) + f["older"] for m, f in said), said
        # the fresh ones took over: said, though fewer spares are ready than while the older
        # ones served (the news was missed: no record after "1 of 2 ... 2 older")
        pool.ensure(env)
        assert "2 of 2 warm spare(s) ready" in said[-1][0] and said[-1][1]["older"] == 0, said
    finally:
        pool.stop()


def test_a_spare_importing_torch_itself_is_ready_once_it_says_so(tmp_path) -> None:
    records: list[dict] = []
    pool = SparePool(
        sys.executable,
        lambda m: None,
        count=1,
        fork=False,
        record=lambda kind, msg, **f: records.append(f),
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        pool.ensure(env)
        assert pool.ready() == 1 and pool.ready_count() == 0  # still importing torch
        deadline = time.monotonic() + 120
        while pool.ready_count() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        pool.ensure(env)
        assert pool.ready_count() == 1 and records and records[-1]["ready"] == 1
    finally:
        pool.stop()


def test_no_warm_up_leaves_idle_priority_while_the_ranks_start() -> None:
    """Issue 32, item 2: the pool starts with the workers, but its imports take only idle CPU
    time until every rank committed its first step (the ranks' own start-up first); a cold
    replacement then hurries it (its import races the cold one's)."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if not may_return_to(base):
        pytest.skip("this user may not lower niceness: spares warm up at the agent's priority")
    pool = SparePool(sys.executable, lambda m: None, count=1, idle_limit=0.0, fork=True)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    pool.starting({0, 1}, time.monotonic())
    try:
        pool.ensure(env)
        server = pool._server
        assert server is not None
        deadline = time.monotonic() + 10  # the server lowers its own priority first thing
        while os.getpriority(os.PRIO_PROCESS, server.proc.pid) == base:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        pool.ensure(env)
        if not server.ready:  # still importing: at its warm-up priority while the ranks start
            assert os.getpriority(os.PRIO_PROCESS, server.proc.pid) > base
        pool.progressed(0, 0)
        pool.ensure(env)
        if not server.ready:
            assert os.getpriority(os.PRIO_PROCESS, server.proc.pid) > base  # rank 1 still starts
        pool.hold(1, {0})  # a round: no escalation ...
        pool.progressed(1, 0)
        pool.ensure(env)
        if not server.ready:
            assert os.getpriority(os.PRIO_PROCESS, server.proc.pid) > base
            pool.hurry()  # ... but for a cold replacement's race
            assert os.getpriority(os.PRIO_PROCESS, server.proc.pid) == base
    finally:
        pool.stop()


def test_the_fork_server_imports_the_jobs_modules_and_replaces_its_idle_spares(tmp_path) -> None:
    """Issue 32, item 4: the modules the ranks loaded (an `--imports` file) are imported in the
    server before it forks; a module that fails is one line and skipped; a list that grows
    later is imported by the running server, whose idle spares are then forked again."""
    from launcher.workers.spare_process import write_imports

    (tmp_path / "jobmod_first.py").write_text("X = 1\n")
    (tmp_path / "jobmod_later.py").write_text("Y = 2\n")
    (tmp_path / "jobmod_broken.py").write_text("raise ImportError('needs a GPU')\n")
    pool, logs, imports, env = _pool_with_imports(tmp_path, ["jobmod_first", "jobmod_broken"], 1)
    check = tmp_path / "check.py"
    check.write_text(
        "import sys\n"
        "open(sys.argv[1], 'w').write(' '.join(sorted(m for m in sys.modules "
        "if m.startswith('jobmod_'))))\n"
    )
    try:
        _fill(pool, env)
        pool.ensure(env)
        assert [ln for ln in logs if "jobmod_broken" in ln and "not imported" in ln]
        first = pool._procs[0].pid
        proc = pool.take(env, [str(check), str(tmp_path / "a")], module=False)
        assert proc is not None and proc.wait(timeout=60) == 0
        assert (tmp_path / "a").read_text() == "jobmod_first"  # imported before the fork
        _fill(pool, env)
        idle = pool._procs[0].pid
        assert idle != first
        write_imports(imports, ["jobmod_first", "jobmod_broken", "jobmod_later"], [str(tmp_path)])
        pool.extend_imports(imports)
        _checks_until(
            pool, env, lambda: pool._procs and pool._procs[0].pid != idle and pool.ready() >= 1
        )
        assert pool._procs and pool._procs[0].pid != idle  # the idle spare was forked again
        proc = pool.take(env, [str(check), str(tmp_path / "b")], module=False)
        assert proc is not None and proc.wait(timeout=60) == 0
        assert (tmp_path / "b").read_text() == "jobmod_first jobmod_later"
    finally:
        pool.stop()


def test_take_forks_a_spare_on_the_spot_even_while_a_round_holds_the_pool(tmp_path) -> None:
    """Issue 32: a replacement that finds no idle spare while the fork server is ready gets one
    forked now (`fork_now`), round or not: tens of milliseconds instead of a cold start."""
    script = tmp_path / "job.py"
    script.write_text("import sys\nopen(sys.argv[1], 'w').write('ran')\n")
    pool = SparePool(sys.executable, lambda m: None, count=1, fork=True)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        _fill(pool, env)
        first = pool.take(env, [str(script), str(tmp_path / "a")], module=False)
        assert first is not None and first.wait(timeout=60) == 0
        pool.hold(3, {1})
        assert pool.take(env, [str(script), str(tmp_path / "b")], module=False) is None
        assert pool.available()
        proc = pool.take(env, [str(script), str(tmp_path / "b")], module=False, fork_now=True)
        assert proc is not None and proc.wait(timeout=60) == 0
        assert (tmp_path / "b").read_text() == "ran"
        assert pool.ready() == 0  # nothing else forked while held
    finally:
        pool.stop()


def test_take_hands_out_a_spare_still_warming_up_before_it_forks_one(tmp_path) -> None:
    """Issue 32: a forked spare taken while it still prepares stops preparing (a few ms,
    `spare_server.own_pages(until)`), where a fork on the spot from the big fork server took
    66-300 ms on a busy node: the spare warming up takes the rank, nothing is forked."""
    script = tmp_path / "job.py"
    script.write_text("import sys\nopen(sys.argv[1], 'w').write('ran')\n")
    pool = SparePool(sys.executable, lambda m: None, count=1, fork=True)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        _fill(pool, env)
        warming = pool._procs[0]
        pool.readiness.forget(warming.pid)  # its ready byte not seen: still warming up
        proc = pool.take(env, [str(script), str(tmp_path / "a")], module=False, fork_now=True)
        assert proc is not None and proc.pid == warming.pid and pool._procs == []
        assert proc.wait(timeout=60) == 0 and (tmp_path / "a").read_text() == "ran"
    finally:
        pool.stop()


def _priority_while_importing(pool: SparePool, start) -> tuple[int, bool]:
    """Start the pool's fork server with `start()` and sample its priority until it is ready:
    (the highest niceness seen, whether it ever ran under another policy than SCHED_OTHER)."""
    import threading

    seen = {"nice": -21, "other": False}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            server = pool._server
            if server is not None and server.proc.poll() is None:
                try:
                    seen["nice"] = max(
                        seen["nice"], os.getpriority(os.PRIO_PROCESS, server.proc.pid)
                    )
                    policy = os.sched_getscheduler(server.proc.pid)
                    seen["other"] = seen["other"] or policy != os.SCHED_OTHER
                except OSError:
                    pass
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        start()
    finally:
        done.set()
        sampler.join()
    return int(seen["nice"]), bool(seen["other"])


def test_the_ranks_wait_for_a_fork_server_that_imports_at_the_agents_priority() -> None:
    """The node's ranks are forked from its fork server (`serve_ranks`, `fork_rank`): a server
    they wait for imports torch at the agent's priority, never at nice 10 / SCHED_IDLE (where a
    spare's server warms up, the control case below)."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    pool = SparePool(sys.executable, lambda m: None, count=1, fork=True)
    try:
        nice, other = _priority_while_importing(pool, lambda: pool.serve_ranks(env, 120))
        assert pool._server is not None and pool._server.ready
        assert (nice, other) == (base, False)
    finally:
        pool.stop()
    if not may_return_to(base):
        return  # spares warm up at the agent's priority too: no control case here
    pool = SparePool(sys.executable, lambda m: None, count=1, fork=True)
    try:
        nice, other = _priority_while_importing(pool, lambda: _fill(pool, env))
        assert nice > base and other  # the warm-up out of the way: what the ranks must not wait on
    finally:
        pool.stop()


def test_a_rank_forked_from_the_server_runs_with_its_environment_exactly(tmp_path) -> None:
    """`fork_rank`: a process forked now, the agent's own child, at the agent's priority, with
    the rank's environment and nothing else (no `exec` mark: a first start), not counted as a
    spare; its exit code is the script's."""
    script = tmp_path / "job.py"
    out = tmp_path / "out.json"
    script.write_text(
        "import json, os, sys\n"
        f"json.dump({{'env': dict(os.environ), 'ppid': os.getppid(),"
        f" 'nice': os.getpriority(os.PRIO_PROCESS, 0)}}, open({str(out)!r}, 'w'))\n"
        "sys.exit(7)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    logs: list[str] = []
    pool = SparePool(sys.executable, logs.append, count=1, fork=True)
    try:
        assert pool.fork_rank(env, [str(script)], module=False) is None  # no server yet
        assert pool.serve_ranks(env, 120) is None
        rank_env = dict(env, RANK="2", FTRUN_REPLACEMENT="0")
        proc = pool.fork_rank(rank_env, [str(script)], module=False)
        assert proc is not None and proc.wait(timeout=60) == 7
        res = json.loads(out.read_text())
        assert res["env"] == rank_env and "FTRUN_EXEC_TIME" not in res["env"]
        assert res["ppid"] == os.getpid() and res["nice"] == os.getpriority(os.PRIO_PROCESS, 0)
        assert pool.ready() == 0 and not [m for m in logs if "warm spare started" in m]
    finally:
        pool.stop()


def test_a_fork_server_the_ranks_cannot_have_is_said_and_given_up(tmp_path) -> None:
    """`serve_ranks` waits a bounded time: a server not ready in time is said (the ranks start
    cold, it goes on for the spares); one that died is given up (the spares import torch
    themselves), as `ensure` does."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    pool = SparePool(sys.executable, lambda m: None, count=1, fork=True)
    try:
        why = pool.serve_ranks(env, 0.01)
        assert why is not None and "not ready within 0.01 s" in why
        assert pool.fork and pool._server is not None and pool._server.alive()
    finally:
        pool.stop()
    dies = tmp_path / "python"
    dies.write_text("#!/bin/sh\nexit 3\n")
    dies.chmod(0o755)
    pool = SparePool(str(dies), lambda m: None, count=1, fork=True)
    try:
        t0 = time.monotonic()
        why = pool.serve_ranks(env, 60)  # a server that exits at once: seen at once
        assert why is not None and "unusable" in why and time.monotonic() - t0 < 5, why
        assert not pool.fork and pool._server is None
        assert pool.serve_ranks(env, 60) == "the spare fork server is off"
    finally:
        pool.stop()


def test_a_health_check_never_waits_for_the_fork_servers_fork(tmp_path) -> None:
    """Issue 32 (step 1): the agent's loop waited for each spare's fork (20-50 ms), so a worker
    that exited meanwhile was seen only after two forks. Now a check asks for one fork and
    returns at once; a later check adds the spare the server forked meanwhile."""
    logs: list[str] = []
    pool = SparePool(sys.executable, logs.append, count=2, fork=True)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        pool.ensure(env)
        server = pool._server
        assert server is not None and server.wait_ready(120)
        pool.ensure(env)  # the server is ready: one fork asked for, its answer not waited for
        assert server.pending is not None and pool.ready() == 0
        pool.ensure(env)  # still one request at a time
        assert server.pending is not None or pool.ready() == 1
        _fill(pool, env)
        assert server.pending is None or pool.ready() == 2
        assert len([ln for ln in logs if "warm spare started" in ln]) == 2
        script = tmp_path / "job.py"
        script.write_text("import sys\nopen(sys.argv[1], 'w').write('ran')\n")
        proc = pool.take(env, [str(script), str(tmp_path / "out")], module=False)
        assert proc is not None and proc.wait(timeout=60) == 0
        assert (tmp_path / "out").read_text() == "ran"
    finally:
        pool.stop()


def test_a_replacement_finding_no_idle_spare_gets_the_fork_already_asked_for(tmp_path) -> None:
    """A fork asked for at a health check and not yet read is the replacement's spare: no
    second fork, and the answer is never mistaken for a later request's."""
    script = tmp_path / "job.py"
    script.write_text("import sys\nopen(sys.argv[1], 'w').write('ran')\n")
    logs: list[str] = []
    pool = SparePool(sys.executable, logs.append, count=1, fork=True)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        pool.ensure(env)
        server = pool._server
        assert server is not None and server.wait_ready(120)
        pool.ensure(env)
        assert server.pending is not None and pool.ready() == 0
        proc = pool.take(env, [str(script), str(tmp_path / "a")], module=False, fork_now=True)
        assert proc is not None and proc.wait(timeout=60) == 0
        assert (tmp_path / "a").read_text() == "ran"
        assert server.pending is None
        assert len([ln for ln in logs if "warm spare started" in ln]) == 1
        _fill(pool, env)  # the next request and answer pair up
        proc = pool.take(env, [str(script), str(tmp_path / "b")], module=False)
        assert proc is not None and proc.wait(timeout=60) == 0
        assert (tmp_path / "b").read_text() == "ran"
    finally:
        pool.stop()


def test_a_forked_spare_prepares_at_the_warm_up_priority_and_runs_at_the_agents() -> None:
    """Issue 32 (step 1): a forked spare owned its pages and faulted its heap in (hundreds of
    MB) at the agent's priority, beside the ranks' first steps. It now does that at the warm-up
    priority (idle CPU time) and is back at the agent's before it takes a rank."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if not may_return_to(base) or not hasattr(os, "SCHED_IDLE"):
        pytest.skip("this user may not lower a process's niceness again")
    pool = SparePool(sys.executable, lambda m: None, count=1, fork=True, idle_limit=60.0)
    pool.heap_needed(512 << 20)  # a heap that takes a while to fault in
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        pool.ensure(env)
        assert pool._server is not None and pool._server.wait_ready(120)
        seen: set[tuple[int, int]] = set()
        deadline = time.monotonic() + 120
        while pool.ready_count() < 1 and time.monotonic() < deadline:
            pool.ensure(env)
            for proc in pool._procs:
                got = nice_and_policy(proc.pid)
                if got is not None:
                    seen.add(got)
            time.sleep(0.002)
        assert pool.ready_count() == 1
        assert (base + 10 if base + 10 <= 19 else 19, os.SCHED_IDLE) in seen, seen
        pid = pool._procs[0].pid
        assert nice_and_policy(pid) == (base, os.SCHED_OTHER)  # ready: the agent's again
    finally:
        pool.stop()


def test_a_round_stops_the_spares_still_preparing_until_its_hold_ends(tmp_path) -> None:
    """Issue 32: a spare importing (or faulting in its heap) when a round begins shares the
    node's CPUs with the state transfer and the redone step (successors forked just before a
    kill at step 1 made the transfer 0.07-0.16 s instead of ~0.02 s): it is stopped until the
    hold ends, and one taken for a rank meanwhile is continued first."""
    logs: list[str] = []
    pool = SparePool(sys.executable, logs.append, count=1, fork=False)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        pool.ensure(env)  # a spare importing torch itself: ~2 s of preparation
        (proc,) = pool._procs
        pool.hold(1, {0}, timeout=30)
        assert settles(proc.pid, stopped=True)
        assert logs[-1] == f"spare(s) still preparing paused for the round: pids [{proc.pid}]"
        pool.ensure(env)  # the round still runs: it stays stopped
        assert proc_state(proc.pid) == "T" and pool.ready_count() == 0
        pool.recovered(0, 1)  # the round is over
        pool.ensure(env)
        assert settles(proc.pid, stopped=False) and not pool.pause.paused
        assert f"go on, the round is over: pids [{proc.pid}]" in logs[-1]
        pool.hold(2, {0}, timeout=30)  # another round, and this spare is taken in it
        assert settles(proc.pid, stopped=True)
        out, job = tmp_path / "ran", tmp_path / "job.py"
        job.write_text(f"open({str(out)!r}, 'w').close()\n")
        taken = pool.take(env, [str(job)], module=False)
        assert taken is proc and taken.wait(timeout=120) == 0 and out.exists()
    finally:
        pool.stop()


def test_a_spare_forked_while_a_round_holds_the_pool_waits_for_its_end() -> None:
    """The fork asked for at the check before a kill is collected during the round: that spare
    would fault in its heap beside the state transfer; it is stopped until the hold ends. A
    cold replacement (`hurry`) continues it at once: it may overtake."""
    pool = SparePool(sys.executable, lambda m: None, count=2, fork=True)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        _fill(pool, env)
        _checks_until(pool, env, lambda: pool.ready_count() >= 2, 30)  # a round pauses neither
        pool._procs.pop().kill()  # one gone: the next check asks the server for a successor
        pool.ensure(env)
        assert pool._server is not None and pool._server.pending is not None
        pool.hold(3, {0}, timeout=30)
        _checks_until(pool, env, lambda: pool.ready() >= 2, 10)  # collects the fork in the round
        (new,) = pool.pause.paused
        assert settles(new, stopped=True)
        pool.hurry()
        assert settles(new, stopped=False) and not pool.pause.paused
        pool.recovered(0, 3)
        pool.ensure(env)
        assert pool.ready() == 2 and not pool.pause.paused
    finally:
        pool.stop()


def test_a_first_step_with_new_modules_and_heap_forks_each_spare_once(tmp_path) -> None:
    """Issue 32, item 2: the ranks' first step tells the pool both its heap and more modules.
    The fresh forks used to come first and were out of date as soon as the server had imported
    the modules: 4 forks preparing ~450 MB each instead of 2, steps 1 and 2 took 1.23 and 1.34 s
    instead of 0.36 s (fault-free, 4 ranks on 2 CPUs). With `count` ready spares serving, the
    server imports first; each spare is forked again once."""
    from launcher.workers.spare_process import write_imports

    (tmp_path / "jobmod_late.py").write_text("Z = 3\n")
    pool, logs, imports, env = _pool_with_imports(tmp_path, [], 2)
    try:
        _fill(pool, env)
        _checks_until(pool, env, lambda: pool.ready_count() >= 2, 30)
        before = {p.pid for p in pool._procs}
        write_imports(imports, ["jobmod_late"], [str(tmp_path)])
        pool.extend_imports(imports)  # the first step: more modules, and the heap it needed
        pool.heap_needed(8 << 20)
        logs.clear()
        _checks_until(
            pool, env, lambda: not {p.pid for p in pool._procs} & before and pool.ready_count() >= 2
        )
        forks = [ln for ln in logs if ln.startswith("warm spare started")]
        assert "imports the job's modules" in logs[0], logs
        assert len(forks) == 2 and all("prepares 8.4 MB of heap" in ln for ln in forks), logs
    finally:
        pool.stop()
