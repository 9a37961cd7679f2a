#!/usr/bin/env python3
"""Benchmark: torch's libuv TCPStore server vs ftrun's store, direct and through node proxies.

Every scenario runs N clients (processes x threads, each thread one torch C++ `TCPStore`
client, `is_master=False`) doing the process-group init pattern:
  each rank sets its key, increments a counter, and waits for all (the last one sets a
  "everyone is in" key); rank 0 sets a unique id that every other rank gets; then a final
  counter barrier.
Backends, all in separate processes, measured in the same run:
  torch        - torch's own TCPStore master (libuv backend);
  ftrun        - ftrun's StoreServer (`python -m rendezvous.store.store_cli serve`);
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
--iterations K (default 1) sets up every backend at once per round: each connects and runs its
first pattern (`pattern_s`, a job's process-group init), then the pattern K-1 more times on the
same connections with fresh keys, alternating between the backends pattern by pattern. The rows
get `warm_pattern_s_median`, the master's / proxies' / clients' CPU per warm pattern (the
store's also split into user and system time, `warm_*_user_s` / `warm_*_sys_s`, its total
`warm_store_cpu_s` and `warm_store_cpu_vs_torch`) and `warm_paired_vs_torch`: the median ratio
of each warm pattern to torch's next to it in time (with quartiles). A single 40 ms pattern at
256 clients is mostly the shared machine's noise
(torch against itself: 0.6-2.2x by round); paired, alternating patterns far less (0.94-1.06x).
Memory: all backends' client processes live at once (~16 per backend at 1024+ clients).
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

CLIENT = r"""
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
if errors:
    print("ERR", errors[:3], file=sys.stderr, flush=True)
os._exit(0)
"""

TORCH_SERVER = r"""
import os, sys, time
import torch.distributed as d
s = d.TCPStore(os.environ.get("BENCH_STORE_BIND", "127.0.0.1"), 0, is_master=True,
               wait_for_workers=False, use_libuv=True)
print("port", s.port, flush=True)
sys.stdin.readline()
"""

PROXY_HOST = r"""
import os, sys
from rendezvous.store.proxy import StoreProxy
up_port, n = int(sys.argv[1]), int(sys.argv[2])
up = os.environ.get("BENCH_STORE_UPSTREAM", "127.0.0.1")
ps = [StoreProxy((up, up_port)).start() for _ in range(n)]
print("ports", ",".join(str(p.port) for p in ps), flush=True)
sys.stdin.readline()
for p in ps:
    p.stop()
"""


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


CLK_TCK = os.sysconf("SC_CLK_TCK")


def user_sys_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process `pid` so far (its threads', also exited ones);
    kernel tick resolution, so meaningful summed over patterns, not for one short one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0


def spawn(code: str, *args: object, repo: str = REPO, nice: str | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        env=env(repo, nice),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
    )


def client_phase(
    clients: list[subprocess.Popen], command: str, reply: str
) -> tuple[float, int, float]:
    """Tell every client process `command`, wait for each one's `reply` line
    (`reply <end time> <errors> <CPU seconds so far>`): (seconds from the command to the last
    end, errors, the client processes' CPU seconds so far)."""
    t0 = time.time()
    for c in clients:
        c.stdin.write(command + "\n")
        c.stdin.flush()
    ends = [read_line(c, reply) for c in clients]
    return (
        max(float(e[1]) for e in ends) - t0,
        sum(int(e[2]) for e in ends),
        sum(float(e[3]) for e in ends),
    )


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


def parse_sizes(ap: argparse.ArgumentParser, prog: str, text: str) -> list[int]:
    """--sizes as a list of client counts, or a one-line error and exit 2."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 2:
        ap.exit(2, f"{prog}: --sizes {text!r}: comma-separated integers >= 2\n")
    return sizes


def client_procs(n: int) -> int:
    """Client processes for n clients: 64 threads each, at least 2, at most 16."""
    return max(2, min(16, n // 64))


def rotated(items: list, i: int) -> list:
    """`items` rotated left by i: round i's order, so no backend always goes first."""
    return items[i % len(items) :] + items[: i % len(items)]


def interleaved(kinds: list[str], repeat: int):
    """Each of `kinds` `repeat` times, round by round, the order rotating each round, so drift
    of the shared machine hits every backend alike."""
    for i in range(repeat):
        yield from rotated(kinds, i)


def split_kind(kind: str) -> tuple[str, str, str | None]:
    """ "ftrun-proxy%-5@/path/to/checkout" -> ("ftrun-proxy", that checkout, "-5"): no "@": this
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
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rendezvous.store.store_cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ],
        env=env(repo, nice),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
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


class Setup:
    """One backend's master (and proxies) with n client threads in `procs` processes, ready."""

    def __init__(self, kind: str, n: int, procs: int) -> None:
        self.kind, self.n, self.procs = kind, n, procs
        self.base = split_kind(kind)[0]
        self.helpers: list[subprocess.Popen] = []
        self.clients: list[subprocess.Popen] = []
        self.ccpu = 0.0  # the client processes' CPU seconds at the end of the last pattern
        self.master, mport = start_master(kind)
        try:
            self.ports, per_port = [mport], n
            if self.base == "ftrun-proxy":
                _, repo, nice = split_kind(kind)
                self.ports = []
                for _ in range(max(1, n // PER_PROXY)):  # one proxy per process, as on real nodes
                    p = spawn(PROXY_HOST, mport, 1, repo=repo, nice=nice)
                    self.helpers.append(p)
                    self.ports += [int(x) for x in read_line(p, "ports")[1].split(",")]
                per_port = PER_PROXY
            per = n // procs
            for i in range(procs):
                self.clients.append(
                    spawn(CLIENT, n, i * per, per, ",".join(map(str, self.ports)), per_port)
                )
            for c in self.clients:
                read_line(c, "ready")
        except BaseException:
            self.close()
            raise

    def cpu(self) -> tuple[float, float]:
        """(master, proxies) CPU seconds so far."""
        return cpu_seconds(self.master.pid), sum(cpu_seconds(h.pid) for h in self.helpers)

    def user_sys(self) -> tuple[float, float, float, float]:
        """(master user, master system, proxies' user, proxies' system) CPU seconds so far."""
        mu, ms = user_sys_seconds(self.master.pid)
        hs = [user_sys_seconds(h.pid) for h in self.helpers]
        return mu, ms, sum(h[0] for h in hs), sum(h[1] for h in hs)

    def first(self) -> dict:
        """Connect, then the pattern once (a job's process-group init): the scenario's row."""
        n = self.n
        cpu0, pcpu0 = self.cpu()
        connect_s, errs, ccpu1 = client_phase(self.clients, "connect", "connected")
        cpu1, pcpu1 = self.cpu()
        pattern_s, more, ccpu2 = client_phase(self.clients, "go", "done")
        cpu2, pcpu2 = self.cpu()
        ops = 7 * n  # set, add, wait, (get = wait + get | set), add, wait per rank
        self.ccpu = ccpu2
        return {
            "backend": self.kind,
            "clients": n,
            "client_procs": self.procs,
            "master_connections": n if self.base != "ftrun-proxy" else len(self.ports),
            "connect_s": round(connect_s, 4),
            "pattern_s": round(pattern_s, 4),
            "ops_per_s": round(ops / pattern_s),
            "master_cpu_connect_s": round(cpu1 - cpu0, 4),
            "master_cpu_pattern_s": round(cpu2 - cpu1, 4),
            "master_cpu_total_s": round(cpu2 - cpu0, 4),
            "proxy_cpu_pattern_s": round(pcpu2 - pcpu1, 4) if self.helpers else None,
            "client_cpu_pattern_s": round(ccpu2 - ccpu1, 4),
            "proxy_cpu_total_s": round(pcpu2 - pcpu0, 4) if self.helpers else None,
            "errors": errs + more,
        }

    def again(self, j: int) -> tuple[float, int, float, float, float, tuple]:
        """The pattern once more with fresh keys: (seconds, errors, master / proxies / clients
        CPU seconds, the master's and proxies' user / system CPU seconds as `user_sys`)."""
        cpu0, pcpu0 = self.cpu()
        us0 = self.user_sys()
        took, errs, ccpu = client_phase(self.clients, f"go {j}", "done")
        cpu1, pcpu1 = self.cpu()
        us1 = self.user_sys()
        used, self.ccpu = ccpu - self.ccpu, ccpu
        return (
            took,
            errs,
            cpu1 - cpu0,
            pcpu1 - pcpu0,
            used,
            tuple(b - a for a, b in zip(us0, us1)),
        )

    def close(self) -> None:
        for p in [*self.clients, *self.helpers, self.master]:
            stop(p)


def run_scenario(kind: str, n: int, procs: int) -> dict:
    """One backend alone: set up, connect, the pattern once, tear down."""
    setup = Setup(kind, n, procs)
    try:
        return setup.first()
    finally:
        setup.close()


def run_alternating(kinds: list[str], n: int, procs: int, iterations: int) -> dict[str, dict]:
    """Every backend of `kinds` set up at once; each connects and runs its first pattern (in
    `kinds`' order), then the pattern `iterations - 1` more times per backend, alternating
    between the backends pattern by pattern (the order rotating), so a slow second of the
    shared machine hits all alike. Each row gets its warm patterns' median time, the master's /
    proxies' / clients' CPU per warm pattern, and the warm times themselves."""
    setups: list[Setup] = []
    try:
        for kind in kinds:
            setups.append(Setup(kind, n, procs))
        rows = {s.kind: s.first() for s in setups}
        warm: dict[str, list[tuple]] = {k: [] for k in kinds}
        for j in range(1, iterations):
            for s in rotated(setups, j):
                warm[s.kind].append(s.again(j))
        for kind, ws in warm.items():
            row = rows[kind]
            row["errors"] += sum(w[1] for w in ws)
            row["warm_patterns"] = len(ws)
            row["warm_pattern_s"] = [round(w[0], 4) for w in ws]
            row["warm_pattern_s_median"] = round(statistics.median(w[0] for w in ws), 4)
            row["warm_master_cpu_s"] = round(sum(w[2] for w in ws) / len(ws), 4)
            if row["proxy_cpu_pattern_s"] is not None:
                row["warm_proxy_cpu_s"] = round(sum(w[3] for w in ws) / len(ws), 4)
            row["warm_client_cpu_s"] = round(sum(w[4] for w in ws) / len(ws), 4)
            # the store's CPU (master + proxies) per warm pattern, split into user and system
            # (kernel: the sockets' work, which every store serving these clients does)
            us = [sum(w[5][i] for w in ws) / len(ws) for i in range(4)]
            row["warm_master_user_s"], row["warm_master_sys_s"] = round(us[0], 4), round(us[1], 4)
            if row["proxy_cpu_pattern_s"] is not None:
                row["warm_proxy_user_s"] = round(us[2], 4)
                row["warm_proxy_sys_s"] = round(us[3], 4)
            row["warm_store_cpu_s"] = round(
                row["warm_master_cpu_s"] + row.get("warm_proxy_cpu_s", 0.0), 4
            )
        return rows
    finally:
        for s in setups:
            s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="256,1024,4096")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs per scenario, interleaved across the backends (round-robin, the "
        "order rotating each round); the best is kept, the median reported too",
    )
    ap.add_argument(
        "--backends",
        default="torch,ftrun,ftrun-proxy",
        help="comma-separated; NAME@PATH runs ftrun's server/proxies from the "
        "checkout at PATH (e.g. ftrun@../ftrun-old: a before/after in one run); "
        "NAME%%N with FTRUN_STORE_NICE=N (e.g. ftrun%%0: the loop threads at "
        "the inherited priority); NAME#LABEL a second instance "
        "(torch#2: an A/A control)",
    )
    ap.add_argument(
        "--iterations",
        type=int,
        default=1,
        help="patterns per backend and round: with more than 1, every backend is "
        "set up at once and, after each one's first pattern, their warm "
        "patterns alternate and are paired to torch's (warm_*)",
    )
    a = ap.parse_args()
    sizes = parse_sizes(ap, "bench_store", a.sizes)
    if a.repeat < 1 or a.iterations < 1:
        ap.exit(
            2,
            f"bench_store: --repeat {a.repeat} / --iterations {a.iterations}: each must be >= 1\n",
        )
    kinds = list(dict.fromkeys(a.backends.split(",")))
    for kind in kinds:
        if split_kind(kind)[0] not in ("torch", "ftrun", "ftrun-proxy"):
            ap.exit(
                2,
                f"bench_store: backend {kind!r}: pick torch, ftrun or ftrun-proxy "
                "(with @PATH, %N or #LABEL)\n",
            )
    print(
        json.dumps(
            {
                "setup": "/etc/hosts",
                "line": HOSTS_LINE,
                "status": ensure_hosts_line(),
                "note": "torch's client reverse-resolves ::ffff:127.0.0.1; the line "
                "avoids resolver stalls for every backend",
            }
        ),
        flush=True,
    )
    for n in sizes:
        procs = client_procs(n)
        runs: dict[str, list[dict]] = {k: [] for k in kinds}
        if a.iterations == 1:
            for kind in interleaved(kinds, a.repeat):
                runs[kind].append(run_scenario(kind, n, procs))
        else:
            for i in range(a.repeat):
                for kind, row in run_alternating(rotated(kinds, i), n, procs, a.iterations).items():
                    runs[kind].append(row)
        res = {}
        for kind in kinds:
            best = dict(min(runs[kind], key=lambda r: r["pattern_s"]))
            if a.repeat > 1:
                best["runs"] = a.repeat
                best["pattern_s_median"] = round(
                    statistics.median(r["pattern_s"] for r in runs[kind]), 4
                )
                best["master_cpu_pattern_s_median"] = round(
                    statistics.median(r["master_cpu_pattern_s"] for r in runs[kind]), 4
                )
                if a.iterations > 1:  # the runs' warm medians, their median
                    best["warm_pattern_s_median_of_runs"] = round(
                        statistics.median(r["warm_pattern_s_median"] for r in runs[kind]), 4
                    )
            res[kind] = best
        base = res.get("torch")
        for kind, r in res.items():
            if base and kind != "torch":
                r["pattern_time_vs_torch"] = round(r["pattern_s"] / base["pattern_s"], 3)
                if "pattern_s_median" in r:
                    r["pattern_median_vs_torch"] = round(
                        r["pattern_s_median"] / base["pattern_s_median"], 3
                    )
                if a.repeat > 1:  # round i against torch's round i (interleaved, same round)
                    by_round = [
                        round(x["pattern_s"] / t["pattern_s"], 3)
                        for x, t in zip(runs[kind], runs["torch"])
                    ]
                    r["pattern_vs_torch_by_round"] = by_round
                    r["rounds_at_or_below_torch"] = sum(x <= 1.0 for x in by_round)
                    if a.iterations > 1:
                        warm = [
                            round(x["warm_pattern_s_median"] / t["warm_pattern_s_median"], 3)
                            for x, t in zip(runs[kind], runs["torch"])
                        ]
                        r["warm_vs_torch_by_round"] = warm
                        r["warm_rounds_at_or_below_torch"] = sum(x <= 1.0 for x in warm)
                        r["warm_median_vs_torch"] = round(
                            r["warm_pattern_s_median_of_runs"]
                            / base["warm_pattern_s_median_of_runs"],
                            3,
                        )
                elif a.iterations > 1:
                    r["warm_median_vs_torch"] = round(
                        r["warm_pattern_s_median"] / base["warm_pattern_s_median"], 3
                    )
                if a.iterations > 1:  # each warm pattern against torch's next to it in time
                    paired = [
                        x / t
                        for xr, tr in zip(runs[kind], runs["torch"])
                        for x, t in zip(xr["warm_pattern_s"], tr["warm_pattern_s"])
                    ]
                    r["warm_paired_vs_torch"] = round(statistics.median(paired), 3)
                    q = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
                    r["warm_paired_vs_torch_quartiles"] = [round(q[0], 3), round(q[2], 3)]
                    if base["warm_store_cpu_s"] > 0:  # master (+ proxies) CPU per pattern
                        r["warm_store_cpu_vs_torch"] = round(
                            r["warm_store_cpu_s"] / base["warm_store_cpu_s"], 3
                        )
                r["connect_time_vs_torch"] = round(r["connect_s"] / base["connect_s"], 3)
                if r["master_cpu_total_s"] > 0:
                    r["master_cpu_reduction_vs_torch"] = round(
                        base["master_cpu_total_s"] / r["master_cpu_total_s"], 2
                    )
            r.pop("warm_pattern_s", None)  # every warm time: in the pairing above, not printed
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
