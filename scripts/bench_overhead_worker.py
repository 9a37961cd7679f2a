#!/usr/bin/env python3
"""Worker of scripts/bench_overhead.py: one training run, the same model and data in each mode.

--mode ddp     plain torch DistributedDataParallel (run it under torchrun)
--mode rtddp   the same DDP loop through `rt.ddp` inside the runtime's step loop (under ftrun)
--mode native  the runtime's own loop with `rt.allreduce_gradients` (under ftrun)

MLP (--hidden, --layers), Adam, a fresh random batch per step (same generator in every mode).
Every rank writes {"mode", "rank", "core", "params", "grad_bytes", "step_s": [...], "cpu_s": [...]}
to `<--out>.rank<r>` (temp name + rename): the wall time of every step, from the start of one step
to the start of the next, and the CPU time this process (every thread of it: training, gloo, the
runtime's) spent in it. `--pin` pins the process (before torch starts any thread, so every thread
of it) to core LOCAL_RANK modulo the cores it may use: every mode gets the same placement.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pin_to_core() -> int:
    """Pin this process to one core: LOCAL_RANK modulo the allowed cores. Returns the core."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[int(os.environ.get("LOCAL_RANK", "0")) % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


CORE = pin_to_core() if "--pin" in sys.argv[1:] else -1  # before torch's threads exist

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

MODES = ("ddp", "rtddp", "native")


def build_model(hidden: int, layers: int, inputs: int = 32) -> torch.nn.Module:
    mods: list[torch.nn.Module] = [torch.nn.Linear(inputs, hidden), torch.nn.ReLU()]
    for _ in range(layers - 2):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(hidden, 1))
    return torch.nn.Sequential(*mods)


def make_batch(step: int, rank: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randn(batch, 32, generator=g)
    return x, x[:, :1] * 0.5 - x[:, 1:2]


def run_ddp(args: argparse.Namespace, module: torch.nn.Module, tick: Callable[[], None]) -> int:
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(module)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for step in range(args.steps):
        tick()
        x, y = make_batch(step, rank, args.batch)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    tick()
    dist.destroy_process_group()
    return rank


def run_runtime(args: argparse.Namespace, module: torch.nn.Module, tick: Callable[[], None]) -> int:
    import launcher.runtime as ftr
    rt = ftr.init(backend="gloo")
    model = rt.ddp(module) if args.mode == "rtddp" else module
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    pos = {"batch": 0}
    rt.register(model=model, optimizer=opt, data=(lambda: dict(pos), lambda p: pos.update(p)))
    for step in rt.steps(args.steps):
        tick()
        with step:
            with step.phase("forward"):
                x, y = make_batch(pos["batch"], rt.rank, args.batch)
                pos["batch"] += 1
                loss = torch.nn.functional.mse_loss(model(x), y)
            with step.phase("backward"):
                opt.zero_grad()
                loss.backward()
                if args.mode == "native":
                    rt.allreduce_gradients(model)
            with step.optimizer_update():
                opt.step()
    tick()
    rank = rt.rank
    rt.finish()
    return rank


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pin", action="store_true", help="pin to core LOCAL_RANK (see the docstring)")
    args = ap.parse_args()
    torch.manual_seed(0)
    module = build_model(args.hidden, args.layers)
    stamps: list[tuple[float, float]] = []
    runner = run_ddp if args.mode == "ddp" else run_runtime
    rank = runner(args, module, lambda: stamps.append((time.perf_counter(), time.process_time())))
    params = sum(p.numel() for p in module.parameters())
    result = {"mode": args.mode, "rank": rank, "core": CORE, "params": params, "grad_bytes": params * 4,
              "step_s": [b[0] - a[0] for a, b in zip(stamps, stamps[1:])],
              "cpu_s": [b[1] - a[1] for a, b in zip(stamps, stamps[1:])]}
    out = f"{args.out}.rank{rank}"
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
