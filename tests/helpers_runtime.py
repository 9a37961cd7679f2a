"""Test helpers for launcher.runtime: a minimal single-node supervisor and gloo worker pools.

`MiniJob` plays the agent + controller roles of the recovery protocol for runtime tests that
must not depend on the launcher: it hosts a real torch TCPStore, serves the agent unix socket
(hello / heartbeat / fault / stop), spawns real worker processes with ftrun's environment,
restarts only dead ranks as replacements, computes the RepairPlan with
`launcher.runtime.replicas.plan_repair`, and restarts everything when the plan falls back.
`run_workers` starts N plain processes that run a python snippet against a shared store.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from launcher import plan as P
from launcher.runtime.replicas import plan_repair

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "scripts" / "examples"


def base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTRUN_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def master_store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=60))


@dataclass
class Incarnation:
    rank: int
    generation: int
    replacement: bool
    proc: subprocess.Popen
    log: Path
    exitcode: int | None = None


@dataclass
class MiniJob:
    """Supervise `nprocs` workers of `script` on this host with process-level recovery."""

    script: Path
    args: list[str]
    nprocs: int
    workdir: Path
    fault_plan: list[dict] | None = None
    store_timeout: float = 60.0
    max_rounds: int = 6
    fallback: str | None = None  # force this fallback into the first repair plan (e.g. "dump")
    events: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.store = master_store()
        self._sockdir = tempfile.mkdtemp(prefix="ftrt", dir="/tmp")
        self.sock_path = os.path.join(self._sockdir, "agent.sock")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.sock_path)
        self._server.listen(64)
        self._lock = threading.Lock()
        self._conns: dict[int, socket.socket] = {}
        self._faults: list[dict] = []
        self.heartbeats: dict[int, dict] = {}
        self._threads: list[threading.Thread] = []
        self._closing = False
        self.generation = 0
        self.incarnations: list[Incarnation] = []
        self.live: dict[int, Incarnation] = {}
        t = threading.Thread(target=self._accept_loop, daemon=True)
        t.start()
        self._threads.append(t)

    # ---- agent socket ----------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            t = threading.Thread(target=self._conn_loop, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _conn_loop(self, conn: socket.socket) -> None:
        buf = b""
        rank = None
        while True:
            try:
                chunk = conn.recv(65536)
            except OSError:
                return
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line)
                with self._lock:
                    if msg["op"] == "hello":
                        rank = msg["rank"]
                        self._conns[rank] = conn
                        self.events.append(msg)
                    elif msg["op"] == "heartbeat":
                        self.heartbeats[msg["rank"]] = msg
                    elif msg["op"] == "fault":
                        self._faults.append(msg)
                        self.events.append(msg)
                    else:
                        self.events.append(msg)

    def send_stop(self, rank: int, generation: int) -> None:
        with self._lock:
            conn = self._conns.get(rank)
        if conn is not None:
            try:
                conn.sendall(json.dumps({"op": "stop", "generation": generation}).encode() + b"\n")
            except OSError:
                pass

    # ---- processes -------------------------------------------------------------------
    def spawn(self, rank: int, generation: int, replacement: bool) -> Incarnation:
        n = sum(1 for i in self.incarnations if i.rank == rank)
        log = self.workdir / f"rank{rank}.{n}.log"
        env = base_env({
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.nprocs),
            "LOCAL_WORLD_SIZE": str(self.nprocs), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.store.port), "TORCHELASTIC_RESTART_COUNT": "0",
            "FTRUN_AGENT_SOCKET": self.sock_path, "FTRUN_GENERATION": str(generation),
            "FTRUN_REPLACEMENT": "1" if replacement else "0", "FTRUN_RUN_ID": "minijob",
            "FTRUN_NODE_RANK": "0", "FTRUN_LOG_DIR": str(self.workdir),
            "FTRUN_STORE_TIMEOUT": str(self.store_timeout),
            "FTRUN_FAULT_PLAN": json.dumps(self.fault_plan or []),
        })
        with open(log, "wb") as f:
            proc = subprocess.Popen([sys.executable, str(self.script), *self.args], env=env,
                                    stdout=f, stderr=subprocess.STDOUT, cwd=self.workdir)
        inc = Incarnation(rank, generation, replacement, proc, log)
        self.incarnations.append(inc)
        self.live[rank] = inc
        return inc

    def pids(self, rank: int) -> list[int]:
        return [i.proc.pid for i in self.incarnations if i.rank == rank]

    def logs(self) -> str:
        return "\n".join(f"===== {i.log.name} (gen {i.generation}, exit {i.proc.poll()})\n"
                         + i.log.read_text(errors="replace") for i in self.incarnations)

    # ---- the supervisor/controller loop ----------------------------------------------
    def run(self, timeout: float = 120.0) -> int:
        """Run to completion; returns 0 when every rank finished with exit code 0."""
        for r in range(self.nprocs):
            self.spawn(r, 0, False)
        deadline = time.monotonic() + timeout
        round_open = False
        restart_all = False
        rounds = 0
        done: set[int] = set()
        try:
            while time.monotonic() < deadline:
                dead: list[int] = []
                for r, inc in list(self.live.items()):
                    code = inc.proc.poll()
                    if code is None:
                        continue
                    inc.exitcode = code
                    del self.live[r]
                    if code == 0:
                        done.add(r)
                    elif not restart_all:
                        dead.append(r)
                        self.events.append({"op": "exit", "rank": r, "code": code})
                with self._lock:
                    faults, self._faults = self._faults, []
                if restart_all:
                    if not self.live:
                        self.generation += 1
                        restart_all = False
                        done.clear()
                        for r in range(self.nprocs):
                            self.spawn(r, self.generation, False)
                elif dead or faults:
                    time.sleep(0.05)  # let simultaneous deaths show up in the same round
                    for r, inc in list(self.live.items()):
                        if inc.proc.poll() not in (None, 0):
                            inc.exitcode = inc.proc.poll()
                            del self.live[r]
                            dead.append(r)
                    rounds += 1
                    if rounds > self.max_rounds:
                        return 1
                    self.generation += 1
                    g = self.generation
                    self.events.append({"op": "round", "generation": g, "dead": sorted(dead),
                                        "faults": [f["rank"] for f in faults]})
                    for r in list(self.live):
                        self.send_stop(r, g)
                    for r in sorted(dead):
                        self.spawn(r, g, True)
                    round_open = True
                if round_open:
                    keys = [P.status_key(self.generation, r) for r in range(self.nprocs)]
                    if all(self.store.check([k]) for k in keys):
                        statuses = [P.RankStatus.from_json(self.store.get(k)) for k in keys]
                        rp = plan_repair(statuses, self.generation)
                        if self.fallback:
                            rp.fallback, rp.pairs, self.fallback = self.fallback, [], None
                        self.events.append({"op": "plan", **json.loads(rp.to_json())})
                        self.store.set(P.repair_key(self.generation), rp.to_json())
                        round_open = False
                        if rp.fallback:
                            restart_all = True
                if len(done) == self.nprocs and not self.live:
                    return 0
                time.sleep(0.01)
            return 124
        finally:
            self.stop_all()

    def stop_all(self) -> None:
        for inc in self.incarnations:
            if inc.proc.poll() is None:
                inc.proc.send_signal(signal.SIGKILL)
                inc.proc.wait(timeout=10)

    def close(self) -> None:
        self.stop_all()
        self._closing = True
        self._server.close()
        with self._lock:
            for c in self._conns.values():
                c.close()
        try:
            os.unlink(self.sock_path)
            os.rmdir(self._sockdir)
        except OSError:
            pass


def run_workers(code: str, nprocs: int, workdir: Path, store: dist.TCPStore,
                extra_env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Start `nprocs` python processes running `code` with RANK/WORLD_SIZE/MASTER_* set."""
    procs = []
    for r in range(nprocs):
        env = base_env({"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nprocs),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), **(extra_env or {})})
        log = open(workdir / f"worker{r}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, cwd=workdir))
        log.close()
    return procs


def worker_logs(workdir: Path, nprocs: int) -> str:
    return "\n".join(f"===== worker{r}\n" + (workdir / f"worker{r}.log").read_text(errors="replace")
                     for r in range(nprocs))


def load_params(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["params"]


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"parameter {k} differs"
