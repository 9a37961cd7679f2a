#!/usr/bin/env python3
"""Benchmark: torch's libuv TCPStore server vs ftrun's store, direct and through node proxies.

Every scenario runs N clients (processes x threads, each thread one torch C++ `TCPStore`
client, `is_master=False`) doing the process-group init pattern:
  each rank sets its key, increments a counter, and waits for all (the last one sets a
  "everyone is in" key); rank 0 sets a unique id that every other rank gets; then a final
  counter barrier.
Backends, all in separate processes, measured in the same run:
  torch        - torch's own TCPStore master (libuv backend);
  ftrun        - ftrun's StoreServer (`python -m rendezvous.store_cli serve`);
  ftrun-proxy  - the same server behind StoreProxy instances (64 ranks per proxy), the proxies
                 hosted by a few "node" processes; the master sees one link per proxy.
Reported per scenario (one JSON line): connect time, pattern time, client ops/s, CPU seconds
of the master process during connect and pattern (and of the proxies), and ratios to torch.

Environment: torch's client resolves the reverse name of ::ffff:127.0.0.1; without an
/etc/hosts entry bursts of lookups stall 5-10 s here and both sides would measure the
resolver. The script checks for (and adds, when it may) the line
`::ffff:127.0.0.1 localhost-v4mapped` and says so on its first output line.

Environment switches (used by scripts/bench_multinode.py, which runs these pieces in network
namespaces): BENCH_STORE_HOST the address clients connect to, BENCH_STORE_BIND the address torch's
master binds, BENCH_STORE_UPSTREAM the address proxies forward to (all default 127.0.0.1).

Usage: python scripts/bench_store.py [--sizes 256,1024,4096] [--repeat 1] [--iterations 1]
       [--backends torch,ftrun,ftrun-proxy,ftrun@OLD_CHECKOUT,ftrun-proxy@OLD_CHECKOUT,ftrun%0]
       (NAME%N: that backend with FTRUN_STORE_NICE=N; NAME#LABEL: a second instance, e.g.
       torch#2, whose ratio to torch is the spread of the measurement itself)
With --repeat > 1 each contender's line also gives its ratio to torch round by round
(`pattern_vs_torch_by_round`) and how many rounds were at or below torch's time.
--iterations K (default 1) runs the pattern K times per run on the same connections, each time
with fresh keys: the first is `pattern_s` (a job's process-group init); the K-1 "warm" ones give
`warm_pattern_s_median` and the master's / proxies' / clients' CPU per warm pattern, and with
--repeat > 1 `warm_vs_torch_by_round` - one 40 ms pattern at 256 clients is mostly scheduling
noise, the median of many is not.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from hosts_setup import HOSTS_LINE, ensure_hosts_line  # noqa: E402  (scripts/ is sys.path[0])
PER_PROXY = 64

CLIENT = r'''
import os, resource, sys, threading, time
from datetime import timedelta
import torch.distributed as d
world, first, count = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
ports = [int(p) for p in sys.argv[4].split(",")]
per_port = int(sys.argv[5])
UID = bytes(range(128))
HOST = os.environ.get("BENCH_STORE_HOST", "127.0.0.1")
stores = [None] * count
errors = []
connected = threading.Barrier(count + 1)
start = threading.Barrier(count + 1)
finished = threading.Barrier(count + 1)
iteration = [0]  # the pattern's iteration (its keys' prefix); -1: exit
def pattern(s, r, j):
    p = f"{j}/" if j else ""
    s.set(f"{p}rank/{r}", b"10.0.0.1:%d" % (30000 + r))
    if s.add(f"{p}count", 1) == world:
        s.set(f"{p}all_in", b"1")
    s.wait([f"{p}all_in"])
    if r == 0:
        s.set(f"{p}uid", UID)
    elif s.get(f"{p}uid") != UID:
        errors.append(f"rank {r}: wrong uid")
    if s.add(f"{p}done", 1) == world:
        s.set(f"{p}all_done", b"1")
    s.wait([f"{p}all_done"])
def rank_main(i):
    r = first + i
    try:
        stores[i] = d.TCPStore(HOST, ports[r // per_port], is_master=False,
                               timeout=timedelta(seconds=300))
    except Exception as e:
        errors.append(f"connect {r}: {e}")
    connected.wait()
    while True:
        start.wait()
        if iteration[0] < 0:
            return
        try:
            if stores[i] is not None:
                pattern(stores[i], r, iteration[0])
        except Exception as e:
            errors.append(f"rank {r}: {e}")
        finished.wait()
threads = [threading.Thread(target=rank_main, args=(i,), daemon=True) for i in range(count)]
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
print("ready", flush=True)
assert sys.stdin.readline().strip() == "connect"
for t in threads:
    t.start()
connected.wait()
print("connected", time.time(), len(errors), cpu(), flush=True)
while True:  # "go [J]": run the pattern once (keys prefixed "J/" for J > 0); anything else: exit
    cmd = sys.stdin.readline().split()
    if not cmd or cmd[0] != "go":
        break
    iteration[0] = int(cmd[1]) if len(cmd) > 1 else 0
    before = len(errors)
    start.wait()
    finished.wait()
    print("done", time.time(), len(errors) - before, cpu(), flush=True)
if len(errors):
    print("ERR", errors[:3], file=sys.stderr, flush=True)
os._exit(0)
'''

TORCH_SERVER = r'''
import os, sys, time
import torch.distributed as d
s = d.TCPStore(os.environ.get("BENCH_STORE_BIND", "127.0.0.1"), 0, is_master=True, wait_for_workers=False, use_libuv=True)
print("port", s.port, flush=True)
sys.stdin.readline()
'''

PROXY_HOST = r'''
import os, sys
from rendezvous.proxy import StoreProxy
up_port, n = int(sys.argv[1]), int(sys.argv[2])
up = os.environ.get("BENCH_STORE_UPSTREAM", "127.0.0.1")
ps = [StoreProxy((up, up_port)).start() for _ in range(n)]
print("ports", ",".join(str(p.port) for p in ps), flush=True)
sys.stdin.readline()
for p in ps:
    p.stop()
'''




def env(repo: str = REPO, nice: str | None = None) -> dict[str, str]:
    e = dict(os.environ)
    if nice is not None:  # the loop threads' priority of this backend's server and proxies
        e["FTRUN_STORE_NICE"] = nice
    e["PYTHONPATH"] = repo + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = "1"
    e.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return e


def cpu_seconds(pid: int) -> float:
    """On-CPU time of every thread of `pid` (ns resolution from schedstat)."""
    total = 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(path) as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9


def spawn(code: str, *args: object, repo: str = REPO,
          nice: str | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=env(repo, nice),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, bufsize=1)


def client_phase(clients: list[subprocess.Popen], command: str,
                 reply: str) -> tuple[float, int, float]:
    """Tell every client process `command`, wait for each one's `reply` line
    (`reply <end time> <errors> <CPU seconds so far>`): (seconds from the command to the last
    end, errors, the client processes' CPU seconds so far)."""
    t0 = time.time()
    for c in clients:
        c.stdin.write(command + "\n")
        c.stdin.flush()
    ends = [read_line(c, reply) for c in clients]
    return (max(float(e[1]) for e in ends) - t0, sum(int(e[2]) for e in ends),
            sum(float(e[3]) for e in ends))


def read_line(p: subprocess.Popen, want: str, timeout: float = 300) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"process exited: {p.stderr.read()[-2000:]}")
        parts = line.split()
        if parts and parts[0] == want:
            return parts
    raise RuntimeError(f"timed out waiting for {want!r}")


def client_procs(n: int) -> int:
    """Client processes for n clients: 64 threads each, at least 2, at most 16."""
    return max(2, min(16, n // 64))


def interleaved(kinds: list[str], repeat: int):
    """Each of `kinds` `repeat` times, round by round, the order rotating each round, so drift
    of the shared machine hits every backend alike."""
    for i in range(repeat):
        yield from kinds[i % len(kinds):] + kinds[:i % len(kinds)]


def split_kind(kind: str) -> tuple[str, str, str | None]:
    """"ftrun-proxy%-5@/path/to/checkout" -> ("ftrun-proxy", that checkout, "-5"): no "@": this
    checkout; "%N": FTRUN_STORE_NICE=N for that backend's server and proxies (no "%": the
    environment's, i.e. ftrun's default). A "#LABEL" at the end names a second, independent
    instance of the same backend ("torch#2": another torch master, measured as a contender, so
    its ratio to "torch" is the benchmark's own run-to-run spread)."""
    kind = kind.partition("#")[0]
    rest, _, repo = kind.partition("@")
    base, _, nice = rest.partition("%")
    return base, os.path.abspath(repo) if repo else REPO, nice or None


def start_master(kind: str) -> tuple[subprocess.Popen, int]:
    kind, repo, nice = split_kind(kind)
    if kind == "torch":
        p = spawn(TORCH_SERVER)
        return p, int(read_line(p, "port")[1])
    p = subprocess.Popen([sys.executable, "-m", "rendezvous.store_cli", "serve", "--host",
                          "127.0.0.1", "--port", "0"], env=env(repo, nice), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    line = p.stdout.readline()
    if "listening on" not in line:
        raise RuntimeError(f"store_cli serve failed: {line} {p.stderr.read()[-2000:]}")
    return p, int(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            p.stdin.write("\n")
            p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.terminate()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def run_scenario(kind: str, n: int, procs: int, iterations: int = 1) -> dict:
    """One backend with n clients: connect, then the pattern `iterations` times on the same
    connections (the first is the process-group init as a job sees it; the later, "warm" ones
    repeat it with fresh keys and are far less noisy than one 40 ms pattern)."""
    master, mport = start_master(kind)
    helpers: list[subprocess.Popen] = []
    clients: list[subprocess.Popen] = []
    try:
        ports = [mport]
        per_port = n
        base, repo, nice = split_kind(kind)
        if base == "ftrun-proxy":
            nproxies = max(1, n // PER_PROXY)
            hosts = nproxies  # one proxy per process, as on real nodes
            ports = []
            for h in range(hosts):
                k = nproxies // hosts + (1 if h < nproxies % hosts else 0)
                p = spawn(PROXY_HOST, mport, k, repo=repo, nice=nice)
                helpers.append(p)
                ports += [int(x) for x in read_line(p, "ports")[1].split(",")]
            per_port = PER_PROXY
        per = n // procs
        for i in range(procs):
            clients.append(spawn(CLIENT, n, i * per, per, ",".join(map(str, ports)), per_port))
        for c in clients:
            read_line(c, "ready")
        cpu0 = cpu_seconds(master.pid)
        pcpu0 = sum(cpu_seconds(h.pid) for h in helpers)
        connect_s, errs, ccpu1 = client_phase(clients, "connect", "connected")
        cpu1 = cpu_seconds(master.pid)
        pcpu1 = sum(cpu_seconds(h.pid) for h in helpers)
        pattern_s, more, ccpu2 = client_phase(clients, "go", "done")
        errs += more
        cpu2 = cpu_seconds(master.pid)
        pcpu2 = sum(cpu_seconds(h.pid) for h in helpers)
        warm: list[float] = []
        for j in range(1, iterations):
            took, more, ccpu3 = client_phase(clients, f"go {j}", "done")
            warm.append(took)
            errs += more
        ops = 7 * n  # set, add, wait, (get = wait + get | set), add, wait per rank
        row = {
            "backend": kind, "clients": n, "client_procs": procs,
            "master_connections": n if base != "ftrun-proxy" else len(ports),
            "connect_s": round(connect_s, 4), "pattern_s": round(pattern_s, 4),
            "ops_per_s": round(ops / pattern_s), "master_cpu_connect_s": round(cpu1 - cpu0, 4),
            "master_cpu_pattern_s": round(cpu2 - cpu1, 4),
            "master_cpu_total_s": round(cpu2 - cpu0, 4),
            "proxy_cpu_pattern_s": round(pcpu2 - pcpu1, 4) if helpers else None,
            "client_cpu_pattern_s": round(ccpu2 - ccpu1, 4),
            "proxy_cpu_total_s": round(pcpu2 - pcpu0, 4) if helpers else None,
            "errors": errs,
        }
        if warm:  # per warm pattern: the median time, and the mean CPU of master/proxies/clients
            row["warm_patterns"] = len(warm)
            row["warm_pattern_s_median"] = round(statistics.median(warm), 4)
            row["warm_master_cpu_s"] = round((cpu_seconds(master.pid) - cpu2) / len(warm), 4)
            if helpers:
                row["warm_proxy_cpu_s"] = round(
                    (sum(cpu_seconds(h.pid) for h in helpers) - pcpu2) / len(warm), 4)
            row["warm_client_cpu_s"] = round((ccpu3 - ccpu2) / len(warm), 4)
        return row
    finally:
        for c in clients:
            stop(c)
        for h in helpers:
            stop(h)
        stop(master)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="256,1024,4096")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs per scenario, interleaved across the backends (round-robin, the "
                         "order rotating each round); the best is kept, the median reported too")
    ap.add_argument("--backends", default="torch,ftrun,ftrun-proxy",
                    help="comma-separated; NAME@PATH runs ftrun's server/proxies from the "
                         "checkout at PATH (e.g. ftrun@/work/main: a before/after in one run); "
                         "NAME%%N with FTRUN_STORE_NICE=N (e.g. ftrun%%0: the loop threads at "
                         "the inherited priority); NAME#LABEL a second instance "
                         "(torch#2: an A/A control)")
    ap.add_argument("--iterations", type=int, default=1,
                    help="patterns per run on the same connections: the first is reported as "
                         "pattern_s; with more, the warm ones' median too (warm_*), a measure "
                         "with far less noise than one pattern")
    a = ap.parse_args()
    try:
        sizes = [int(x) for x in a.sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 2:
        ap.exit(2, f"bench_store: --sizes {a.sizes!r}: comma-separated integers >= 2\n")
    if a.repeat < 1 or a.iterations < 1:
        ap.exit(2, f"bench_store: --repeat {a.repeat} / --iterations {a.iterations}: "
                   "each must be >= 1\n")
    kinds = list(dict.fromkeys(a.backends.split(",")))
    for kind in kinds:
        if split_kind(kind)[0] not in ("torch", "ftrun", "ftrun-proxy"):
            ap.exit(2, f"bench_store: backend {kind!r}: pick torch, ftrun or ftrun-proxy "
                       "(with @PATH, %N or #LABEL)\n")
    print(json.dumps({"setup": "/etc/hosts", "line": HOSTS_LINE,
                      "status": ensure_hosts_line(),
                      "note": "torch's client reverse-resolves ::ffff:127.0.0.1; the line "
                              "avoids resolver stalls for every backend"}), flush=True)
    for n in sizes:
        procs = client_procs(n)
        runs: dict[str, list[dict]] = {k: [] for k in kinds}
        for kind in interleaved(kinds, a.repeat):
            runs[kind].append(run_scenario(kind, n, procs, a.iterations))
        res = {}
        for kind in kinds:
            best = dict(min(runs[kind], key=lambda r: r["pattern_s"]))
            if a.repeat > 1:
                best["runs"] = a.repeat
                best["pattern_s_median"] = round(statistics.median(
                    r["pattern_s"] for r in runs[kind]), 4)
                best["master_cpu_pattern_s_median"] = round(statistics.median(
                    r["master_cpu_pattern_s"] for r in runs[kind]), 4)
                if a.iterations > 1:  # the runs' warm medians, their median
                    best["warm_pattern_s_median_of_runs"] = round(statistics.median(
                        r["warm_pattern_s_median"] for r in runs[kind]), 4)
            res[kind] = best
        base = res.get("torch")
        for kind, r in res.items():
            if base and kind != "torch":
                r["pattern_time_vs_torch"] = round(r["pattern_s"] / base["pattern_s"], 3)
                if "pattern_s_median" in r:
                    r["pattern_median_vs_torch"] = round(
                        r["pattern_s_median"] / base["pattern_s_median"], 3)
                if a.repeat > 1:  # round i against torch's round i (interleaved, same round)
                    by_round = [round(x["pattern_s"] / t["pattern_s"], 3)
                                for x, t in zip(runs[kind], runs["torch"])]
                    r["pattern_vs_torch_by_round"] = by_round
                    r["rounds_at_or_below_torch"] = sum(x <= 1.0 for x in by_round)
                    if a.iterations > 1:
                        warm = [round(x["warm_pattern_s_median"] / t["warm_pattern_s_median"], 3)
                                for x, t in zip(runs[kind], runs["torch"])]
                        r["warm_vs_torch_by_round"] = warm
                        r["warm_rounds_at_or_below_torch"] = sum(x <= 1.0 for x in warm)
                        r["warm_median_vs_torch"] = round(r["warm_pattern_s_median_of_runs"]
                                                          / base["warm_pattern_s_median_of_runs"], 3)
                elif a.iterations > 1:
                    r["warm_median_vs_torch"] = round(r["warm_pattern_s_median"]
                                                      / base["warm_pattern_s_median"], 3)
                r["connect_time_vs_torch"] = round(r["connect_s"] / base["connect_s"], 3)
                if r["master_cpu_total_s"] > 0:
                    r["master_cpu_reduction_vs_torch"] = round(
                        base["master_cpu_total_s"] / r["master_cpu_total_s"], 2)
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
