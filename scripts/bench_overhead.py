#!/usr/bin/env python3
"""Benchmark: the steady-state cost of recovery (no fault), against plain torch DDP under torchrun.

Trains the same MLP on the same data (scripts/bench_overhead_worker.py), same seed, step count and
bucket size, in these modes (--modes, default ddp,rtddp,native):
  ddp        plain torch DistributedDataParallel under torchrun (the baseline, always run);
  ddp_ftrun  the same unmodified script under ftrun (the launcher alone);
  rtddp      the same DDP loop through `rt.ddp(module)` inside the runtime's step loop, under ftrun;
  native     the runtime's own loop with `rt.allreduce_gradients` (overlapped buckets), under ftrun;
  rtddp_torchrun, native_torchrun   the same two under plain torchrun (the runtime without an
             agent: no channel, no recovery), to tell the loop's cost from the agent's;
at two model sizes: "small" (an MLP of 0.14 M parameters) and "large" (about 12.7 M
parameters: 50.6 MB of float32 gradients).

Noise control: every rank is pinned to its own core (LOCAL_RANK modulo the allowed cores, the same
in every mode; --no-pin turns it off), OMP_NUM_THREADS=--threads (1), the first --warmup steps of
each run are dropped, and runs are interleaved: each repeat runs every mode once, back to back,
the order rotating between repeats (ABC, BCA, CAB, ...), so slow drifts of a shared machine hit
every mode alike. The ftrun modes run with `--warm-spares 0` unless --warm-spares says otherwise:
the spares' start is a one-off start-up cost (5 s into a job that uses the runtime, each spare
imports torch at nice 10: ~3 CPU-seconds), not a per-step one, and on the 2 cores of a short
benchmark run it lands inside the measured steps (about +10 % on the large model).

Per mode: `<mode>_step_s` the median wall time per step over all kept steps of all repeats (rank
0's clock), `<mode>_run_medians_s` each run's own median and `<mode>_spread_pct` their range
(max - min) against their median; `<mode>_cpu_step_s` the median over steps of the CPU time all
ranks together spent in a step (every thread of each rank process) with its run medians and
spread; `<mode>_tree_cpu_s` the median CPU time of the whole launched process tree (launcher,
agent, workers; start-up included) per run. Against ddp: `<mode>_overhead_pct` (pooled medians),
`<mode>_paired_overhead_pct` and `<mode>_paired_range_pct` (each repeat's run median against the
ddp run of the same repeat: median and range over repeats) and `<mode>_cpu_overhead_pct`,
`<mode>_cpu_paired_overhead_pct`, `<mode>_cpu_paired_range_pct` (the same for CPU per step). On a
shared 2-core machine wall time spreads by several percent between runs of one mode; CPU time
per step much less. `--nproc 1` takes the cross-process wake-ups out (DDP on a one-rank world;
the launchers and agents still run beside it); here its run medians still spread 7-12 %. To
resolve a 1 % difference at the small model use scripts/bench_step_cost.py (both sides in the
same worker processes, blocks alternating).
Prints one JSON line. Sets up the /etc/hosts line
`::ffff:127.0.0.1 localhost-v4mapped` first (see hosts_setup.py).

    python scripts/bench_overhead.py --repeats 7 --steps 60 --warmup 10 --sizes small
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hosts_setup import ensure_hosts_line  # noqa: E402  (scripts/ is sys.path[0])

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "scripts", "bench_overhead_worker.py")
SIZES = {
    "small": {"hidden": 256, "layers": 4, "batch": 32},
    "large": {"hidden": 2048, "layers": 5, "batch": 32},
}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
FTRUN = [sys.executable, "-m", "launcher"]
RUNS = {
    "ddp": (TORCHRUN, "ddp"),
    "ddp_ftrun": (FTRUN, "ddp"),
    "rtddp": (FTRUN, "rtddp"),
    "native": (FTRUN, "native"),
    "rtddp_torchrun": (TORCHRUN, "rtddp"),
    "native_torchrun": (TORCHRUN, "native"),
}  # name -> (launcher, worker --mode)
MODES = tuple(RUNS)


def worker_env(threads: int) -> dict[str, str]:
    """The benchmarks' launch environment: this checkout on PYTHONPATH, `threads` OpenMP threads,
    gloo on loopback, and no FTRUN_* setting inherited from the caller's shell."""
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS=str(threads), GLOO_SOCKET_IFNAME="lo")
    return {k: v for k, v in env.items() if not k.startswith("FTRUN_")}


def run_once(name: str, size: dict, args: argparse.Namespace, workdir: str) -> dict:
    """One launch of one mode; returns rank 0's kept step times, the ranks' CPU per kept step
    (summed over ranks) and the process tree's CPU time."""
    launcher, mode = RUNS[name]
    out = os.path.join(workdir, f"{name}-{time.monotonic_ns()}.json")
    cmd = [*launcher, "--nproc_per_node", str(args.nproc)]
    if launcher is FTRUN:
        cmd += [
            "--log_dir",
            os.path.join(workdir, "logs", os.path.basename(out)[:-5]),
            "--warm-spares",
            str(args.warm_spares),
        ]
    cmd += [
        WORKER,
        "--mode",
        mode,
        "--steps",
        str(args.steps),
        "--out",
        out,
        *(["--pin"] if args.pin else []),
        *[x for k, v in size.items() for x in (f"--{k}", str(v))],
    ]
    env = worker_env(args.threads)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=workdir
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    paths = [f"{out}.rank{r}" for r in range(args.nproc)]
    if res.returncode != 0 or not all(os.path.exists(p) for p in paths):
        raise RuntimeError(
            f"{name} run failed (exit {res.returncode}): {' '.join(cmd)}\n{res.stderr[-3000:]}"
        )
    ranks = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            ranks.append(json.load(f))
    first = ranks[0]
    kept = first["step_s"][args.warmup :]
    if not kept:
        raise RuntimeError(f"--steps {args.steps} leaves no step after --warmup {args.warmup}")
    cpu = [sum(steps) for steps in zip(*(r["cpu_s"][args.warmup :] for r in ranks))]
    tree = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {
        "params": first["params"],
        "grad_bytes": first["grad_bytes"],
        "kept_s": kept,
        "kept_cpu_s": cpu,
        "tree_cpu_s": tree,
        "cores": [r["core"] for r in ranks],
    }


def _spread_pct(values: list[float]) -> float:
    return round(100.0 * (max(values) - min(values)) / statistics.median(values), 2)


def _paired(runs: list[dict], base: list[dict], key: str) -> list[float]:
    """Each repeat's run median against the baseline run of the same repeat, in percent."""
    return [
        100.0 * (statistics.median(r[key]) / statistics.median(b[key]) - 1.0)
        for r, b in zip(runs, base)
    ]


def rotating_runs(
    modes: Sequence[str], repeats: int, run: Callable[[str], dict]
) -> dict[str, list[dict]]:
    """Each repeat runs every mode once, back to back, the order rotating between repeats (ABC,
    BCA, CAB, ...), so slow drifts of a shared machine hit every mode alike."""
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for rep in range(repeats):
        for mode in [*modes[rep % len(modes) :], *modes[: rep % len(modes)]]:
            runs[mode].append(run(mode))
    return runs


def measure(name: str, modes: tuple[str, ...], args: argparse.Namespace, workdir: str) -> dict:
    size = SIZES[name]
    runs = rotating_runs(modes, args.repeats, lambda mode: run_once(mode, size, args, workdir))
    first = runs["ddp"][0]
    report: dict = {
        **size,
        "params": first["params"],
        "grad_mb": round(first["grad_bytes"] / 1e6, 1),
        "cores": first["cores"],
    }
    for mode in modes:
        for key, label in (("kept_s", "step_s"), ("kept_cpu_s", "cpu_step_s")):
            pooled = [s for r in runs[mode] for s in r[key]]
            run_medians = [statistics.median(r[key]) for r in runs[mode]]
            report[f"{mode}_{label}"] = round(statistics.median(pooled), 6)
            report[f"{mode}_{label.replace('step_s', 'run_medians_s')}"] = [
                round(x, 6) for x in run_medians
            ]
            report[f"{mode}_{label.replace('step_s', 'spread_pct')}"] = _spread_pct(run_medians)
        report[f"{mode}_tree_cpu_s"] = round(
            statistics.median(r["tree_cpu_s"] for r in runs[mode]), 3
        )
    for mode in modes[1:]:
        for key, label, pre in (("kept_s", "step_s", ""), ("kept_cpu_s", "cpu_step_s", "cpu_")):
            report[f"{mode}_{pre}overhead_pct"] = round(
                100.0 * (report[f"{mode}_{label}"] / report[f"ddp_{label}"] - 1.0), 2
            )
            paired = _paired(runs[mode], runs["ddp"], key)
            report[f"{mode}_{pre}paired_overhead_pct"] = round(statistics.median(paired), 2)
            report[f"{mode}_{pre}paired_range_pct"] = [round(min(paired), 2), round(max(paired), 2)]
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument(
        "--modes",
        default="ddp,rtddp,native",
        help=f"comma-separated, from {','.join(MODES)}; ddp (the baseline) is always run",
    )
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin ranks to cores")
    ap.add_argument(
        "--warm-spares",
        type=int,
        default=0,
        help="ftrun's --warm-spares (default 0: see the docstring; ftrun's own default is 2)",
    )
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every worker")
    ap.add_argument(
        "--sizes", default="small,large", help=f"comma-separated, from {','.join(SIZES)}"
    )
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    sizes = [s for s in args.sizes.split(",") if s]
    bad = [s for s in sizes if s not in SIZES]
    if bad or not sizes:
        ap.error(f"--sizes {args.sizes!r}: allowed {', '.join(SIZES)}")
    modes = tuple(dict.fromkeys(["ddp", *(m for m in args.modes.split(",") if m)]))
    if any(m not in MODES for m in modes):
        ap.error(f"--modes {args.modes!r}: allowed {', '.join(MODES)}")
    if args.repeats < 1 or args.nproc < 1 or args.warmup < 0 or args.steps <= args.warmup:
        ap.error("need --repeats >= 1, --nproc >= 1, 0 <= --warmup < --steps")
    hosts = ensure_hosts_line()
    with tempfile.TemporaryDirectory(prefix="ftrun-bench-overhead-") as workdir:
        results = {name: measure(name, modes, args, workdir) for name in sizes}
    print(
        json.dumps(
            {
                "bench": "overhead",
                "nproc": args.nproc,
                "repeats": args.repeats,
                "steps": args.steps,
                "warmup": args.warmup,
                "threads": args.threads,
                "pinned": args.pin,
                "modes": list(modes),
                "warm_spares": args.warm_spares,
                "hosts_line": hosts,
                "baseline": "plain torch DDP under torchrun",
                **results,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
