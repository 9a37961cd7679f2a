#!/usr/bin/env python3
"""Benchmark: steady-state cost of the framework callbacks on megatron-core (TP=2 x DP=2, CPU).

Runs scripts/examples/megatron_train.py in interleaved repeats:
  plain     `--no-ftrun` under torchrun: the same loop without any hook (the baseline),
  hooks     under ftrun, integrated through launcher.runtime.callbacks (snapshots at step start
            and commit, phase reports, megatron's collectives routed through the interruptible
            wait),
and with --hooks-torchrun also
  hooks_torchrun  the hooks under plain torchrun (no agent: the cost of the hooks alone).
Each run reports rank 0's median step time after --warmup steps; the JSON line gives the median
over repeats per mode and the ratio to plain. No fault is injected.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hosts_setup import ensure_hosts_line  # noqa: E402  (scripts/ is sys.path[0])

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "scripts", "examples", "megatron_train.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
FTRUN = [sys.executable, "-m", "launcher"]


def one_run(mode: str, steps: int, warmup: int, model_args: list[str]) -> float:
    with tempfile.TemporaryDirectory(prefix=f"bench_callbacks_{mode}_") as out:
        return _timed(mode, out, steps, warmup, model_args)


def _timed(mode: str, out: str, steps: int, warmup: int, model_args: list[str]) -> float:
    report = os.path.join(out, "report.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTRUN_")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    launcher = FTRUN + ["--log_dir", os.path.join(out, "logs")] if mode == "hooks" else TORCHRUN
    cmd = (
        launcher
        + [
            "--nproc_per_node",
            "4",
            EXAMPLE,
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
            "--report",
            report,
            *model_args,
        ]
        + (["--no-ftrun"] if mode == "plain" else [])
    )
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=out)
    if r.returncode != 0:
        raise RuntimeError(f"{mode} run failed (exit {r.returncode}): {r.stderr[-3000:]}")
    with open(report, encoding="utf-8") as f:
        return json.load(f)["median_step_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument(
        "--hooks-torchrun", action="store_true", help="also time the hooks under plain torchrun"
    )
    a = ap.parse_args()
    for name, v in (("--repeat", a.repeat), ("--steps", a.steps)):
        if v < 1:
            raise SystemExit(f"{name}={v} must be >= 1")
    if not 0 <= a.warmup < a.steps:
        raise SystemExit(f"--warmup={a.warmup} must be in 0..{a.steps - 1}")
    hosts = ensure_hosts_line()
    model_args = ["--layers", str(a.layers), "--hidden", str(a.hidden), "--batch", str(a.batch)]
    modes = ["plain", "hooks"] + (["hooks_torchrun"] if a.hooks_torchrun else [])
    runs: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(a.repeat):  # interleaved so every mode sees the same machine state
        for m in modes:
            runs[m].append(one_run(m, a.steps, a.warmup, model_args))
    med = {m: statistics.median(v) for m, v in runs.items()}
    result = {
        "bench": "callbacks",
        "model": "megatron-core GPT TP=2 x DP=2",
        "layers": a.layers,
        "hidden": a.hidden,
        "batch": a.batch,
        "steps": a.steps,
        "warmup": a.warmup,
        "repeat": a.repeat,
        "hosts_line": hosts,
        **{f"{m}_step_s": round(v, 5) for m, v in med.items()},
        **{f"{m}_runs_s": [round(x, 5) for x in runs[m]] for m in modes},
        **{f"{m}_ratio": round(med[m] / med["plain"], 3) for m in modes if m != "plain"},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
