#!/usr/bin/env python3
"""Benchmark: ftrun vs torchrun on the same script, in the same run.

Measures (medians over --repeat runs each):
  launch_s   time from starting the launcher to every worker's process group being ready,
  recover_s  time from a worker crash (rank 1 exits 1) to every worker of the next attempt ready,
  detect_ms  ftrun only: time from the worker's exit to the agent noticing it (events.jsonl).
Prints one JSON line. Sets up the /etc/hosts line `::ffff:127.0.0.1 localhost-v4mapped` first.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hosts_setup import ensure_hosts_line  # noqa: E402  (scripts/ is sys.path[0])

from launcher.observe.logs import read_events  # noqa: E402  (the repo, not only an install)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(REPO, "tests", "scripts", "launch_probe.py")


def one_run(launcher: list[str], nproc: int) -> dict:
    out = tempfile.mkdtemp(prefix="bench_launch_")
    env = dict(
        os.environ, OUT_DIR=out, PYTHONPATH=REPO, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo"
    )
    t0 = time.time()
    r = subprocess.run(
        launcher
        + [
            "--nproc_per_node",
            str(nproc),
            "--max_restarts",
            "1",
            "--log_dir",
            os.path.join(out, "logs"),
            PROBE,
            "1.0",
            "40",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode != 0:
        raise RuntimeError(f"{launcher} failed: {r.stderr[-2000:]}")

    def ready(attempt: int) -> float:
        files = glob.glob(os.path.join(out, f"{attempt}.*.json"))
        assert len(files) == nproc, files
        return max(json.load(open(p))["ready"] for p in files)

    crash = json.load(open(os.path.join(out, "crash.json")))["time"]
    res = {"launch_s": ready(0) - t0, "recover_s": ready(1) - crash}
    for e in read_events(os.path.join(out, "logs")):
        if e["event"] == "worker-failed":
            res["detect_ms"] = e["detect_ms"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    hosts = ensure_hosts_line()
    launchers = {
        "torchrun": [sys.executable, "-m", "torch.distributed.run"],
        "ftrun": [sys.executable, "-m", "launcher"],
    }
    runs: dict[str, list[dict]] = {k: [] for k in launchers}
    for _ in range(a.repeat):  # interleaved so both see the same machine state
        for name, cmd in launchers.items():
            runs[name].append(one_run(cmd, a.nproc))
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }
    result = {
        "bench": "launch",
        "nproc": a.nproc,
        "repeat": a.repeat,
        "hosts_line": hosts,
        "torchrun_launch_s": round(med["torchrun"]["launch_s"], 3),
        "ftrun_launch_s": round(med["ftrun"]["launch_s"], 3),
        "torchrun_recover_s": round(med["torchrun"]["recover_s"], 3),
        "ftrun_recover_s": round(med["ftrun"]["recover_s"], 3),
        "ftrun_detect_ms": round(med["ftrun"].get("detect_ms", float("nan")), 3),
        "launch_ratio": round(med["ftrun"]["launch_s"] / med["torchrun"]["launch_s"], 3),
        "recover_ratio": round(med["ftrun"]["recover_s"] / med["torchrun"]["recover_s"], 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
