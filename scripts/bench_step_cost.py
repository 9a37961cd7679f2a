#!/usr/bin/env python3
"""Benchmark: what the runtime's step path costs against plain DDP, both in the same processes.

`bench_overhead.py` compares separate launches (plain DDP under torchrun against each ftrun mode).
On this shared 2-core VM the run medians of one and the same mode spread by 7-85 % between
launches, so a 1 % difference at the small model is below what it can resolve. This benchmark
takes the launches out of the comparison: each worker (scripts/bench_overhead_worker.py,
`--mode interleaved_rtddp` or `interleaved_native`, under ftrun) builds two copies of the same
model, one under plain `DistributedDataParallel` (on a gloo group of its own, outside
`rt.steps()`) and one on the runtime's path (`rt.ddp(module)`, or the plain module with
`rt.allreduce_gradients`, registered with the runtime), and trains them alternately in blocks of
--block steps, the order flipping every cycle. Both see the same process, core, caches, background
threads (the runtime's channel to the agent included) and machine drift; the ratio of adjacent
blocks isolates what the runtime's step path adds.

Per mode, over all cycles of all repeats (the first 2 cycles of each launch dropped as warm-up),
rank 0: `<mode>_cpu_pct` the median of the per-cycle ratios (runtime block's median CPU time per
step / plain DDP block's, minus 1; the CPU time of every thread of the process) with
`<mode>_cpu_iqr_pct` (25th..75th percentile of those ratios) and `<mode>_cpu_ci95_pct` (a
bootstrap 95 % interval of the median); the same for wall time (`<mode>_wall_*`); the plain DDP
and runtime medians per step (`<mode>_ddp_cpu_step_s`, `<mode>_ours_cpu_step_s`);
`<mode>_agent_thread_cpu_pct` the CPU time of the runtime's own threads (the channel to the
agent) against the process's. `rtddp` is rt.ddp as users get it (DDP's own C++ reducer on the
runtime's group); `rtddphook` the same with FTRUN_DDP_COMM=hook (the runtime's Python comm hook,
rt.ddp's only path before). `--variants` adds two controls beside `rtddp` (same loop under
`rt.steps()`, plain DDP on both sides otherwise): `bucketview` (DDP with bucket-view gradients,
no hook: the runtime's step bookkeeping alone) and `torchhook` (DDP with torch's own Python
`allreduce_hook`: what any Python comm hook costs). Prints one JSON line. Sets up the /etc/hosts
line `::ffff:127.0.0.1 localhost-v4mapped` first (see hosts_setup.py).

    python scripts/bench_step_cost.py --nproc 1 --repeats 3 --steps 4000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_overhead import SIZES, WORKER, rotating_runs, worker_env  # noqa: E402  (the same worker, models and sizes)
from hosts_setup import ensure_hosts_line  # noqa: E402  (scripts/ is sys.path[0])

MODES = ("rtddp", "rtddphook", "native", "bucketview", "torchhook")
WORKER_MODE = {
    "rtddphook": "rtddp"
}  # rt.ddp with FTRUN_DDP_COMM=hook: the runtime's Python comm hook
WARM_CYCLES = 2
STOP_GRACE_S = 30.0  # after SIGTERM, ftrun's time to stop its workers before SIGKILL


def run_once(mode: str, size: dict, args: argparse.Namespace, workdir: str) -> dict:
    """One ftrun launch of one interleaved mode; returns rank 0's output."""
    out = os.path.join(workdir, f"{mode}-{time.monotonic_ns()}.json")
    cmd = [
        sys.executable,
        "-m",
        "launcher",
        "--nproc_per_node",
        str(args.nproc),
        "--warm-spares",
        "0",
        "--log_dir",
        os.path.join(workdir, "logs", os.path.basename(out)[:-5]),
        WORKER,
        "--mode",
        f"interleaved_{WORKER_MODE.get(mode, mode)}",
        "--steps",
        str(args.steps),
        "--block",
        str(args.block),
        "--out",
        out,
        *(["--pin"] if args.pin else []),
        *[x for k, v in size.items() for x in (f"--{k}", str(v))],
    ]
    env = worker_env(threads=1)
    if mode == "rtddphook":
        env["FTRUN_DDP_COMM"] = "hook"
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=workdir
    )
    try:
        _, stderr = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        stderr = f"timed out after --timeout {args.timeout} s"
    finally:  # also on Ctrl-C / SIGTERM: ftrun stops its workers on SIGTERM, as torchrun does
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.communicate(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
    path = f"{out}.rank0"
    if proc.returncode != 0 or not os.path.exists(path):
        raise RuntimeError(
            f"{mode} run failed (exit {proc.returncode}): {' '.join(cmd)}\n{stderr[-3000:]}"
        )
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def cycle_ratios(result: dict, key: str) -> list[float]:
    """Per cycle (warm-up cycles dropped): the runtime block's median over plain DDP's, minus 1."""
    by_cycle: dict[int, dict[str, list[float]]] = {}
    for block in result["blocks"]:
        by_cycle.setdefault(block["cycle"], {})["ddp" if block["mode"] == "ddp" else "ours"] = (
            block[key]
        )
    return [
        statistics.median(b["ours"]) / statistics.median(b["ddp"]) - 1.0
        for c, b in sorted(by_cycle.items())
        if c >= WARM_CYCLES and len(b) == 2
    ]


def block_medians(result: dict, side: str, key: str) -> list[float]:
    return [
        statistics.median(b[key])
        for b in result["blocks"]
        if b["cycle"] >= WARM_CYCLES and (b["mode"] == "ddp") == (side == "ddp")
    ]


def summarize(ratios: list[float], rng: random.Random) -> dict:
    """Median, interquartile range and a bootstrap 95 % interval of the median, in percent."""
    ordered = sorted(ratios)
    n = len(ordered)
    boot = sorted(statistics.median(rng.choices(ordered, k=n)) for _ in range(1000))
    pct = lambda x: round(100.0 * x, 2)  # noqa: E731
    return {
        "pct": pct(statistics.median(ordered)),
        "iqr_pct": [pct(ordered[n // 4]), pct(ordered[(3 * n) // 4])],
        "ci95_pct": [pct(boot[25]), pct(boot[974])],
        "cycles": n,
    }


def measure(size_name: str, modes: list[str], args: argparse.Namespace, workdir: str) -> dict:
    size = SIZES[size_name]
    runs = rotating_runs(modes, args.repeats, lambda mode: run_once(mode, size, args, workdir))
    rng = random.Random(0)
    report: dict = {
        **size,
        "params": runs[modes[0]][0]["params"],
        "grad_mb": round(runs[modes[0]][0]["grad_bytes"] / 1e6, 1),
    }
    for mode in modes:
        for key, label in (("cpu_s", "cpu"), ("step_s", "wall")):
            stats = summarize([r for res in runs[mode] for r in cycle_ratios(res, key)], rng)
            report[f"{mode}_{label}_pct"] = stats["pct"]
            report[f"{mode}_{label}_iqr_pct"] = stats["iqr_pct"]
            report[f"{mode}_{label}_ci95_pct"] = stats["ci95_pct"]
        report[f"{mode}_cycles"] = stats["cycles"]
        for side in ("ddp", "ours"):
            report[f"{mode}_{side}_cpu_step_s"] = round(
                statistics.median(
                    [m for res in runs[mode] for m in block_medians(res, side, "cpu_s")]
                ),
                7,
            )
        threads = sum(res["runtime_thread_cpu_s"] for res in runs[mode])
        process = sum(sum(b["cpu_s"]) for res in runs[mode] for b in res["blocks"])
        report[f"{mode}_agent_thread_cpu_pct"] = round(100.0 * threads / process, 3)
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--nproc", type=int, default=1, help="ranks (default 1: no cross-process wake-ups)"
    )
    ap.add_argument(
        "--repeats", type=int, default=3, help="launches per mode, interleaved between modes"
    )
    ap.add_argument("--steps", type=int, default=4000, help="steps per launch, both sides together")
    ap.add_argument("--block", type=int, default=20, help="steps per block")
    ap.add_argument(
        "--modes", default="rtddp,native", help=f"comma-separated, from {','.join(MODES)}"
    )
    ap.add_argument("--sizes", default="small", help=f"comma-separated, from {','.join(SIZES)}")
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin ranks to cores")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    sizes = [s for s in args.sizes.split(",") if s]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes {args.modes!r}: allowed {', '.join(MODES)}")
    if not sizes or any(s not in SIZES for s in sizes):
        ap.error(f"--sizes {args.sizes!r}: allowed {', '.join(SIZES)}")
    if args.nproc < 1 or args.repeats < 1 or args.block < 1:
        ap.error("need --nproc >= 1, --repeats >= 1, --block >= 1")
    if args.steps // (2 * args.block) <= WARM_CYCLES:
        ap.error(
            f"--steps {args.steps} with --block {args.block} leaves no cycle after the "
            f"{WARM_CYCLES} warm-up cycles: need --steps > {2 * args.block * (WARM_CYCLES + 1) - 1}"
        )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run_once's finally stops the launch
    hosts = ensure_hosts_line()
    with tempfile.TemporaryDirectory(prefix="ftrun-bench-step-cost-") as workdir:
        results = {name: measure(name, modes, args, workdir) for name in sizes}
    print(
        json.dumps(
            {
                "bench": "step_cost",
                "nproc": args.nproc,
                "repeats": args.repeats,
                "steps": args.steps,
                "block": args.block,
                "pinned": args.pin,
                "modes": modes,
                "hosts_line": hosts,
                "baseline": "plain torch DDP in the same worker processes",
                **results,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
