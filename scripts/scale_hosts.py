"""Processes of scripts/bench_scale.py that host simulated nodes: the leader's, and the
simulation's own when it is split over several processes.

Owns: `NodeHost` (the benchmark's handle on one such process: `python scripts/scale_hosts.py
CONF`, one command per line on stdin, each answered by one JSON line), `HostedNode` (one node
of a host, with the calls `ScaleJob` makes on a `SimNode`: `summary`, `records`, `kill_rank`,
`crash`, `spare_waiting`, ...) and `serve` (the process's main: `count` `SimNode`s on their own
rank loop, every thread at the host's `nice`, `scale_priority`). The leader node runs alone in
its host at the inherited priority: on a real cluster the controller runs in the leader's agent
process, beside nobody's simulation, so its timings are its own and the store's. The other
nodes run at a lower priority (`--sim-nice`): they stand in for machines of their own, so they
take the cores the store, the leader and the probe leave. They are split over `--sim-procs`
hosts when one process cannot hold them (16,384 ranks need both ends of 16,384 connections:
more open files than one process may have here) or its interpreter lock is the bottleneck
(thousands of polling ranks and hundreds of agents' threads in one interpreter).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [p for p in (HERE, REPO) if p not in sys.path]

from bench_store import cpu_seconds as process_cpu  # noqa: E402
from scale_measure import RequestCounts, thread_cpu  # noqa: E402
from scale_priority import lower_thread_priority, process_nice  # noqa: E402
from scale_ranks import RankLoop, RankRecord  # noqa: E402

STATE_TTL = 0.005  # s a state answer is reused (the benchmark polls for a round's end)


class NodeHost:
    """One hosting process (see the module docstring). `join_start()`, `join_wait()`,
    `start_all()`, `stop()`."""

    def __init__(self, conf: dict, count: int, nice: int = 0) -> None:
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        conf = dict(conf, count=count, nice=nice)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), json.dumps(conf)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self._lock = threading.Lock()
        self._state: list[dict] = []
        self._state_at = 0.0
        self.nodes = [HostedNode(self, i, conf["per_node"]) for i in range(count)]
        self.ask("hello")  # the process is up (its imports done)

    def ask(self, cmd: str) -> dict:
        with self._lock:
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a node host ended (exit {self.proc.poll()})")
        out = json.loads(line)
        if isinstance(out, dict) and "error" in out:
            raise RuntimeError(f"node host: {out['error']}")
        return out

    def join_start(self) -> None:
        """Every hosted node starts its rendezvous (returns at once)."""
        self.ask("join_start")

    def join_wait(self) -> None:
        """Until every hosted node has its world."""
        for node, (rank, at) in zip(self.nodes, self.ask("join_wait")["joined"]):
            node.group_rank, node.joined_at = rank, at

    def start_all(self) -> None:
        self.ask("start")

    def state(self, fresh: bool = False) -> list[dict]:
        if fresh or time.monotonic() - self._state_at > STATE_TTL:
            self._state, self._state_at = self.ask("state")["nodes"], time.monotonic()
        return self._state

    def cpu(self) -> dict[str, float]:
        """On-CPU seconds of the process's threads by role (`scale_measure.ROLES`)."""
        return self.ask("cpu")

    def requests(self) -> dict[str, int]:
        """The hosted agents' store requests so far, by "source.op" (`RequestCounts`)."""
        return self.ask("requests")

    def process_cpu(self) -> float:
        return process_cpu(self.proc.pid)

    def nice(self) -> int:
        """The nice value the process runs at (its main thread's; its threads inherit it)."""
        return process_nice(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("stop")
                self.proc.wait(60)
            except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


class HostedNode:
    """Node `index` of `host`, as `ScaleJob` sees a node."""

    def __init__(self, host: NodeHost, index: int, per_node: int) -> None:
        self.host, self.index, self.per_node = host, index, per_node
        self.group_rank = -1
        self.joined_at = 0.0
        self.crashed = False

    @property
    def ranks(self) -> list[int]:
        base = self.group_rank * self.per_node
        return list(range(base, base + self.per_node))

    def summary(self) -> dict:
        return self.host.state()[self.index]

    @property
    def plans_seen(self) -> dict[int, float]:
        return {int(g): t for g, t in self.summary()["plans_seen"].items()}

    def records(self) -> list[RankRecord]:
        raw = self.host.ask(f"records {self.index}")["records"]
        return [RankRecord(**dict(r, repair=r["repair"].encode("latin-1"))) for r in raw]

    def kill_rank(self, rank: int) -> None:
        self.host.ask(f"kill {self.index} {rank}")

    def crash(self) -> None:
        self.crashed = True
        self.host.ask(f"crash {self.index}")

    def spare_waiting(self) -> bool:
        return bool(self.host.ask(f"spares {self.index}")["spares"])

    def idle(self) -> bool:
        return bool(self.summary()["idle"])

    def stop(self) -> None:
        pass  # the host stops its nodes (NodeHost.stop)


def _records(node) -> list[dict]:
    out = []
    for r in node.records():
        d = r.__dict__.copy()
        d["repair"] = d["repair"].decode("latin-1")
        out.append(d)
    return out


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _answers(nodes: list, joins: list[threading.Thread], counts: RequestCounts) -> dict:
    def join_start() -> dict:
        for n in nodes:
            t = threading.Thread(target=n.join, daemon=True)
            t.start()
            joins.append(t)
        return {}

    def join_wait() -> dict:
        for t in joins:
            t.join()
        return {"joined": [[n.group_rank, n.joined_at] for n in nodes]}

    def start() -> dict:
        for n in nodes:
            n.start()
        return {}

    return {
        "hello": lambda args: {},
        "join_start": lambda args: join_start(),
        "join_wait": lambda args: join_wait(),
        "start": lambda args: start(),
        "state": lambda args: {"nodes": [n.summary() for n in nodes]},
        "records": lambda args: {"records": _records(nodes[int(args[0])])},
        "kill": lambda args: (nodes[int(args[0])].kill_rank(int(args[1])), {})[1],
        "crash": lambda args: (nodes[int(args[0])].crash(), {})[1],
        "spares": lambda args: {"spares": nodes[int(args[0])].spare_waiting()},
        "cpu": lambda args: thread_cpu(),
        "requests": lambda args: counts.snapshot(),
    }


def serve(conf: dict) -> None:
    """A host process's main (see the module docstring)."""
    from scale_nodes import SimNode

    from rendezvous.nodes.settings import RendezvousSettings

    lower_thread_priority(conf.get("nice", 0))  # before any thread: they all inherit it
    _raise_fd_limit()
    threading.stack_size(512 * 1024)  # hundreds of agent threads in one process
    loop = RankLoop().start()
    rdzv = RendezvousSettings(**conf["rdzv"])
    store = ("127.0.0.1", conf["store_port"])
    counts = RequestCounts()
    nodes = [
        SimNode(
            store,
            conf["nnodes"],
            conf["per_node"],
            conf["run_id"],
            loop,
            events_path=conf["events"],
            rdzv=rdzv,
            counts=counts,
        )  # fmt: skip
        for _ in range(conf["count"])
    ]
    answers = _answers(nodes, [], counts)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "stop":
            with ThreadPoolExecutor(max(1, len(nodes))) as pool:
                list(pool.map(lambda n: n.stop(), nodes))
            loop.stop()
            print("{}", flush=True)
            return
        try:
            out = answers[cmd](args)
        except Exception as e:  # noqa: BLE001 - told to the benchmark, which stops
            out = {"error": f"{cmd}: {type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
