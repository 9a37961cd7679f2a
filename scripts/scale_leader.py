"""The leader node of scripts/bench_scale.py in a process of its own.

Owns: `RemoteNode` (the benchmark's handle on that process, with the calls `ScaleJob` makes on
a `SimNode`: `join`, `start`, `records`, `idle`, `plans_seen`, `stop`; and `cpu`) and
`serve` (the process's main: one `SimNode` with its own rank loop, driven by one command per
line on stdin, each answered by one JSON line). On a real cluster the controller runs in the
leader's agent process, beside nobody's simulation: here it does not share the interpreter lock
with the thousands of simulated agents and ranks, so its timings are its own and the store's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [p for p in (HERE, REPO) if p not in sys.path]

from scale_measure import thread_cpu  # noqa: E402
from scale_ranks import RankLoop, RankRecord  # noqa: E402

STATE_TTL = 0.005  # s a state answer is reused (the benchmark polls for a round's end)


class RemoteNode:
    """The benchmark's side (see the module docstring). `crashed` is always False: the leader
    node is never the one crashed."""

    crashed = False

    def __init__(self, store_port: int, nnodes: int, per_node: int, run_id: str, events: str,
                 rdzv: dict) -> None:  # fmt: skip
        conf = dict(store_port=store_port, nnodes=nnodes, per_node=per_node, run_id=run_id,
                    events=events, rdzv=rdzv)  # fmt: skip
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), json.dumps(conf)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self._lock = threading.Lock()
        self._state: dict = {}
        self._state_at = 0.0
        self.group_rank = -1
        self.joined_at = 0.0
        self._ask("hello")  # the process is up and joining (its arrival is recorded)

    def _ask(self, cmd: str, timeout: float = 600.0) -> dict:
        with self._lock:
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the leader process ended (exit {self.proc.poll()})")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"leader process: {out['error']}")
        return out

    def join(self, timeout: float = 600.0) -> None:
        out = self._ask("join", timeout)
        self.group_rank, self.joined_at = out["group_rank"], out["joined_at"]

    def start(self, replacement: bool = False) -> None:
        self._ask("start")

    def _fresh(self) -> dict:
        if time.monotonic() - self._state_at > STATE_TTL:
            self._state, self._state_at = self._ask("state"), time.monotonic()
        return self._state

    def records(self) -> list[RankRecord]:
        return [
            RankRecord(**dict(r, repair=r["repair"].encode("latin-1")))
            for r in self._fresh()["records"]
        ]

    def idle(self) -> bool:
        return bool(self._fresh()["idle"])

    @property
    def plans_seen(self) -> dict[int, float]:
        return {int(g): t for g, t in self._fresh()["plans_seen"].items()}

    def cpu(self) -> dict[str, float]:
        """On-CPU seconds of the leader process's threads by role (`scale_measure.ROLES`)."""
        return self._ask("cpu")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self._ask("stop", 30.0)
                self.proc.wait(30)
            except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


def _records(node) -> list[dict]:
    out = []
    for r in node.records():
        d = dataclasses.asdict(r)
        d["repair"] = d["repair"].decode("latin-1")
        out.append(d)
    return out


def serve(conf: dict) -> None:
    """The leader process's main (see the module docstring)."""
    from scale_nodes import SimNode

    from rendezvous.nodes.settings import RendezvousSettings

    loop = RankLoop().start()
    node = SimNode(
        ("127.0.0.1", conf["store_port"]),
        conf["nnodes"],
        conf["per_node"],
        conf["run_id"],
        loop,
        events_path=conf["events"],
        rdzv=RendezvousSettings(**conf["rdzv"]),
    )
    joined = threading.Thread(target=node.join, daemon=True)
    answers = {
        "hello": lambda: (joined.start(), {})[1],
        "join": lambda: (
            joined.join(),
            {"group_rank": node.group_rank, "joined_at": node.joined_at},
        )[1],  # noqa: E501
        "start": lambda: (node.start(), {})[1],
        "state": lambda: {
            "records": _records(node),
            "idle": node.idle(),
            "plans_seen": node.plans_seen,
        },  # fmt: skip
        "cpu": thread_cpu,
    }
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "stop":
            node.stop()
            loop.stop()
            print("{}", flush=True)
            return
        try:
            out = answers[cmd]()
        except Exception as e:  # noqa: BLE001 - told to the benchmark, which stops
            out = {"error": f"{cmd}: {type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
