#!/usr/bin/env python3
"""Benchmark: ftrun vs torchrun on a real (network-namespace) cluster, in the same run.

Every host is a network namespace on one bridge (scripts/netns_cluster.py, names prefixed
"bm"); every host runs the same `--rdzv_backend c10d --rdzv_endpoint HOST0:PORT` command, one
worker per host, gloo over the veths. Workers: scripts/bench_recovery_worker.py (ftrun's runtime)
and scripts/bench_recovery_torchrun_worker.py (plain torch, checkpoint every 10 steps), a small
MLP with slowed steps. Scenarios (one JSON line each, `--scenarios` picks):

  worker-death  one worker on the last host is SIGKILLed. ftrun: time until its agent saw it
                (`worker-failed`) and until the controller on another node decided about it
                (`decide`; goal <= 50 ms). torchrun (`LOGLEVEL=INFO`): time until the victim's
                agent and until another node's agent react (their log lines, ms resolution).
                Both: time until every rank completed a step again, steps computed twice,
                survivors' processes kept or not.
  node-crash    every process of the last host is SIGKILLed (agent and workers: a node crash).
                ftrun: time until a survivor declares the node lost (`node-lost`; bound: the
                liveness timeout keep_alive_interval x keep_alive_max_attempt, 5 s by default),
                with the default and with a shorter `--rdzv-conf`. torchrun with the same
                `--rdzv-conf`: its first reaction on a survivor and what it was.
  node-crash-etcd  the same with `--rdzv_backend etcd` (ftrun only: torchrun's etcd backends
                need python-etcd and etcd's v2 API): etcd runs in one more host of its own,
                every training host is an etcd client; time until a survivor declares the node
                lost (its etcd lease expired: bound the lease TTL, 5 s by default, 2 s with the
                shorter `--rdzv-conf`).
  mttr          hosts-1 nodes train, the last host joins later as a hot spare; a training node
                (not the store host) crashes. Time from the crash until every rank completed a
                step again, steps computed twice, which strategy ran, survivors' processes kept
                or not. torchrun: `--max_restarts 3`, the spare waits in the redundancy list and
                the survivors restart all with it (restart-all from the checkpoint).
  store         the process-group-init store pattern of scripts/bench_store.py (set, add, wait,
                get, barrier) with clients spread over --store-hosts hosts against a master
                on host 0 over the links: torch's TCPStore (every client connects to it) vs
                ftrun's store behind one proxy per host (the master sees one link per host);
                wall time and the master's CPU time.

torchrun's agents get `--rdzv_conf is_host=true|false` (host 0 hosts the store): torch decides
by resolving the hostname, which every namespace shares; ftrun matches the endpoint against the
addresses of the namespace; and `--local_addr` (else the workers' MASTER_ADDR is the
hostname's, `localhost`). Times are wall-clock (every namespace shares the clock) from the
moment the benchmark sends the kill. Namespaces, links and processes are removed even on failure
or a signal; --keep-logs keeps the run directory (logs, events, step files) and prints its path.

Usage: python scripts/bench_multinode.py
       [--scenarios worker-death,node-crash,node-crash-etcd,mttr,store]
       [--hosts 3] [--store-hosts 4] [--store-sizes 256,1024] [--keep-logs]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import bench_store  # noqa: E402  (scripts/ is sys.path[0])
from hosts_setup import ensure_hosts_line  # noqa: E402
from netns_cluster import Cluster, Host, start_etcd, unavailable  # noqa: E402

from launcher.observe.logs import read_events  # noqa: E402  (the repo, not only an install)

SCENARIOS = ("worker-death", "node-crash", "node-crash-etcd", "mttr", "store")
ETCD_BIN = shutil.which("etcd") or "/usr/bin/etcd"
TOOLS = ("ftrun", "torchrun")
WORKERS = {
    "ftrun": os.path.join(REPO, "scripts", "bench_recovery_worker.py"),
    "torchrun": os.path.join(REPO, "scripts", "bench_recovery_torchrun_worker.py"),
}
LAUNCHERS = {
    "ftrun": [sys.executable, "-m", "launcher"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}
SHORT_CONF = "keep_alive_interval=1,keep_alive_max_attempt=2"
DEFAULT_LIVENESS = {"ftrun": 1.0 * 5, "torchrun": 5.0 * 3}  # interval x attempts, per tool
# torchrun's agent lines that mean "it reacted" (LOGLEVEL=INFO)
TORCH_REACTIONS = (
    "will restart worker group",
    "Worker group FAILED",
    "Worker group UNHEALTHY",
    "failed (exitcode",
    "Stopping worker group",
    "Detected",
    "Rendezvous'ing",
)
_TORCH_LOG = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+) +\d+ (\S+)\] (.*)$")


# ---------------------------------------------------------------- parsing and timing helpers
def liveness_of(tool: str, conf: str) -> float:
    """The liveness timeout `conf` (an --rdzv-conf string) gives `tool`: interval x attempts."""
    interval, attempts = {"ftrun": (1.0, 5), "torchrun": (5.0, 3)}[tool]
    for item in filter(None, conf.split(",")):
        key, _, value = item.partition("=")
        if key.strip() == "keep_alive_interval":
            interval = float(value)
        elif key.strip() == "keep_alive_max_attempt":
            attempts = int(value)
    return interval * attempts


def torch_log_time(line: str, year: int | None = None) -> float | None:
    """Epoch seconds of one torch (glog-style) log line, `W1126 06:25:41.818000 pid file:line]
    msg` (local time, no year: `year` or this year), or None for any other line."""
    m = _TORCH_LOG.match(line.strip())
    if not m:
        return None
    mon, day, hh, mm, ss, frac = m.groups()[:6]
    us = int(frac.ljust(6, "0")[:6])
    when = _dt.datetime(
        year or _dt.datetime.now().year, int(mon), int(day), int(hh), int(mm), int(ss), us
    )
    return when.timestamp()


def torch_log_lines(path: str) -> list[tuple[float, str]]:
    """(time, message) of every timestamped line of a torchrun log file, in file order."""
    out: list[tuple[float, str]] = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                t = torch_log_time(line)
                if t is not None:
                    out.append((t, line.strip().split("] ", 1)[-1]))
    except FileNotFoundError:
        pass
    return out


def first_reaction(
    lines: list[tuple[float, str]], since: float, needles: tuple[str, ...] = TORCH_REACTIONS
) -> tuple[float, str] | None:
    """The first (time, message) at or after `since` (log times have ms resolution: 1 ms
    slack) whose message contains one of `needles`."""
    for t, msg in lines:
        if t >= since - 0.001 and any(n in msg for n in needles):
            return t, msg
    return None


def first_event(events: list[dict], since: float, pred: Callable[[dict], bool]) -> dict | None:
    return next((e for e in events if e["time"] >= since and pred(e)), None)


def read_steps(out: str) -> dict[int, list[dict]]:
    """rank -> its completed steps ({"step", "time", "pid"}) from steps.<rank>.jsonl."""
    res: dict[int, list[dict]] = {}
    for path in glob.glob(os.path.join(out, "steps.*.jsonl")):
        rank = int(path.split(".")[-2])
        recs = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    recs.append(json.loads(line))
                except ValueError:  # a torn last line
                    pass
        res[rank] = recs
    return res


def recovery_summary(
    steps: dict[int, list[dict]], t_fault: float, world: int, lost_pids: set[int]
) -> dict:
    """What a fault at `t_fault` cost: time until every rank completed a step after it
    (resume_s), steps completed again (steps_lost: the most any rank recomputed), and whether
    the ranks that were not on the lost node kept their processes."""
    res: dict = {"resume_s": None, "steps_lost": None, "survivors_kept_pids": None}
    if len(steps) < world or any(not recs for recs in steps.values()):
        return res
    # a step the dying node logged in the instant of the kill is no progress
    after = [
        [r for r in recs if r["time"] > t_fault and r["pid"] not in lost_pids]
        for recs in steps.values()
    ]
    if all(after):
        res["resume_s"] = round(max(a[0]["time"] for a in after) - t_fault, 3)
    lost = 0
    for recs in steps.values():
        before = {r["step"] for r in recs if r["time"] <= t_fault}
        lost = max(
            lost,
            sum(
                1
                for r in recs
                if r["time"] > t_fault and r["step"] in before and r["pid"] not in lost_pids
            ),
        )
    res["steps_lost"] = lost
    kept = []
    for recs in steps.values():
        pre = [r["pid"] for r in recs if r["time"] <= t_fault]
        post = [r["pid"] for r in recs if r["time"] > t_fault]
        if pre and post and pre[-1] not in lost_pids:
            kept.append(post[0] == pre[-1])
    res["survivors_kept_pids"] = all(kept) if kept else None
    return res


def ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round((a - b) * 1000.0, 1)


# ---------------------------------------------------------------- jobs on the cluster
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return 20000 + s.getsockname()[1] % 20000


@dataclass
class Job:
    """One multi-node run of one tool: a launcher per host, a log per host, step files."""

    tool: str
    cluster: Cluster
    out: str
    nnodes: int
    conf: str = ""
    step_time: float = 0.05
    endpoint: str = ""  # c10d: host 0's address and a free port; etcd: the etcd endpoint
    backend: str = "c10d"
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        os.makedirs(self.out, exist_ok=True)
        if not self.endpoint:
            self.endpoint = f"{self.cluster.hosts[0].addr}:{free_port()}"

    def log_dir(self, h: Host) -> str:
        return os.path.join(self.out, f"log{h.index}")

    def stderr_path(self, h: Host) -> str:
        return os.path.join(self.out, f"stderr{h.index}.txt")

    def command(self, h: Host) -> list[str]:
        cmd = LAUNCHERS[self.tool] + [
            "--nnodes",
            str(self.nnodes),
            "--nproc_per_node",
            "1",
            "--rdzv_backend",
            self.backend,
            "--rdzv_endpoint",
            self.endpoint,
            "--rdzv_id",
            "bm",
            "--max_restarts",
            "3",
            "--monitor_interval",
            "0.1",
        ]
        conf = [self.conf] if self.conf else []
        if self.tool == "torchrun":
            # torch's is_host test resolves the hostname, which every namespace shares: say it
            conf.append(f"is_host={'true' if h.index == 0 else 'false'}")
        if conf:
            cmd += ["--rdzv_conf", ",".join(conf)]
        if self.tool == "torchrun":  # else rank 0's agent publishes getfqdn() ("localhost")
            cmd += ["--local_addr", h.addr]
        if self.tool == "ftrun" and self.backend == "c10d":
            cmd += ["--master_addr", self.cluster.hosts[0].addr]
        return cmd + [
            WORKERS[self.tool],
            "--steps",
            "100000",
            "--hidden",
            "64",
            "--layers",
            "3",
            "--checkpoint-dir",
            os.path.join(self.out, "ckpt"),
            "--checkpoint-every",
            "10",
            "--step-time",
            str(self.step_time),
        ]

    def start(self, h: Host) -> None:
        cmd = self.command(h)
        if self.tool == "ftrun":
            cmd[len(LAUNCHERS["ftrun"]) : len(LAUNCHERS["ftrun"])] = ["--log_dir", self.log_dir(h)]
        env = h.env(
            bench_store.env(), OUT_DIR=self.out, LOGLEVEL="INFO", TORCH_CPP_LOG_LEVEL="ERROR"
        )
        with open(self.stderr_path(h), "w") as err:
            self.procs[h.index] = h.popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)

    def events(self, h: Host) -> list[dict]:
        return read_events(self.log_dir(h)) if os.path.isdir(self.log_dir(h)) else []

    def torch_lines(self, h: Host) -> list[tuple[float, str]]:
        return torch_log_lines(self.stderr_path(h))

    def steps(self) -> dict[int, list[dict]]:
        return read_steps(self.out)

    def check_alive(self) -> None:
        for i, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(
                    f"{self.tool} on host {i} exited ({p.returncode}): "
                    f"{tail(self.stderr_path(self.cluster.hosts[i]))}"
                )

    def wait_training(self, world: int, min_steps: int = 5, timeout: float = 150.0) -> None:
        """Until every rank of `world` completed `min_steps` steps."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            steps = self.steps()
            if len(steps) >= world and all(len(s) >= min_steps for s in steps.values()):
                return
            self.check_alive()
            time.sleep(0.1)
        raise RuntimeError(
            f"{self.tool}: {world} ranks did not train within {timeout:g}s (logs in {self.out})"
        )


def tail(path: str, n: int = 600) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return " | ".join(f.read()[-n:].splitlines())
    except OSError:
        return "(no log)"


def poll(pred: Callable[[], object], timeout: float, interval: float = 0.02) -> object:
    """pred()'s first truthy value within `timeout` s, else None."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() >= deadline:
            return v or None
        time.sleep(interval)


_EXC = re.compile(r"^[\w.]*(Error|Exception): ")


def torch_outcome(path: str) -> str:
    """Where a torchrun agent got to: its last exception line when it raised one, else its
    last log message (e.g. still "Rendezvous'ing worker group")."""
    exc = None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if _EXC.match(line.strip()):
                    exc = line.strip()
    except OSError:
        return "(no log)"
    if exc:
        return exc[:200]
    lines = torch_log_lines(path)
    return lines[-1][1][:200] if lines else "(no log line)"


def crash(h: Host) -> tuple[float, set[int]]:
    """SIGKILL every process of host `h` (a node crash): (the time of the first kill, the pids)."""
    pids = set(h.pids())
    t0 = time.time()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return t0, pids


def ftrun_node_lost(job: Job, others: list[Host], t0: float, live: float) -> dict:
    """When a survivor declared the crashed node lost (`node-lost`) and the first reaction."""
    lost = poll(
        lambda: next(
            (
                e
                for h in others
                for e in job.events(h)
                if e["time"] >= t0 and e["event"] == "node-lost" and "lost_node" in e
            ),
            None,
        ),
        live + 5,
    )
    first = min(
        (
            e
            for h in others
            for e in job.events(h)
            if e["time"] >= t0 and e["event"] in ("worker-failed", "worker-fault", "node-lost")
        ),
        key=lambda e: e["time"],
        default=None,
    )
    return {
        "node_lost_s": round(lost["time"] - t0, 3) if lost else None,
        "within_liveness": bool(lost) and lost["time"] - t0 <= live,
        "node_lost_line": lost and lost["message"][:120],
        "first_reaction_s": round(first["time"] - t0, 3) if first else None,
        "first_reaction": first and first["event"],
    }


def rank_on(job: Job, h: Host) -> tuple[int, int]:
    """(rank, pid) of the worker living on host `h` (its latest step record)."""
    inside = set(h.pids())
    for rank, recs in sorted(job.steps().items()):
        if recs and recs[-1]["pid"] in inside:
            return rank, recs[-1]["pid"]
    raise RuntimeError(f"{job.tool}: no worker of host {h.index} found in the step files")


# ---------------------------------------------------------------- scenarios
class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.root = tempfile.mkdtemp(prefix="bench_multinode_")

    def job_dir(self, name: str) -> str:
        return os.path.join(self.root, name)

    # -- 1. worker death
    def worker_death(self, tool: str) -> dict:
        n = self.args.hosts
        with Cluster(n, prefix="bm") as c:
            job = Job(tool, c, self.job_dir(f"worker-death-{tool}"), nnodes=n)
            for h in c.hosts:
                job.start(h)
            job.wait_training(n)
            victim = c.hosts[-1]
            rank, pid = rank_on(job, victim)
            t0 = time.time()
            os.kill(pid, signal.SIGKILL)
            res: dict = {"victim_rank": rank, "victim_host": victim.index}
            if tool == "ftrun":
                others = [h for h in c.hosts if h is not victim]
                dec = poll(
                    lambda: next(
                        (
                            (h.index, e)
                            for h in others
                            for e in job.events(h)
                            if e["time"] >= t0 and e["event"] == "decide"
                        ),
                        None,
                    ),
                    15,
                )
                local = first_event(job.events(victim), t0, lambda e: e["event"] == "worker-failed")
                res["agent_detect_ms"] = ms(local and local["time"], t0)
                if dec:
                    res["controller_host"], ev = dec
                    res["controller_knows_ms"] = ms(ev["time"], t0)
                    res["strategy"] = ev.get("strategy")
                else:
                    res["controller_knows_ms"] = None
                res["goal_ms"] = 50
            else:
                local = poll(lambda: first_reaction(job.torch_lines(victim), t0), 15)
                others = [h for h in c.hosts if h is not victim]
                remote = poll(
                    lambda: min(
                        filter(None, (first_reaction(job.torch_lines(h), t0) for h in others)),
                        default=None,
                    ),
                    20,
                )
                res["agent_detect_ms"] = ms(local and local[0], t0)
                res["agent_line"] = local and local[1][:120]
                res["other_node_reacts_ms"] = ms(remote and remote[0], t0)
                res["other_node_line"] = remote and remote[1][:120]
            poll(lambda: recovery_summary(job.steps(), t0, n, {pid})["resume_s"], 40, 0.05)
            rec = recovery_summary(job.steps(), t0, n, {pid})
            res.update(
                {
                    "resume_s": rec["resume_s"],
                    "steps_lost": rec["steps_lost"],
                    "survivors_kept_pids": rec["survivors_kept_pids"],
                }
            )
            return res

    # -- 2. node crash
    def node_crash(self, tool: str, conf: str) -> dict:
        n = self.args.hosts
        live = liveness_of(tool, conf)
        with Cluster(n, prefix="bm") as c:
            job = Job(
                tool,
                c,
                self.job_dir(f"node-crash-{tool}-{'short' if conf else 'default'}"),
                nnodes=n,
                conf=conf,
            )
            for h in c.hosts:
                job.start(h)
            job.wait_training(n)
            victim, others = c.hosts[-1], c.hosts[:-1]
            t0, killed = crash(victim)
            res: dict = {
                "conf": conf or "(default)",
                "liveness_s": live,
                "killed_procs": len(killed),
            }
            if tool == "ftrun":
                res.update(ftrun_node_lost(job, others, t0, live))
            else:  # torchrun has no node-lost notice: what its survivors do, and when
                window = live + 5
                time.sleep(window)
                reacts = sorted(
                    filter(None, (first_reaction(job.torch_lines(h), t0) for h in others))
                )
                restarted = [
                    r
                    for h in others
                    for r in job.torch_lines(h)
                    if r[0] >= t0 and "Rendezvous'ing" in r[1]
                ]
                res["watched_s"] = window
                res["first_reaction_s"] = round(reacts[0][0] - t0, 3) if reacts else None
                res["first_reaction"] = reacts[0][1][:120] if reacts else None
                res["new_round_started"] = bool(restarted)
                steps = job.steps()
                res["training_resumed"] = all(
                    any(r["time"] > t0 + 0.5 for r in recs) for recs in steps.values()
                )
            return res

    # -- 2b. node crash, etcd backend
    def node_crash_etcd(self, conf: str) -> dict:
        """ftrun with --rdzv_backend etcd; etcd in host 0, the job on hosts 1..--hosts."""
        n = self.args.hosts
        live = liveness_of("ftrun", conf)
        name = f"node-crash-etcd-{'short' if conf else 'default'}"
        with (
            tempfile.TemporaryDirectory(prefix="bm-etcd-") as data,
            Cluster(n + 1, prefix="bm") as c,
        ):
            port = free_port()
            start_etcd(c.hosts[0], port, free_port(), os.path.join(data, "etcd"), ETCD_BIN)
            job = Job(
                "ftrun",
                c,
                self.job_dir(name),
                nnodes=n,
                conf=conf,
                backend="etcd",
                endpoint=f"{c.hosts[0].addr}:{port}",
            )
            train = c.hosts[1:]
            for h in train:
                job.start(h)
            job.wait_training(n)
            time.sleep(1.0)  # leases refreshed a few times in steady state
            victim, others = train[-1], train[:-1]
            t0, killed = crash(victim)
            res: dict = {
                "backend": "etcd",
                "conf": conf or "(default)",
                "lease_ttl_s": live,
                "killed_procs": len(killed),
            }
            res.update(ftrun_node_lost(job, others, t0, live))
            return res

    # -- 3. MTTR with a hot spare
    def mttr(self, tool: str) -> dict:
        n = self.args.hosts
        if n < 3:
            raise ValueError("mttr needs --hosts >= 3 (two training nodes and a spare)")
        world = n - 1
        with Cluster(n, prefix="bm") as c:
            job = Job(tool, c, self.job_dir(f"mttr-{tool}"), nnodes=world, conf=self.args.mttr_conf)
            for h in c.hosts[:world]:
                job.start(h)
            job.wait_training(world)
            spare = c.hosts[-1]
            job.start(spare)
            if tool == "ftrun":
                ok = poll(
                    lambda: first_event(job.events(spare), 0, lambda e: e["event"] == "hot-spare"),
                    60,
                )
                if not ok:
                    raise RuntimeError(
                        f"ftrun: the spare did not report as a hot spare "
                        f"({tail(job.stderr_path(spare))})"
                    )
            else:  # torchrun's late node: in the redundancy list once its agent is up
                time.sleep(5.0)
            job.check_alive()
            victim = c.hosts[world - 1]  # a training node, not the store host
            t0, lost_pids = crash(victim)
            res: dict = {
                "world": world,
                "spare_host": spare.index,
                "crashed_host": victim.index,
                "liveness_s": liveness_of(tool, self.args.mttr_conf),
            }
            survivors = [job.procs[h.index] for h in c.hosts if h is not victim]
            poll(
                lambda: (
                    recovery_summary(job.steps(), t0, world, lost_pids)["resume_s"]
                    or all(p.poll() is not None for p in survivors)
                ),
                self.args.mttr_timeout,
                0.1,
            )
            time.sleep(1.0)  # a few steps more: survivors' pids and the strategy settle
            res.update(recovery_summary(job.steps(), t0, world, lost_pids))
            if tool == "ftrun":
                evs = sorted(
                    (
                        e
                        for h in c.hosts
                        if h is not victim
                        for e in job.events(h)
                        if e["time"] >= t0
                    ),
                    key=lambda e: e["time"],
                )
                res["strategies"] = sorted(
                    {e["strategy"] for e in evs if e["event"] == "plan" and e.get("strategy")}
                )
                lost = next((e for e in evs if e["event"] == "node-lost"), None)
                took = next(
                    (e for e in evs if e["event"] in ("spare-takes-over", "node-joined")), None
                )
                res["node_lost_s"] = round(lost["time"] - t0, 3) if lost else None
                res["spare_took_over_s"] = round(took["time"] - t0, 3) if took else None
                res["spare_used"] = any(e["event"] == "spawn" for e in job.events(spare))
            else:
                res["strategies"] = ["restart-all"]
                res["spare_used"] = any(
                    r["pid"] in set(spare.pids()) for recs in job.steps().values() for r in recs
                )
                if res["resume_s"] is None:  # what its agents said last
                    res["waited_s"] = round(time.time() - t0, 1)
                    res["outcome"] = {
                        f"host{h.index}": torch_outcome(job.stderr_path(h))
                        for h in c.hosts
                        if h is not victim
                    }
            return res

    # -- 4. the store pattern over the links
    def store(self, backend: str, n: int) -> dict:
        k = self.args.store_hosts
        with Cluster(k, prefix="bm") as c:
            return store_run(c, backend, n)


def ns_spawn(h: Host, code: str, *args: object, **env: str) -> subprocess.Popen:
    return h.popen(
        [sys.executable, "-c", code, *map(str, args)],
        env=h.env(bench_store.env(), **env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
    )


def store_run(c: Cluster, backend: str, n: int) -> dict:
    """bench_store's pattern with n clients over c's hosts, the master on host 0."""
    h0 = c.hosts[0]
    if backend == "torch":
        master = ns_spawn(h0, bench_store.TORCH_SERVER, BENCH_STORE_BIND=h0.addr)
        mport = int(bench_store.read_line(master, "port")[1])
    elif backend == "ftrun-proxy":
        master = h0.popen(
            [
                sys.executable,
                "-m",
                "rendezvous.store.store_cli",
                "serve",
                "--host",
                h0.addr,
                "--port",
                "0",
            ],
            env=h0.env(bench_store.env()),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        line = master.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"store_cli serve failed: {line} {master.stderr.read()[-2000:]}")
        mport = int(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])
    else:
        raise ValueError(f"unknown store backend {backend!r} (torch, ftrun-proxy)")
    helpers: list[subprocess.Popen] = []
    clients: list[subprocess.Popen] = []
    try:
        per_host = n // len(c.hosts)
        procs_per_host = max(1, min(4, per_host // 64))
        per_proc = per_host // procs_per_host
        first = 0
        for h in c.hosts:
            if backend == "torch":
                host, port = h0.addr, mport
            else:  # one proxy per host, its workers connect over the host's loopback
                p = ns_spawn(h, bench_store.PROXY_HOST, mport, 1, BENCH_STORE_UPSTREAM=h0.addr)
                helpers.append(p)
                host, port = "127.0.0.1", int(bench_store.read_line(p, "ports")[1])
            for _ in range(procs_per_host):
                clients.append(
                    ns_spawn(
                        h, bench_store.CLIENT, n, first, per_proc, port, n, BENCH_STORE_HOST=host
                    )
                )
                first += per_proc
        if first != n:
            raise ValueError(f"{n} clients do not split evenly over {len(c.hosts)} hosts")
        for cl in clients:
            bench_store.read_line(cl, "ready")
        cpu0 = bench_store.cpu_seconds(master.pid)
        pcpu0 = sum(bench_store.cpu_seconds(p.pid) for p in helpers)
        connect_s, errors, _ = bench_store.client_phase(clients, "connect", "connected")
        cpu1 = bench_store.cpu_seconds(master.pid)
        pattern_s, more, _ = bench_store.client_phase(clients, "go", "done")
        errors += more
        cpu2 = bench_store.cpu_seconds(master.pid)
        pcpu2 = sum(bench_store.cpu_seconds(p.pid) for p in helpers)
        return {
            "backend": backend,
            "clients": n,
            "hosts": len(c.hosts),
            "master_connections": n if backend == "torch" else len(helpers),
            "connect_s": round(connect_s, 4),
            "pattern_s": round(pattern_s, 4),
            "master_cpu_connect_s": round(cpu1 - cpu0, 4),
            "master_cpu_pattern_s": round(cpu2 - cpu1, 4),
            "master_cpu_total_s": round(cpu2 - cpu0, 4),
            "proxy_cpu_total_s": round(pcpu2 - pcpu0, 4) if helpers else None,
            "errors": errors,
        }
    finally:
        for p in [*clients, *helpers, master]:
            bench_store.stop(p)


# ---------------------------------------------------------------- driver
def guarded(fn: Callable[[], dict]) -> dict:
    """fn()'s result, or {"error": one line} (the run goes on with the next measurement)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001  (reported in the JSON line, exit code 1 at the end)
        return {"error": f"{type(e).__name__}: {e}"[:500]}


def run_scenario(bench: Bench, name: str, tools: list[str]) -> dict:
    a = bench.args
    row: dict = {"bench": "multinode", "scenario": name}
    t = time.monotonic()
    if name == "worker-death":
        row["hosts"] = a.hosts
        for tool in tools:
            row[tool] = guarded(lambda: bench.worker_death(tool))
    elif name == "node-crash":
        row["hosts"] = a.hosts
        row["variants"] = []
        for conf in ("", SHORT_CONF):
            v: dict = {"conf": conf or "(default)"}
            for tool in tools:
                v[tool] = guarded(lambda: bench.node_crash(tool, conf))
            row["variants"].append(v)
    elif name == "node-crash-etcd":
        row["hosts"] = a.hosts
        row["variants"] = []
        for conf in ("", SHORT_CONF):
            v = {"conf": conf or "(default)"}
            if "ftrun" in tools:
                v["ftrun"] = guarded(lambda: bench.node_crash_etcd(conf))
            if "torchrun" in tools:
                v["torchrun"] = {
                    "not_measured": "torchrun's etcd and etcd-v2 backends need "
                    "python-etcd and etcd's v2 API"
                }
            row["variants"].append(v)
    elif name == "mttr":
        row["hosts"] = a.hosts
        for tool in tools:
            row[tool] = guarded(lambda: bench.mttr(tool))
        f, tr = row.get("ftrun", {}), row.get("torchrun", {})
        if f.get("resume_s") and tr.get("resume_s"):
            row["ratio_ftrun_vs_torchrun"] = round(f["resume_s"] / tr["resume_s"], 3)
    elif name == "store":
        row["hosts"] = a.store_hosts
        row["sizes"] = []
        for size in a.store_sizes:
            res = {b: guarded(lambda: bench.store(b, size)) for b in a.store_backends}
            base, px = res.get("torch", {}), res.get("ftrun-proxy", {})
            if base.get("pattern_s") and px.get("pattern_s"):
                px["pattern_time_vs_torch"] = round(px["pattern_s"] / base["pattern_s"], 3)
                if px.get("master_cpu_total_s"):
                    px["master_cpu_reduction_vs_torch"] = round(
                        base["master_cpu_total_s"] / px["master_cpu_total_s"], 2
                    )
            row["sizes"].append({"clients": size, **res})
    row["elapsed_s"] = round(time.monotonic() - t, 1)
    return row


def has_error(obj: object) -> bool:
    if isinstance(obj, dict):
        return "error" in obj or any(has_error(v) for v in obj.values())
    if isinstance(obj, list):
        return any(has_error(v) for v in obj)
    return False


def _csv(kind: Callable[[str], object], allowed: tuple[str, ...] | None = None):
    def parse(text: str) -> list:
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
        bad = [x for x in items if allowed is not None and x not in allowed]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"{text!r}: pick from {', '.join(allowed or ())}")
        return items

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", type=_csv(str, SCENARIOS), default=list(SCENARIOS))
    ap.add_argument("--tools", type=_csv(str, TOOLS), default=list(TOOLS))
    ap.add_argument("--hosts", type=int, default=3, help="hosts of the training scenarios")
    ap.add_argument("--store-hosts", type=int, default=4)
    ap.add_argument("--store-sizes", type=_csv(int), default=[256, 1024])
    ap.add_argument(
        "--store-backends",
        type=_csv(str, ("torch", "ftrun-proxy")),
        default=["torch", "ftrun-proxy"],
    )
    ap.add_argument(
        "--mttr-timeout",
        type=float,
        default=45.0,
        help="how long to wait for training to resume after the crash",
    )
    ap.add_argument(
        "--mttr-conf",
        default="",
        help="--rdzv_conf for both tools in mttr "
        f"(e.g. {SHORT_CONF}; default: each tool's defaults)",
    )
    ap.add_argument("--keep-logs", action="store_true")
    a = ap.parse_args(argv)
    if not 2 <= a.hosts <= 16 or not 1 <= a.store_hosts <= 16:
        ap.error("--hosts must be 2..16 and --store-hosts 1..16")
    if any(s % a.store_hosts for s in a.store_sizes):
        ap.error("--store-sizes must be multiples of --store-hosts")
    return a


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through every `with Cluster`: nothing left behind


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    why = unavailable()
    if why:
        print(f"bench_multinode: {why}", file=sys.stderr)
        return 2
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _raise_exit)
    bench = Bench(a)
    failed = False
    try:
        print(
            json.dumps(
                {"setup": "/etc/hosts", "status": ensure_hosts_line(), "run_dir": bench.root}
            ),
            flush=True,
        )
        for name in a.scenarios:
            row = run_scenario(bench, name, a.tools)
            failed |= has_error(row)
            print(json.dumps(row), flush=True)
    finally:
        if a.keep_logs:
            print(json.dumps({"logs": bench.root}), flush=True)
        else:
            shutil.rmtree(bench.root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
