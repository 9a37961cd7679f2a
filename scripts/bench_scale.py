#!/usr/bin/env python3
"""Benchmark: ftrun's control plane from 16 to 16,384 ranks, by simulation, beside torch
elastic's c10d rendezvous in the same run.

ftrun's side runs the real control plane — the job's store server (its own process), one real
`StoreProxy` per node, every agent's real `Membership` (dynamic rendezvous, heartbeat liveness,
the checker, hot spares), the real plan and inject feeds, the agents' periodic progress and
status records, and the real `Controller` on the leader — with simulated nodes and ranks in this
process (`scale_nodes.SimNode`, `scale_ranks.SimRank`: TCPStore-wire clients that post status,
poll the repair plan and post resumed exactly as `launcher.runtime` does; no torch, no
training). torch's side: N `DynamicRendezvousHandler`s with the c10d backend (threads of one
process, each with its own `TCPStore` client) on a `TCPStore` master in a process of its own.

For each N (ranks; `--per-node` per node, 16 by default, 8 below 256 ranks) one JSON line:
  start     rendezvous of every node at once until every agent has its world (`rendezvous_s`),
            and until every rank has its world (`world_s`); torch: every `next_rendezvous()`
            returned (`torch.rendezvous_s`)
  steady    store requests/s and CPU/s of the store process, the proxies, the agents and the
            simulated ranks, at default settings (torch: its master's CPU/s with every
            handler's keep-alive running)
  kill      one rank SIGKILLed: death → plan published → every status collected (repair plan
            written) → every rank resumed; the round's store requests and bytes (server side,
            from the kernel's tcp_info) and the controller's, the store's and the proxies' CPU;
            `control_plane_path_s`: the legs only the store, the controller and the plan's
            fan-out make (fault posted → plan, the fan-out on the wire, the last node's status
            record → repair plan), the simulated agents' report and relay hop left out
  node      a hot spare waits, one node crashes (its agent, proxy and ranks): as above, with
            the time until the node is declared lost (bounded by the liveness timeout, 5 s)
  verdict   every rank in the same generation with the same repair plan

The simulation shares the machine: its own CPU (`sim_*`, `agents_*`) is reported beside the
control plane's (`store_*`, `proxies_*`, `controller_*`), and `control_plane_cpu_s` is what the
store, proxies and controller spent on the round: a bound on the round's control-plane time on
an idle machine where the wall times also hold the simulation's queueing. The simulated nodes
run `--sim-nice` (default 10) lower than the store, the leader's process (its agent, the
controller and its own ranks, alone in that process) and the fan-out probe, which stand in for
machines of their own (`scale_priority`); `sim_nice` and `priorities` (as read back) are in
every line.

`--plot DIR` writes one log-log PNG per metric against N (ftrun's and torch's lines).

Usage: python scripts/bench_scale.py [--ranks 16,64,256,1024] [--per-node 16] [--steady 5]
       [--scenarios start,steady,kill,node] [--no-torch] [--sim-procs K] [--sim-nice N]
       [--plot docs/img]
       [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [p for p in (HERE, REPO) if p not in sys.path]

from scale_job import ScaleJob  # noqa: E402
from scale_measure import process_cpu  # noqa: E402
from scale_priority import DEFAULT_SIM_NICE, check_sim_nice  # noqa: E402

from rendezvous.nodes.settings import RendezvousSettings  # noqa: E402

SCENARIOS = ("start", "steady", "kill", "node")
TORCH_KEEP_ALIVE_S = 5  # DynamicRendezvousHandler's default keep_alive_interval


def per_node_for(ranks: int, per_node: int | None) -> int:
    if per_node is not None:
        return per_node
    return 8 if ranks < 256 else 16


def liveness_for(ranks: int, timeout: float | None) -> RendezvousSettings:
    """ftrun's defaults (keep_alive_interval 1 s, so the steady state is the default one); the
    liveness timeout `timeout`, else 5 s (the default) below 4096 ranks and 30 s from there:
    thousands of simulated agents share this process's interpreter lock with thousands of
    polling ranks, and a beat held up for 5 s there is the simulation's, not the store's."""
    if timeout is None:
        timeout = 5.0 if ranks < 4096 else 30.0
    return RendezvousSettings(heartbeat_timeout=timeout)


def sim_procs_for(ranks: int, procs: int | None) -> int:
    """Processes the simulated nodes (the leader's aside) are split over: `procs`, else none
    (this process) up to 1024 ranks and one per 2048 ranks from there."""
    if procs is not None:
        return procs
    return 0 if ranks <= 1024 else -(-ranks // 2048)


def run_ftrun(ranks: int, per_node: int, args: argparse.Namespace) -> dict:
    rdzv = liveness_for(ranks, args.liveness_timeout)
    procs = sim_procs_for(ranks, args.sim_procs)
    job = ScaleJob(
        ranks,
        per_node,
        timeout=args.round_timeout,
        rdzv=rdzv,
        sim_procs=procs,
        sim_nice=args.sim_nice,
    )
    out: dict = {"ranks": ranks, "nodes": job.nnodes, "per_node": per_node}
    out["sim_nice"] = args.sim_nice
    out["liveness_timeout_s"] = rdzv.liveness_timeout
    steps = {
        "steady": lambda: job.steady(args.steady),
        "kill": job.kill_rank,
        "node": job.lose_node if job.nnodes > 1 else None,
    }
    try:
        out["start"] = job.start()
        out["priorities"] = job.priorities()
        for name, step in steps.items():
            if name in args.scenarios and step is not None:
                try:
                    out[name] = step()
                except TimeoutError as e:  # one line per N even when a round never ends
                    out[name] = {"error": str(e)}
                    break
        out["verdict"] = job.verdict()
    finally:
        job.stop()
    return out


def rendezvous_only(nodes: int, timeout: float = 900.0) -> dict:
    """ftrun's node rendezvous alone: `nodes` agents (real `Membership`s on the real store, no
    ranks, no proxies) join at once; the time until every one has its world."""
    from scale_measure import StoreHost
    from scale_nodes import SimNode
    from scale_ranks import RankLoop

    store, loop = StoreHost().start(), RankLoop()
    agents: list = []
    try:
        agents = [
            SimNode(("127.0.0.1", store.port), nodes, 16, f"rdzv{nodes}", loop)
            for _ in range(nodes)
        ]
        c0, t0 = store.stats(), time.time()
        with ThreadPoolExecutor(nodes) as pool:
            list(pool.map(lambda a: a.join(timeout), agents))
        c1 = store.stats()
        return {
            "rendezvous_s": round(max(a.joined_at for a in agents) - t0, 4),
            "store_requests": c1["requests"] - c0["requests"],
            "store_cpu_s": round(c1["cpu_s"] - c0["cpu_s"], 4),
        }
    finally:
        with ThreadPoolExecutor(max(1, len(agents))) as pool:
            list(pool.map(lambda a: a.stop(), agents))
        store.stop()


def fanout_only(nodes: int, carried: bool, runs: int = 3) -> dict:
    """The store's fan-out of a plan alone, no simulation: `nodes` connections (one per node,
    `scale_measure.ProbeProcess`) wait for the plan key, the benchmark writes a plan; the time
    from the write until the first and the last connection holds it, and the store's CPU, for
    `runs` plans. `carried`: FT_WAIT_VALUES (ftrun's agents); else WAIT then MULTI_GET."""
    from scale_measure import ProbeProcess, StoreHost

    from launcher.protocol import plan as P
    from rendezvous.store.client import StoreClient

    store = StoreHost().start()
    kv = StoreClient("127.0.0.1", store.port, timeout=60.0)
    first, last, cpu = [], [], []
    try:
        for g in range(1, runs + 1):
            probe = ProbeProcess(store.port, P.plan_key(g), nodes, carried)
            try:
                time.sleep(0.3)  # every wait registered
                plan = P.Plan(generation=g, strategy=P.RECOVER_IN_PLACE, failed_ranks=[g])
                c0, t0 = store.stats()["cpu_s"], time.time()
                kv.set(P.plan_key(g), plan.to_json())
                got = probe.result()
                cpu.append(store.stats()["cpu_s"] - c0)
            finally:
                probe.close()
            if got["nodes"] == nodes:
                first.append(got["first_wake"] - t0)
                last.append(got["last_value"] - t0)
    finally:
        kv.close()
        store.stop()
    return {
        "first_s": [round(x, 4) for x in first],
        "last_s": [round(x, 4) for x in last],
        "store_cpu_s": [round(x, 4) for x in cpu],
    }


# ---------------------------------------------------------------- torch elastic's c10d side

TORCH_MASTER = r"""
import sys
import torch.distributed as d
s = d.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
print("port", s.port, flush=True)
sys.stdin.readline()
"""


def start_torch_master():
    import subprocess

    p = subprocess.Popen(
        [sys.executable, "-c", TORCH_MASTER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
        env=dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR"),
    )
    line = p.stdout.readline()
    if not line.startswith("port "):
        raise RuntimeError(f"torch's TCPStore master did not start: {line!r}")
    return p, int(line.split()[1])


def run_torch(nodes: int, steady_s: float, timeout: float = 900.0) -> dict:
    """`nodes` DynamicRendezvousHandlers (c10d backend) rendezvous at once; then their
    keep-alives for `steady_s` s: the master's CPU/s."""
    import torch.distributed as d
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as DR
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )

    master, port = start_torch_master()
    run_id = f"scale{nodes}-{os.getpid()}"
    handlers: list = []
    lock = threading.Lock()

    def agent(i: int) -> float:
        store = d.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=timeout)
        )
        backend = C10dRendezvousBackend(store, run_id)
        h = DR.DynamicRendezvousHandler.from_backend(
            run_id,
            store,
            backend,
            min_nodes=nodes,
            max_nodes=nodes,
            local_addr="127.0.0.1",
            timeout=DR.RendezvousTimeout(join=dt.timedelta(seconds=timeout)),
        )
        with lock:
            handlers.append(h)
        h.next_rendezvous()
        return time.time()

    try:
        c0, t0 = process_cpu(master.pid), time.time()
        with ThreadPoolExecutor(nodes) as pool:
            done = list(pool.map(agent, range(nodes)))
        out = {
            "rendezvous_s": round(max(done) - t0, 4),
            "rendezvous_store_cpu_s": round(process_cpu(master.pid) - c0, 4),
        }
        if steady_s > 0:
            time.sleep(1.0)
            c0, t0 = process_cpu(master.pid), time.time()
            time.sleep(max(steady_s, TORCH_KEEP_ALIVE_S * 2 + 1))  # two keep-alives at least
            cpu = (process_cpu(master.pid) - c0) / (time.time() - t0)
            out["steady_store_cpu_per_s"] = round(cpu, 5)
        return out
    finally:
        for h in handlers:
            try:
                h.shutdown()
            except Exception:  # noqa: BLE001 - tearing down a benchmark's handlers
                pass
        master.stdin.write("\n")
        master.stdin.flush()
        master.wait(10)


# ---------------------------------------------------------------- the run


def fds_needed(ranks: int, per_node: int, procs: int = 0) -> int:
    """File descriptors the fullest process of the simulation holds for a job: both ends of
    every rank's connection to its proxy (a node's ranks and proxy live in one process), a few
    per agent; the nodes split over `procs` processes (0: all in this one)."""
    nodes = -(-(ranks // per_node) // max(1, procs))
    return 2 * nodes * per_node + 16 * nodes + 512


def raise_fd_limit() -> int:
    """The soft limit of open files up to the hard one; returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def one_line(ranks: int, args: argparse.Namespace) -> dict:
    per_node = per_node_for(ranks, args.per_node)
    procs = sim_procs_for(ranks, args.sim_procs)
    limit, need = raise_fd_limit(), fds_needed(ranks, per_node, procs)
    if need > limit:
        where = f"each of {procs} processes" if procs else "one process"
        return {
            "ranks": ranks,
            "per_node": per_node,
            "error": f"needs ~{need} open files in {where}, the hard limit is {limit} "
            "(--sim-procs: more processes)",
        }
    line = run_ftrun(ranks, per_node, args)
    if not args.no_torch:
        line["torch"] = run_torch(line["nodes"], args.steady if "steady" in args.scenarios else 0)
    line["load_1min"] = os.getloadavg()[0]
    return line


def saved_lines(path: str) -> list[dict]:
    """The per-N lines of `path` (earlier runs appended with --out), the last one per N, each
    scenario from the last line that ran it on the same nodes (a `--scenarios start,kill` run
    replaces the round, not the steady state of an earlier full run)."""
    by_n: dict[int, dict] = {}
    with open(path) as f:
        for text in f:
            line = json.loads(text)
            if "ranks" in line and "error" not in line:
                prev = by_n.get(line["ranks"], {})
                same = prev.get("nodes") == line.get("nodes")
                by_n[line["ranks"]] = {**prev, **line} if same else line
    return [by_n[n] for n in sorted(by_n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="16,64,256,1024,4096,16384")
    ap.add_argument("--per-node", type=int, default=None)
    ap.add_argument("--steady", type=float, default=5.0, help="s of steady state measured")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--round-timeout", type=float, default=300.0, help="s a round may take")
    ap.add_argument(
        "--liveness-timeout",
        type=float,
        default=None,
        help="s (default: 5, ftrun's, below 4096 ranks; 30 from there)",
    )
    ap.add_argument(
        "--sim-procs",
        type=int,
        default=None,
        help="processes the simulated nodes are split over, besides the leader's and the "
        "store's (default: none up to 1024 ranks, one per 2048 ranks above)",
    )
    ap.add_argument(
        "--sim-nice",
        type=int,
        default=DEFAULT_SIM_NICE,
        help="how much lower the simulated nodes' threads run than the store, the leader's "
        "process (agent, controller, its ranks) and the probe, which stand in for machines of "
        f"their own: 0 (the same priority) to 19 (default {DEFAULT_SIM_NICE})",
    )
    ap.add_argument("--plot", default=None, help="directory for the PNGs")
    ap.add_argument(
        "--out",
        default=None,
        help="also append the JSON lines to this file (--plot then draws every N in it)",
    )
    ap.add_argument(
        "--fanout-nodes",
        default="",
        help="also the store's fan-out of a plan alone to these node counts (e.g. 256,512): "
        "FT_WAIT_VALUES beside WAIT then MULTI_GET, no simulation",
    )
    ap.add_argument(
        "--rdzv-nodes",
        default="",
        help="also the node rendezvous alone at these node counts (e.g. 512), torch's beside",
    )
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.ranks.split(",") if x]
        args.scenarios = [s for s in args.scenarios.split(",") if s]
        bad = [s for s in args.scenarios if s not in SCENARIOS]
        extra = args.rdzv_nodes or args.fanout_nodes
        if bad or (not sizes and not extra) or min(sizes, default=1) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--ranks: comma-separated integers >= 1; --scenarios: of {','.join(SCENARIOS)}")
    if args.sim_procs is not None and args.sim_procs < 0:
        ap.error(f"--sim-procs: an integer >= 0 (0: this process), not {args.sim_procs}")
    try:
        check_sim_nice(args.sim_nice)
    except ValueError as e:
        ap.error(str(e))
    lines = []
    for n in sizes:
        line = one_line(n, args)
        lines.append(line)
        text = json.dumps(line, sort_keys=True)
        print(text, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text + "\n")
    for nodes in [int(x) for x in args.fanout_nodes.split(",") if x]:
        line = {
            "fanout_nodes": nodes,
            "carried": fanout_only(nodes, True),
            "wait_get": fanout_only(nodes, False),
            "load_1min": os.getloadavg()[0],
        }
        text = json.dumps(line, sort_keys=True)
        print(text, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text + "\n")
    for nodes in [int(x) for x in args.rdzv_nodes.split(",") if x]:
        line = {"rendezvous_nodes": nodes, "ftrun": rendezvous_only(nodes)}
        if not args.no_torch:
            line["torch"] = run_torch(nodes, 0)
        line["load_1min"] = os.getloadavg()[0]
        text = json.dumps(line, sort_keys=True)
        print(text, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text + "\n")
    if args.plot:
        from scale_plots import plot_all

        plot_all(saved_lines(args.out) if args.out else lines, args.plot)
    return 0 if all(ln.get("verdict", {}).get("consistent") for ln in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
