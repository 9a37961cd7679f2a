#!/usr/bin/env python3
"""Benchmark: the CPU one gradient all_reduce costs with each of `Interruptible`'s two waits
on gloo.

Two ranks (spawned here, each pinned to its own core, one torch thread) issue `--ops` all_reduces
of `--numel` float32 values (default: the small MLP of bench_overhead.py, 0.56 MB) back to back,
each waited for through `launcher.runtime.collectives.Interruptible` with `sliced=True` (the
work's own wait in 5 ms slices) or `sliced=False` (a callback on the work's future wakes a
condition variable). Blocks of `--ops` alternate between the two waits (AB, BA, ...) `--blocks`
times, so drifts of a shared machine hit both alike. Reports rank 0's process CPU (every thread)
and wall time per all_reduce for each wait (median over blocks) and the paired difference
(future-callback minus sliced, each pair of adjacent blocks). One JSON line.

    python scripts/bench_wait.py --blocks 8 --ops 400
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launcher.runtime.collectives import Graveyard, Interruptible  # noqa: E402
from launcher.runtime.signals import StopSignal  # noqa: E402


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rank(rank: int, port: int, args: argparse.Namespace, out: "mp.Queue") -> None:
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]})
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)

    def on_error(exc: BaseException, what: str) -> None:
        raise RuntimeError(f"{what} failed: {exc}")

    stop = StopSignal()
    waits = {
        s: Interruptible(stop, Graveyard(), lambda: 0, 60.0, on_error, sliced=s)
        for s in (True, False)
    }
    pg = dist.distributed_c10d._get_default_group()
    opts = dist.AllreduceOptions()
    t = torch.ones(args.numel)
    per: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for b in range(args.blocks):
        for sliced in (False, True) if b % 2 == 0 else (True, False):
            dist.barrier()
            c0, w0 = _cpu_s(), time.perf_counter()
            for _ in range(args.ops):
                waits[sliced].wait(pg.allreduce([t], opts), "all_reduce", (t,))
            per[sliced].append(((_cpu_s() - c0) / args.ops, (time.perf_counter() - w0) / args.ops))
    if rank == 0:
        out.put(per)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--ops", type=int, default=400)
    ap.add_argument("--numel", type=int, default=140289)
    ap.add_argument("--port", type=int, default=29655)
    args = ap.parse_args()
    if args.blocks < 2 or args.ops < 1 or args.numel < 1:
        print("bench_wait: --blocks >= 2, --ops >= 1 and --numel >= 1", file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        per = out.get(timeout=900)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    us = lambda x: round(x * 1e6, 1)  # noqa: E731
    res: dict = {"bench": "wait", "ops": args.ops, "blocks": args.blocks, "numel": args.numel}
    for sliced, name in ((True, "sliced"), (False, "future")):
        res[f"{name}_cpu_us"] = us(statistics.median(c for c, _ in per[sliced]))
        res[f"{name}_wall_us"] = us(statistics.median(w for _, w in per[sliced]))
        res[f"{name}_cpu_blocks_us"] = [us(c) for c, _ in per[sliced]]
    saved = [f[0] - s[0] for f, s in zip(per[False], per[True])]
    res["cpu_saved_us"] = us(statistics.median(saved))
    res["cpu_saved_range_us"] = [us(min(saved)), us(max(saved))]
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
