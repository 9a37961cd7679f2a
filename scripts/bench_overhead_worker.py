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
import threading
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

MODES = (
    "ddp",
    "rtddp",
    "native",
    "interleaved_rtddp",
    "interleaved_native",
    "interleaved_bucketview",
    "interleaved_torchhook",
)


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


def plain_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, index: int, rank: int, batch: int
) -> None:
    """One training step of plain DDP (the baseline's loop body)."""
    x, y = make_batch(index, rank, batch)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def runtime_step(
    rt,
    step,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    pos: dict,  # noqa: ANN001
    batch: int,
    native: bool,
) -> None:
    """One step of the runtime's loop (rt.ddp, or the plain module with rt.allreduce_gradients)."""
    with step:
        with step.phase("forward"):
            x, y = make_batch(pos["batch"], rt.rank, batch)
            pos["batch"] += 1
            loss = torch.nn.functional.mse_loss(model(x), y)
        with step.phase("backward"):
            opt.zero_grad()
            loss.backward()
            if native:
                rt.allreduce_gradients(model)
        with step.optimizer_update():
            opt.step()


def run_ddp(args: argparse.Namespace, module: torch.nn.Module, tick: Callable[[], None]) -> int:
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(module)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for step in range(args.steps):
        tick()
        plain_step(model, opt, step, rank, args.batch)
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
        runtime_step(rt, step, model, opt, pos, args.batch, args.mode == "native")
    tick()
    rank = rt.rank
    rt.finish()
    return rank


def _thread_cpu_s(native_ids: list[int]) -> float:
    """CPU seconds (user + system) the given threads of this process have used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for tid in native_ids:
        try:
            with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread has ended
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / tick


def run_interleaved(
    args: argparse.Namespace, module: torch.nn.Module, tick: Callable[[], None]
) -> int:
    """Plain DDP and the runtime's path (rt.ddp or the native loop) in the same processes, on copies
    of the same model, alternating in blocks of --block steps (the order flips every cycle).

    Both see the same process, core, caches, background threads and machine drift, so the ratio of
    adjacent blocks isolates what the runtime's step path adds. Plain DDP runs on a gloo group of
    its own, outside `rt.steps()`; the runtime's model is the one registered with the runtime.
    Controls (the loop under `rt.steps()` as for rt.ddp, the model a plain DDP otherwise):
    `bucketview` DDP with gradient_as_bucket_view=True and no hook (the runtime's step bookkeeping
    alone), `torchhook` the same with torch's own Python `allreduce_hook` (any Python comm hook).
    `tick` is unused: the per-block step times go to the output as "blocks"."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    import launcher.runtime as ftr

    rt = ftr.init(backend="gloo")
    plain = DDP(copy.deepcopy(module), process_group=dist.new_group(backend="gloo"))
    kind = args.mode.split("_", 1)[1]
    if kind == "rtddp":
        ours = rt.ddp(copy.deepcopy(module))
    elif kind in ("bucketview", "torchhook"):
        ours = DDP(
            copy.deepcopy(module),
            process_group=dist.new_group(backend="gloo"),
            gradient_as_bucket_view=True,
        )
        if kind == "torchhook":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            ours.register_comm_hook(None, allreduce_hook)
    else:
        ours = copy.deepcopy(module)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-4)
    opt = torch.optim.Adam(ours.parameters(), lr=1e-4)
    pos = {"batch": 0}
    rt.register(model=ours, optimizer=opt, data=(lambda: dict(pos), lambda p: pos.update(p)))
    runtime_threads = [
        t.native_id
        for t in threading.enumerate()
        if t.name.startswith("ftrun") and t.native_id is not None
    ]
    blocks: list[dict] = []

    def timed(name: str, cycle: int, run_step: Callable[[int], None], first: int) -> None:
        stamps = [(time.perf_counter(), time.process_time())]
        for k in range(args.block):
            run_step(first + k)
            stamps.append((time.perf_counter(), time.process_time()))
        blocks.append(
            {
                "mode": name,
                "cycle": cycle,
                "step_s": [b[0] - a[0] for a, b in zip(stamps, stamps[1:])],
                "cpu_s": [b[1] - a[1] for a, b in zip(stamps, stamps[1:])],
            }
        )

    cycles = args.steps // (2 * args.block)
    steps = rt.steps(cycles * args.block)
    native = kind == "native"
    sides = {
        "ddp": lambda i: plain_step(plain, plain_opt, i, rt.rank, args.batch),
        kind: lambda i: runtime_step(rt, next(steps), ours, opt, pos, args.batch, native),
    }
    cpu0, wall0 = _thread_cpu_s(runtime_threads), time.perf_counter()
    for cycle in range(cycles):
        pair = list(sides.items())
        for name, fn in pair if cycle % 2 == 0 else pair[::-1]:
            timed(name, cycle, fn, cycle * args.block)
    elapsed = time.perf_counter() - wall0
    threads_cpu = _thread_cpu_s(runtime_threads) - cpu0
    for _ in steps:  # the generator's end: the runtime marks the job done
        raise RuntimeError("rt.steps() yielded more steps than were planned")
    rank = rt.rank
    rt.finish()
    # the DDP groups must outlive this function: dropping it here can deadlock inside torch
    # (~ProcessGroupGloo joins gloo's thread holding the GIL while that thread frees the last
    # all_reduce work, which needs the GIL); main() leaves with os._exit instead
    args.keep = (plain, ours)
    args.extra = {
        "blocks": blocks,
        "runtime_thread_cpu_s": threads_cpu,
        "elapsed_s": elapsed,
        "runtime_threads": len(runtime_threads),
    }
    return rank


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", required=True)
    ap.add_argument("--block", type=int, default=20, help="interleaved modes: steps per block")
    ap.add_argument("--pin", action="store_true", help="pin to core LOCAL_RANK (see the docstring)")
    args = ap.parse_args()
    torch.manual_seed(0)
    module = build_model(args.hidden, args.layers)
    stamps: list[tuple[float, float]] = []
    args.extra = {}
    runner = (
        run_ddp
        if args.mode == "ddp"
        else run_interleaved
        if args.mode.startswith("interleaved")
        else run_runtime
    )
    rank = runner(args, module, lambda: stamps.append((time.perf_counter(), time.process_time())))
    params = sum(p.numel() for p in module.parameters())
    result = {
        "mode": args.mode,
        "rank": rank,
        "core": CORE,
        "params": params,
        "grad_bytes": params * 4,
        "step_s": [b[0] - a[0] for a, b in zip(stamps, stamps[1:])],
        "cpu_s": [b[1] - a[1] for a, b in zip(stamps, stamps[1:])],
        **args.extra,
    }
    out = f"{args.out}.rank{rank}"
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(tmp, out)
    if hasattr(args, "keep"):  # see run_interleaved
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
