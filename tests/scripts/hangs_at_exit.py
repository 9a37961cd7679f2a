"""Test worker: a tiny launcher.runtime job in which --victim hangs at exit after its goodbye.

Every rank trains --steps steps (dies_after_peers.train) and calls rt.finish(); the others exit
0, the victim then blocks forever without using CPU or doing I/O (a teardown deadlock, as when a
process group is destroyed while its thread needs the GIL), having written $OUT_DIR/hung.<RANK>
first. Only generation 0's victim hangs."""

from __future__ import annotations

import argparse
import os
import sys
import threading

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from dies_after_peers import train  # noqa: E402  (the same tiny job; tests/scripts is sys.path[0])

import launcher.runtime as ftr  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--victim", type=int, default=1)
    a = ap.parse_args()
    rank = int(os.environ["RANK"])
    rt = ftr.init(backend="gloo")
    train(rt, a.steps, rank)
    rt.finish()
    if rank == a.victim and os.environ.get("FTRUN_GENERATION", "0") == "0":
        with open(os.path.join(os.environ["OUT_DIR"], f"hung.{rank}"), "w", encoding="utf-8") as f:
            f.write(str(os.getpid()))
        print(f"rank {rank}: said goodbye, now hanging at exit", flush=True)
        threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
