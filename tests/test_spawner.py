"""Starting workers: torchrun's environment plus FTRUN_*, per-generation logs, the reaper."""

from __future__ import annotations

import queue
import signal

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
