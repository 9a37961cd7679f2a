#!/usr/bin/env python3
"""Benchmark: how soon a used warm spare's successor can run a rank, forked vs importing torch.

Per mode (`fork`: from the node's fork server, `import`: a spare that imports torch itself, as
`FTRUN_SPARE_FORK=0`), a SparePool of one spare is filled, its spare taken (the fault that used
it), then the successor is started with `ensure()` and taken at once with a script that records
when it began: `ensure_s` is how long `ensure()` took, `job_start_s` the time from `ensure()`
to the successor's script running (its imports included when it has to do them), `cpu_s` the
CPU time the successor (and, for `fork`, nothing else: the server forks) used until then.
One JSON line per mode and repeat; modes alternate which goes first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from launcher.workers.spare import SparePool  # noqa: E402

JOB = (
    "import os, sys, time\n"
    "t = time.time()\n"
    "cpu = sum(os.times()[:2])\n"
    "open(sys.argv[1], 'w').write(f'{t} {cpu}')\n"
)


def measure(fork: bool, workdir: str) -> dict:
    pool = SparePool(sys.executable, lambda m: None, count=1, start_delay=0.0, fork=fork)
    env = dict(os.environ, PYTHONPATH=REPO)
    script = os.path.join(workdir, "job.py")
    with open(script, "w") as f:
        f.write(JOB)
    try:
        deadline = time.monotonic() + 120
        while pool.ready() < 1:
            if time.monotonic() > deadline:
                raise RuntimeError("the pool never had its spare")
            pool.ensure(env)
            time.sleep(0.02)
        used = pool.take(env, [script, os.path.join(workdir, "used")], module=False)
        assert used is not None and used.wait(timeout=120) == 0
        t0 = time.time()
        pool.ensure(env)
        ensure_s = time.time() - t0
        out = os.path.join(workdir, f"successor-{fork}")
        succ = pool.take(env, [script, out], module=False)
        if succ is None:
            raise RuntimeError("no successor after ensure()")
        code = succ.wait(timeout=120)
        started, cpu = (float(x) for x in open(out).read().split())
        return {
            "bench": "spare-successor",
            "mode": "fork" if fork else "import",
            "exit": code,
            "ensure_s": round(ensure_s, 4),
            "job_start_s": round(started - t0, 4),
            "cpu_s": round(cpu, 3),
        }
    finally:
        pool.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.repeat < 1:
        sys.exit(f"bench_spare: --repeat {args.repeat} must be >= 1")
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.repeat):
            for fork in (True, False) if i % 2 == 0 else (False, True):
                print(json.dumps(measure(fork, d)), flush=True)


if __name__ == "__main__":
    main()
