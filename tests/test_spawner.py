"""Starting workers: torchrun's environment plus FTRUN_*, per-generation logs, the reaper."""

from __future__ import annotations

import os
import queue
import signal

import pytest

from launcher.cli.ftrun import parse
from launcher.config import build_config
from launcher.observe.logs import AgentLog, RunLogDir
from launcher.workers.spawner import Spawner, WorkerWorld
from launcher.workers.workers import NodeWorkers, Reaper, WorkerExit, stop_workers


def test_environment_and_spawn(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("PYTHONFAULTHANDLER", raising=False)
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    script = tmp_path / "w.py"
    script.write_text("import os, sys\nsys.exit(int(os.environ['RANK']) + 10)\n")
    cfg = build_config(
        parse(["--nproc_per_node", "2", "--max_restarts", "2", "--warm_spares", "0", str(script)]),
        env={},
    )
    q: queue.Queue = queue.Queue()
    reaper = Reaper(q)
    spawned = []
    workers = NodeWorkers.create(4, 2)
    sp = Spawner(
        cfg,
        WorkerWorld(2, 3, 6, "127.0.0.1", 1234, "/tmp/x.sock"),
        RunLogDir.create(str(tmp_path / "logs"), "t"),
        AgentLog(0, None, quiet=True),
        "h",
        reaper,
        on_spawn=spawned.append,
    )
    try:
        w = workers.by_rank(5)
        assert w is not None
        w.generation = 3
        env = sp.env(w, replacement=True)
        assert {
            k: env[k]
            for k in (
                "RANK",
                "LOCAL_RANK",
                "WORLD_SIZE",
                "LOCAL_WORLD_SIZE",
                "GROUP_RANK",
                "GROUP_WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
                "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_MAX_RESTARTS",
            )
        } == {
            "RANK": "5",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "6",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "2",
            "GROUP_WORLD_SIZE": "3",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "1234",
            "TORCHELASTIC_RESTART_COUNT": "3",
            "TORCHELASTIC_MAX_RESTARTS": "2",
        }
        assert (
            env["FTRUN_AGENT_SOCKET"],
            env["FTRUN_GENERATION"],
            env["FTRUN_REPLACEMENT"],
            env["FTRUN_NODE_RANK"],
            env["OMP_NUM_THREADS"],
        ) == ("/tmp/x.sock", "3", "1", "2", "1")
        assert (
            env["PYTHONFAULTHANDLER"] == "1"
        )  # a hung unmodified worker dumps its stacks on SIGABRT
        monkeypatch.setenv("PYTHONFAULTHANDLER", "0")
        assert sp.env(w, replacement=False)["PYTHONFAULTHANDLER"] == "0"  # the user's choice wins
        assert env["THP_MEM_ALLOC_ENABLE"] == "1"  # huge pages: a killed rank is torn down sooner
        monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
        assert sp.env(w, replacement=False)["THP_MEM_ALLOC_ENABLE"] == "0"
        sp.spawn_all(workers.all(), 1)
        assert spawned == workers.all() and all(x.generation == 1 for x in workers.all())
        codes = sorted(
            ev.code for ev in (q.get(timeout=30), q.get(timeout=30)) if isinstance(ev, WorkerExit)
        )
        assert codes == [14, 15]
        assert workers.by_rank(4).error_file.endswith("attempt_1/0/error.json")
    finally:
        stop_workers(workers.all(), signal.SIGKILL, 0.0)
        reaper.stop()
        sp.stop()


def _kill_at_step(log_dir, rank: int, committed: int, timeout: float = 60.0, then=None) -> float:
    """SIGKILL `rank` once the agent's progress samples show it past step `committed` (the job
    runs with FTRUN_PROGRESS_INTERVAL=0.1), then call `then()`; the time of the kill."""
    import os
    import time

    from helpers_launch import events

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ev = events(str(log_dir)) if log_dir.exists() else []
        spawned = {e["rank"]: e["pid"] for e in ev if e["event"] == "spawn"}
        done = max(
            (
                p["committed_step"]
                for e in ev
                if e["event"] == "progress"
                for r, p in e["ranks"].items()
                if int(r) == rank
            ),
            default=-1,
        )
        if done >= committed:
            os.kill(spawned[rank], signal.SIGKILL)
            if then is not None:
                then()
            return time.time()
        time.sleep(0.02)
    raise AssertionError(f"rank {rank} never committed step {committed}")


def test_a_spare_ready_first_overtakes_a_cold_replacement(tmp_path) -> None:
    """Issue 32, item 3: a replacement that started cold (the fork server still importing) is
    overtaken by the spare that becomes ready while the cold one still imports: the spare takes
    the rank in the same round (one plan, no second fault), the cold process is killed and
    reaped. The knob: FTRUN_SPARE_IMPORTS names a module whose import takes seconds in a
    replacement and keeps the fork server (started with the workers) from being ready until 2 s
    after the kill (tests/scripts/slow_import.py)."""
    import os
    import subprocess

    from helpers_launch import FTRUN, env_with, events, script

    slow_log, gate = tmp_path / "imported", tmp_path / "killed"
    # exec: the ranks start cold, so the fork server is started at the first hello and kept
    # from being ready until after the kill (forked ranks would wait for it instead)
    env = env_with(
        FTRUN_WORKER_START="exec",
        FTRUN_SPARE_IMPORTS="slow_import",
        FTRUN_TEST_SLOW_IMPORT_GATE=str(gate),
        FTRUN_TEST_SLOW_IMPORT_S="2",
        FTRUN_TEST_SLOW_IMPORT_COLD_S="60",
        FTRUN_TEST_SLOW_IMPORT_LOG=str(slow_log),
        FTRUN_PROGRESS_INTERVAL="0.1",
        FTRUN_WARM_SPARES="1",
    )
    logs = tmp_path / "logs"
    cmd = FTRUN + [
        "--nproc_per_node",
        "2",
        "--max_restarts",
        "2",
        "--log_dir",
        str(logs),
        script("slow_import_train.py"),
        "--steps",
        "14",
        "--step-time",
        "0.15",
        "--out",
        str(tmp_path / "out{rank}.pt"),
    ]
    with open(tmp_path / "out.txt", "w+") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
        try:
            _kill_at_step(logs, 1, 1, then=gate.touch)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out.seek(0)
        text = out.read()
    assert proc.returncode == 0, text[-6000:]
    ev = events(str(logs))
    spawns = [e for e in ev if e["event"] == "spawn" and e["rank"] == 1]
    assert len(spawns) == 3, [e["message"] for e in spawns]  # first start, cold, the spare
    cold, warm = spawns[1], spawns[2]
    assert not cold.get("warm") and warm.get("warm") and warm["overtook"] == cold["pid"]
    assert "became ready first" in warm["message"] and cold["generation"] == warm["generation"]
    assert len([e for e in ev if e["event"] == "plan"]) == 1  # one round, no second fault
    assert not [
        e for e in ev if e["event"] in ("worker-failed", "fault") and e.get("pid") == cold["pid"]
    ]
    recovered = [e for e in ev if e["event"] == "rank-recovered" and e["rank"] == 1]
    assert len(recovered) == 1 and recovered[0]["replacement"]
    marks = recovered[0]["marks"]
    # the replacement's start-up split: its process began running the script at its assignment,
    # its imports were done when it called into the runtime (the slow module imported already)
    assert marks["exec"] <= marks["imported"] <= marks["status"] <= marks["repaired"]
    assert marks["imported"] - marks["exec"] < 2.0, marks
    # the cold process never reached the agent, and is gone: killed, reaped by the agent
    assert not [e for e in ev if e["event"] == "hello" and e["pid"] == cold["pid"]]
    assert str(cold["pid"]) not in slow_log.read_text().split()  # still in its slow import
    assert not os.path.exists(f"/proc/{cold['pid']}")
    assert [e for e in ev if e["event"] == "spare-ready"]


def _run_job(tmp_path, cmd_tail: list[str], env: dict, kill=None) -> tuple[int, str, list]:
    """Run ftrun (2 ranks, logs in tmp_path/logs) on `cmd_tail`; `kill(log_dir)` runs while it
    runs. (exit code, output, events)."""
    import subprocess

    from helpers_launch import FTRUN, events

    logs = tmp_path / "logs"
    cmd = FTRUN + ["--nproc_per_node", "2", "--max_restarts", "2", "--log_dir", str(logs)]
    with open(tmp_path / "out.txt", "w+") as out:
        proc = subprocess.Popen(
            cmd + cmd_tail, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path
        )
        try:
            if kill is not None:
                kill(logs)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out.seek(0)
        return proc.returncode, out.read(), events(str(logs))


def test_the_pool_starts_with_the_workers_and_a_kill_once_it_is_ready_is_warm(tmp_path) -> None:
    """Issue 32, items 2 and 4: for a script that names launcher.runtime the fork server starts
    right after the workers (before any rank said hello), `spare-ready` says when it was ready;
    the ranks' modules are learned when they join (the script's top-level imports: a kill at step
    1 must find them in the spares) and at their first step; a kill after that is repaired by a
    warm spare whose start-up split (exec -> imported) holds no imports."""
    import time

    from helpers_launch import env_with, events, script

    stop = tmp_path / "stop"

    def kill_when_ready(logs) -> None:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            ev = events(str(logs)) if logs.exists() else []
            if [e for e in ev if e["event"] == "spare-ready"]:
                break
            time.sleep(0.05)
        _kill_at_step(logs, 1, 1)
        while time.monotonic() < deadline:  # the job ends once the rank is back
            ev = events(str(logs))
            if [e for e in ev if e["event"] == "rank-recovered" and e["rank"] == 1]:
                break
            time.sleep(0.05)
        stop.touch()

    # "workers": on this 2-CPU box "auto" waits for the first hello (no CPU to spare beside the
    # ranks: test_the_pool_waits_for_a_hello_where_the_ranks_take_every_cpu)
    env = env_with(
        FTRUN_PROGRESS_INTERVAL="0.1", FTRUN_WARM_SPARES="1", FTRUN_SPARE_START="workers"
    )
    tail = [script("slow_import_train.py"), "--steps", "100000", "--step-time", "0.05"]
    tail += ["--stop-file", str(stop), "--out", str(tmp_path / "o{rank}.pt")]
    code, out, ev = _run_job(tmp_path, tail, env, kill_when_ready)
    assert code == 0, out[-6000:]
    started = next(e for e in ev if e["event"] == "spare" and "fork server started" in e["message"])
    first_hello = next(e for e in ev if e["event"] == "hello")
    assert started["time"] < first_hello["time"]  # with the workers, not at the first hello
    ready = next(e for e in ev if e["event"] == "spare-ready")
    assert ready["ready"] == 1 and ready["since_job_s"] >= ready["since_pool_s"] > 0
    learned = [e for e in ev if e["event"] == "spare-imports"]
    assert learned[0]["at"] == "start", learned  # told when the first rank joined
    assert learned[0]["new"] > 100  # torch's modules, the script's top-level imports
    warm = [e for e in ev if e["event"] == "spawn" and e["rank"] == 1 and e.get("replacement")]
    assert len(warm) == 1 and warm[0]["warm"], out[-4000:]
    (rec,) = [e for e in ev if e["event"] == "rank-recovered" and e["rank"] == 1]
    marks = rec["marks"]
    assert marks["exec"] <= marks["imported"] <= marks["status"] <= marks["repaired"]
    assert marks["imported"] - marks["exec"] < 1.0, marks  # nothing left to import


@pytest.mark.parametrize("start", ["exec", "auto"])
def test_an_unmodified_job_starts_no_spare(tmp_path, start: str) -> None:
    """Issue 32, item 2: a torchrun script that never uses the runtime pays nothing: no spare
    (the pool waits for a rank's hello, which never comes). Started cold (exec) there is no
    fork server either; by default (auto: the script imports torch) its ranks are forked from
    the node's fork server, which imported torch once for all of them, and no spare is kept."""
    from helpers_launch import env_with

    job = tmp_path / "plain.py"
    job.write_text(
        "import time, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.ones(1)\n"
        "dist.all_reduce(t)\n"
        "time.sleep(1.0)\n"
        "assert t.item() == 2\n"
        "dist.destroy_process_group()\n"
    )
    code, out, ev = _run_job(tmp_path, [str(job)], env_with(FTRUN_WORKER_START=start))
    assert code == 0, out[-4000:]
    spawns = [e for e in ev if e["event"] == "spawn"]
    assert len(spawns) == 2 and not [e for e in spawns if e["replacement"]]
    assert not [e for e in ev if e["event"] in ("spare-ready", "hello")]
    assert not [e for e in ev if e["event"] == "spare" and "warm spare started" in e["message"]]
    if start == "exec":
        assert not [e for e in ev if e["event"] == "spare"]
        assert not [e for e in spawns if e.get("forked")]
    else:
        assert all(e.get("forked") for e in spawns), [e["message"] for e in spawns]
        servers = [e for e in ev if e["event"] == "spare" and "fork server started" in e["message"]]
        assert len(servers) == 1


def test_the_pool_waits_for_a_hello_where_the_ranks_take_every_cpu() -> None:
    """FTRUN_SPARE_START=auto starts the pool with the workers only for a script that names the
    runtime on a node with a CPU beside its ranks; "workers" and "hello" are obeyed as said."""
    from launcher.workers.job_imports import node_cpus, starts_with_workers

    assert starts_with_workers("auto", True, cpus=192, local_ranks=8)
    assert not starts_with_workers("auto", True, cpus=2, local_ranks=2)
    assert not starts_with_workers("auto", True, cpus=2, local_ranks=4)
    assert not starts_with_workers("auto", False, cpus=192, local_ranks=8)
    assert starts_with_workers("workers", False, cpus=1, local_ranks=8)
    assert not starts_with_workers("hello", True, cpus=192, local_ranks=8)
    assert node_cpus() >= 1


def _probe_run(tmp_path, start: str, nproc: int = 2) -> tuple[int, str, list, dict, int]:
    """tests/scripts/start_probe.py under ftrun with FTRUN_WORKER_START=`start` and
    OMP_NUM_THREADS=3: (exit code, output, events, rank -> what the rank saw, ftrun's pid)."""
    import json
    import subprocess

    from helpers_launch import FTRUN, env_with, events, script

    out_dir, logs = tmp_path / start, tmp_path / f"logs-{start}"
    out_dir.mkdir()
    env = env_with(FTRUN_WORKER_START=start, OUT_DIR=str(out_dir), OMP_NUM_THREADS="3")
    cmd = FTRUN + ["--nproc_per_node", str(nproc), "--log_dir", str(logs)]
    cmd += [script("start_probe.py")]
    with open(tmp_path / f"out-{start}.txt", "w+") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
        try:
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out.seek(0)
        text = out.read()
    seen = {r: json.loads((out_dir / f"start.{r}.json").read_text()) for r in range(nproc)}
    return proc.returncode, text, events(str(logs)), seen, proc.pid


# what differs between two runs of one job whatever the start: the run, its store, its logs
_PER_RUN = (
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "FTRUN_RUN_ID",
    "FTRUN_LOG_DIR",
    "FTRUN_AGENT_SOCKET",
    "FTRUN_DEATH_NOTICE",
    "TORCHELASTIC_ERROR_FILE",
    "FTRUN_WORKER_START",
    "OUT_DIR",
)


def test_a_torch_job_starts_its_ranks_forked_from_one_fork_server(tmp_path) -> None:
    """FTRUN_WORKER_START=auto, a script that imports torch: the node's fork server starts first
    and every rank is forked from it (one `import torch` for the node): the `spawn` events say
    so, one server, the ranks are the agent's own children (it is a child subreaper), and each
    ends with what a cold rank has (exec, the control run): torch's thread count, the
    environment (os.environ, os.environb and getenv), faulthandler on, its own draws of torch's
    and numpy's generators, a fresh `__main__`, no exception being handled."""
    code, out, ev, forked, ftrun_pid = _probe_run(tmp_path, "auto")
    assert code == 0, out[-6000:]
    spawns = [e for e in ev if e["event"] == "spawn"]
    assert len(spawns) == 2 and all(e["forked"] and not e["replacement"] for e in spawns)
    assert {e["rank"]: e["pid"] for e in spawns} == {r: forked[r]["pid"] for r in (0, 1)}
    assert all("started from the node's fork server" in e["message"] for e in spawns)
    servers = [e for e in ev if e["event"] == "spare" and "fork server started" in e["message"]]
    assert len(servers) == 1 and "at the agent's priority" in servers[0]["message"]
    (start,) = [e for e in ev if e["event"] == "worker-start"]
    assert start["forked"] and start["wait_s"] > 0
    assert start["time"] < min(e["time"] for e in spawns)
    code, out, ev, cold, _ = _probe_run(tmp_path, "exec")
    assert code == 0, out[-6000:]
    spawns = [e for e in ev if e["event"] == "spawn"]
    assert len(spawns) == 2 and not [e for e in spawns if e.get("forked")]
    assert not [e for e in ev if e["event"] in ("spare", "worker-start")]
    for rank in (0, 1):
        f, c = forked[rank], cold[rank]
        assert f["ppid"] == ftrun_pid
        assert f["threads"] == c["threads"] and f["threads"] > 1
        assert f["blas_threads"] == c["blas_threads"] and f["tasks"] == c["tasks"]
        for key in ("env", "environb"):
            assert set(f[key]) == set(c[key]), set(f[key]) ^ set(c[key])
            differ = {k for k in f[key] if f[key][k] != c[key][k]} - set(_PER_RUN)
            assert differ == set(), {k: (f[key][k], c[key][k]) for k in differ}
        assert f["c_env"] == c["c_env"] and f["c_env"]["OMP_NUM_THREADS"] == "3"
        assert f["faulthandler"] and c["faulthandler"]
        for key in ("name", "handling", "sum"):
            assert f[key] == c[key], key
        assert f["argv"][1:] == c["argv"][1:] and f["path0"] == c["path0"]
    assert forked[0]["torch_draw"] != forked[1]["torch_draw"]  # not the server's generator
    assert forked[0]["numpy_draw"] != forked[1]["numpy_draw"]


def test_a_kill_at_step_1_of_a_forked_start_is_repaired_from_a_warm_spare(tmp_path) -> None:
    """The ranks of a runtime job were forked from the node's fork server, so the pool's spares
    are forks of it taken right after (on this 2-CPU box too, where a server started for the
    spares alone would wait for the first hello): a kill as soon as a rank committed step 1
    finds a warm spare, no cold replacement, one round, and the job finishes."""
    from helpers_launch import env_with, script

    env = env_with(FTRUN_PROGRESS_INTERVAL="0.1", FTRUN_WARM_SPARES="1")
    tail = [script("slow_import_train.py"), "--steps", "14", "--step-time", "0.15"]
    tail += ["--out", str(tmp_path / "o{rank}.pt")]
    code, out, ev = _run_job(tmp_path, tail, env, lambda logs: _kill_at_step(logs, 1, 1))
    assert code == 0, out[-6000:]
    first = [e for e in ev if e["event"] == "spawn" and not e["replacement"]]
    assert len(first) == 2 and all(e["forked"] for e in first)
    servers = [e for e in ev if e["event"] == "spare" and "fork server started" in e["message"]]
    assert len(servers) == 1
    again = [e for e in ev if e["event"] == "spawn" and e["replacement"]]
    assert len(again) == 1 and again[0]["warm"] and not again[0].get("overtook"), again
    assert "started from the warm spare" in again[0]["message"]
    assert len([e for e in ev if e["event"] == "plan"]) == 1
    (rec,) = [e for e in ev if e["event"] == "rank-recovered" and e["rank"] == 1]
    assert rec["marks"]["exec"] <= rec["marks"]["imported"] <= rec["marks"]["repaired"]


@pytest.mark.parametrize(
    "args, env, said",
    [
        (["--run_path"], {"FTRUN_WORKER_START": "fork"}, "cold start (--run-path)"),
        (["--redirects", "3"], {"FTRUN_WORKER_START": "fork"}, "--redirects, --tee or"),
        (["--tee", "0:1"], {"FTRUN_WORKER_START": "fork"}, "--redirects, --tee or"),
        (["--local_ranks_filter", "0"], {"FTRUN_WORKER_START": "fork"}, "--local-ranks-filter"),
        (["--warm_spares", "0"], {"FTRUN_WORKER_START": "fork"}, "no warm spares on this node"),
        ([], {"FTRUN_WORKER_START": "fork", "FTRUN_SPARE_FORK": "0"}, "fork server is off"),
        ([], {}, None),  # auto, a script that does not import torch: cold, nothing to say
        ([], {"FTRUN_WORKER_START": "exec"}, None),
        (["--redirects", "3"], {}, None),
    ],
)
def test_the_ranks_start_cold_where_a_spare_could_not_become_a_rank(
    tmp_path, args: list[str], env: dict, said: str | None
) -> None:
    """Only plain `python [-m] script` workers whose output is inherited, with warm spares and
    the fork server on, are forked (what a replacement from a spare needs too): else a cold
    start, said in one line where FTRUN_WORKER_START=fork asked for the fork."""
    script = tmp_path / "w.py"
    script.write_text("import sys\nsys.exit(0)\n")
    cfg = build_config(parse(["--nproc_per_node", "2", *args, str(script)]), env=env)
    q: queue.Queue = queue.Queue()
    reaper = Reaper(q)
    workers = NodeWorkers.create(0, 2)
    lines: list[tuple[str, str, dict]] = []

    class Log(AgentLog):
        def info(self, event: str, message: str, **fields) -> None:
            lines.append((event, message, fields))

        warning = info

    sp = Spawner(
        cfg,
        WorkerWorld(0, 1, 2, "127.0.0.1", 1234, str(tmp_path / "x.sock")),
        RunLogDir.create(str(tmp_path / "logs"), "t"),
        Log(0, None, quiet=True),
        "h",
        reaper,
        on_spawn=lambda w: None,
    )
    try:
        sp.spawn_all(workers.all(), 0)
        spawns = [f for e, _, f in lines if e == "spawn"]
        assert len(spawns) == 2 and not [f for f in spawns if f.get("forked")]
        starts = [m for e, m, _ in lines if e == "worker-start"]
        assert starts == ([] if said is None else [starts[0]]) and (
            said is None or said in starts[0]
        )
        assert sp.spares is None or sp.spares._server is None  # no fork server started for them
        for _ in range(2):
            assert isinstance(q.get(timeout=60), WorkerExit)
    finally:
        stop_workers(workers.all(), signal.SIGKILL, 0.0)
        reaper.stop()
        sp.stop()


def test_a_module_job_is_forked_as_python_m_would_run_it(tmp_path) -> None:
    """`ftrun -m module`: the ranks are forked from the fork server (the module's source, found
    from the working directory, imports torch) and run as `python -u -m module` would: its
    file as sys.argv[0], the working directory first on sys.path, `__main__`."""
    import json
    import shutil
    import subprocess

    from helpers_launch import FTRUN, env_with, events, script

    shutil.copy(script("start_probe.py"), tmp_path / "probe_mod.py")
    out_dir, logs = tmp_path / "out", tmp_path / "logs"
    out_dir.mkdir()
    cmd = FTRUN + ["--nproc_per_node", "2", "--log_dir", str(logs), "-m", "probe_mod", "x"]
    res = subprocess.run(
        cmd,
        env=env_with(OUT_DIR=str(out_dir)),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    spawns = [e for e in events(str(logs)) if e["event"] == "spawn"]
    assert len(spawns) == 2 and all(e["forked"] for e in spawns)
    for rank in (0, 1):
        seen = json.loads((out_dir / f"start.{rank}.json").read_text())
        assert seen["argv"] == [str(tmp_path / "probe_mod.py"), "x"]
        assert seen["path0"] == str(tmp_path) and seen["name"] == "__main__"


def test_the_fork_server_imports_the_scripts_leading_imports_once_for_the_node(tmp_path) -> None:
    """Issue 32, item 4: a third-party module the script imports first (megatron-core in a
    Megatron script) is imported by the node's fork server before it forks the ranks and the
    spares: the ranks inherit it (one import per node, not one per rank) and a replacement at
    step 1 finds it in its spare. The module below appends the pid of each process that runs its
    body to a file: only the fork server's may be there."""
    from helpers_launch import env_with

    site, job = tmp_path / "site", tmp_path / "job"
    site.mkdir()
    job.mkdir()
    marks = tmp_path / "imported_by.txt"
    (site / "leading_mod.py").write_text(
        "import os\n"
        "with open(os.environ['LEADING_MARKS'], 'a') as f:\n"
        "    f.write(f'{os.getpid()}\\n')\n"
    )
    (job / "train.py").write_text(
        "import leading_mod\n"
        "import torch\n"
        "import launcher.runtime as ftr\n"
        "\n"
        "rt = ftr.init(backend='gloo')\n"
        "model = torch.nn.Linear(4, 1)\n"
        "rt.register(model=model)\n"
        "for step in rt.steps(2):\n"
        "    with step:\n"
        "        model(torch.ones(2, 4)).sum().backward()\n"
        "        rt.allreduce_gradients(model)\n"
        "rt.finish()\n"
    )
    env = env_with(FTRUN_WARM_SPARES="1", LEADING_MARKS=str(marks))
    env["PYTHONPATH"] = str(site) + os.pathsep + env["PYTHONPATH"]
    code, out, ev = _run_job(tmp_path, [str(job / "train.py")], env)
    assert code == 0, out[-6000:]
    (told,) = [e for e in ev if e["event"] == "spare-imports" and e.get("at") == "script"]
    # the runtime too: its modules a job uses are reported like any library (the warm-up
    # imports its core only)
    assert told["new"] == 3 and "(leading_mod, torch, launcher.runtime)" in told["message"], told
    server = next(e for e in ev if e["event"] == "spare" and "fork server started" in e["message"])
    server_pid = int(server["message"].split("pid ", 1)[1].split(";")[0].split(")")[0])
    assert marks.read_text().split() == [str(server_pid)], out[-4000:]
    ranks = {e["rank"]: e for e in ev if e["event"] == "spawn"}
    assert sorted(ranks) == [0, 1] and "fork server" in ranks[0]["message"]


def test_spares_prepare_the_heap_a_rank_needed_not_only_its_state(tmp_path) -> None:
    """Issue 32: a rank's heap grows by more than its registered state (DDP's gradient buckets,
    a framework's buffers: here a 48 MB tensor beside a tiny model); the spares prepare what
    it needed in its first step, and one forked before that is known is forked again (a
    replacement's received state would land in fresh pages)."""
    import re
    import time

    from helpers_launch import env_with, events, script

    stop = tmp_path / "stop"
    sizes: list[float] = []

    def stop_once_prepared(logs) -> None:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not stop.exists():
            for e in events(str(logs)) if logs.exists() else []:
                m = re.search(r"prepares ([0-9.]+) MB of heap", e.get("message", ""))
                if e["event"] == "spare" and m:
                    sizes.append(float(m.group(1)))
            if any(s >= 48 for s in sizes):
                stop.touch()
            time.sleep(0.1)

    env = env_with(FTRUN_WARM_SPARES="1", FTRUN_SPARE_START="workers")
    tail = [script("slow_import_train.py"), "--steps", "100000", "--step-time", "0.05"]
    tail += ["--buffer-mb", "48", "--stop-file", str(stop), "--out", str(tmp_path / "o{rank}.pt")]
    code, out, ev = _run_job(tmp_path, tail, env, stop_once_prepared)
    assert code == 0, out[-6000:]
    assert any(s >= 48 for s in sizes), (sizes, out[-4000:])  # at least the buffer
    assert all(s < 200 for s in sizes), sizes  # what it needed, not everything it ever had
