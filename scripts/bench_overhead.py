#!/usr/bin/env python3
"""Benchmark: the steady-state cost of recovery (no fault), against plain torch DDP under torchrun.

Trains the same MLP on the same data (scripts/bench_overhead_worker.py) four ways:
  ddp        plain torch DistributedDataParallel under torchrun (the baseline);
  ddp_ftrun  the same unmodified script under ftrun (the launcher alone);
  rtddp      the same DDP loop through `rt.ddp(module)` inside the runtime's step loop, under ftrun;
  native     the runtime's own loop with `rt.allreduce_gradients` (overlapped buckets), under ftrun;
at two model sizes: "small" (an MLP of 0.14 M parameters) and "large" (about 12.7 M
parameters: 50.6 MB of float32 gradients). Runs are interleaved (each repeat runs every mode once,
the order rotating between repeats); the first --warmup steps of each run are skipped. Per mode:
the median step time over all kept steps of all repeats, each run's own median, the overhead
against ddp in percent, and the paired overhead (the median, and the range, over repeats of each
run's median against the ddp run of the same repeat), and the CPU time rank 0's process spent
per step (median; every thread of it) with its overhead against ddp: on a shared machine
wall-time medians of one mode spread by more than 1 %, CPU time per step much less. Prints one JSON line. Sets up the /etc/hosts line
`::ffff:127.0.0.1 localhost-v4mapped` first (see hosts_setup.py).

    python scripts/bench_overhead.py --repeats 5 --steps 40
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hosts_setup import ensure_hosts_line  # noqa: E402  (scripts/ is sys.path[0])

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "scripts", "bench_overhead_worker.py")
SIZES = {"small": {"hidden": 256, "layers": 4, "batch": 32},
         "large": {"hidden": 2048, "layers": 5, "batch": 32}}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
FTRUN = [sys.executable, "-m", "launcher"]
RUNS = {"ddp": (TORCHRUN, "ddp"), "ddp_ftrun": (FTRUN, "ddp"), "rtddp": (FTRUN, "rtddp"),
        "native": (FTRUN, "native")}  # name -> (launcher, worker --mode)
MODES = tuple(RUNS)


def run_once(name: str, size: dict, args: argparse.Namespace, workdir: str) -> dict:
    launcher, mode = RUNS[name]
    out = os.path.join(workdir, f"{name}-{time.monotonic_ns()}.json")
    cmd = [*launcher, "--nproc_per_node", str(args.nproc)]
    if launcher is FTRUN:
        cmd += ["--log_dir", os.path.join(workdir, "logs", os.path.basename(out)[:-5])]
    cmd += [WORKER, "--mode", mode, "--steps", str(args.steps), "--out", out,
            *[x for k, v in size.items() for x in (f"--{k}", str(v))]]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS=str(args.threads), GLOO_SOCKET_IFNAME="lo")
    for k in [k for k in env if k.startswith("FTRUN_")]:
        env.pop(k)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=workdir)
    if res.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"{name} run failed (exit {res.returncode}): {' '.join(cmd)}\n{res.stderr[-3000:]}")
    with open(out, encoding="utf-8") as f:
        result = json.load(f)
    result["kept_s"] = result["step_s"][args.warmup:]
    result["kept_cpu_s"] = result["cpu_s"][args.warmup:]
    if not result["kept_s"]:
        raise RuntimeError(f"--steps {args.steps} leaves no step after --warmup {args.warmup}")
    return result


def measure(name: str, args: argparse.Namespace, workdir: str) -> dict:
    size = SIZES[name]
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for rep in range(args.repeats):
        order = MODES[rep % len(MODES):] + MODES[:rep % len(MODES)]
        for mode in order:
            runs[mode].append(run_once(mode, size, args, workdir))
    first = runs["ddp"][0]
    report: dict = {**size, "params": first["params"], "grad_mb": round(first["grad_bytes"] / 1e6, 1)}
    medians = {}
    for mode in MODES:
        pooled = [s for r in runs[mode] for s in r["kept_s"]]
        medians[mode] = statistics.median(pooled)
        report[f"{mode}_step_s"] = round(medians[mode], 5)
        report[f"{mode}_run_medians_s"] = [round(statistics.median(r["kept_s"]), 5) for r in runs[mode]]
        report[f"{mode}_cpu_step_s"] = round(statistics.median(
            [s for r in runs[mode] for s in r["kept_cpu_s"]]), 5)
    for mode in MODES[1:]:
        report[f"{mode}_overhead_pct"] = round(100.0 * (medians[mode] / medians["ddp"] - 1.0), 2)
        # paired: each repeat's run against the ddp run of the same repeat (runs next to each
        # other share the machine's state, so slow drifts of a shared machine cancel out)
        paired = [100.0 * (statistics.median(r["kept_s"]) / statistics.median(b["kept_s"]) - 1.0)
                  for r, b in zip(runs[mode], runs["ddp"])]
        report[f"{mode}_paired_overhead_pct"] = round(statistics.median(paired), 2)
        report[f"{mode}_paired_range_pct"] = [round(min(paired), 2), round(max(paired), 2)]
        report[f"{mode}_cpu_overhead_pct"] = round(
            100.0 * (report[f"{mode}_cpu_step_s"] / report["ddp_cpu_step_s"] - 1.0), 2)
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every worker")
    ap.add_argument("--sizes", default="small,large", help=f"comma-separated, from {','.join(SIZES)}")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    sizes = [s for s in args.sizes.split(",") if s]
    bad = [s for s in sizes if s not in SIZES]
    if bad or not sizes:
        ap.error(f"--sizes {args.sizes!r}: allowed {', '.join(SIZES)}")
    if args.repeats < 1 or args.nproc < 2 or args.warmup < 0 or args.steps <= args.warmup:
        ap.error("need --repeats >= 1, --nproc >= 2, 0 <= --warmup < --steps")
    hosts = ensure_hosts_line()
    with tempfile.TemporaryDirectory(prefix="ftrun-bench-overhead-") as workdir:
        results = {name: measure(name, args, workdir) for name in sizes}
    print(json.dumps({"bench": "overhead", "nproc": args.nproc, "repeats": args.repeats, "steps": args.steps,
                      "warmup": args.warmup, "threads": args.threads, "hosts_line": hosts,
                      "baseline": "plain torch DDP under torchrun", **results}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
