#!/usr/bin/env python3
"""Benchmark: the store's connect phase -- loop CPU and wall time while N torch C++ clients
connect (torch's `TCPStore(is_master=False)`: connect, VALIDATE, PING), torch's libuv master
against ftrun's server, rounds interleaved in one run.

Reuses `bench_store.py`'s clients and servers (and its NAME@PATH / NAME%N / NAME#LABEL backend
spellings); measures only the connect: the master's on-CPU time over all its threads
(schedstat) from "connect" to the last client's "connected", and that wall time. One JSON line
per backend and size: medians over the rounds, every round's CPU, and the ratios to torch.

Usage: python scripts/bench_store_connect.py [--sizes 64,256,1024] [--repeat 5]
       [--backends torch,ftrun,ftrun@/path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_store as B  # noqa: E402  (scripts/ is not a package)


def connect_round(kind: str, n: int) -> tuple[float, float, int]:
    """(connect wall s, master CPU s, client errors) of one round of `kind` with n clients."""
    setup = B.Setup(kind, n, B.client_procs(n))
    try:
        time.sleep(0.3)  # the clients' imports are over: the master is idle
        cpu0 = B.cpu_seconds(setup.master.pid)
        wall, errors, _ = B.client_phase(setup.clients, "connect", "connected")
        return wall, B.cpu_seconds(setup.master.pid) - cpu0, errors
    finally:
        setup.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64,256,1024")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--backends", default="torch,ftrun")
    a = ap.parse_args()
    sizes = B.parse_sizes(ap, "bench_store_connect", a.sizes)
    if a.repeat < 1:
        ap.exit(2, f"bench_store_connect: --repeat {a.repeat}: must be >= 1\n")
    kinds = list(dict.fromkeys(a.backends.split(",")))
    for kind in kinds:
        if B.split_kind(kind)[0] not in ("torch", "ftrun"):
            ap.exit(
                2,
                f"bench_store_connect: backend {kind!r}: only torch and ftrun (with "
                "@PATH, %N or #LABEL) are measured here\n",
            )
    print(
        json.dumps({"setup": "/etc/hosts", "line": B.HOSTS_LINE, "status": B.ensure_hosts_line()}),
        flush=True,
    )
    for n in sizes:
        runs: dict[str, list[tuple[float, float, int]]] = {k: [] for k in kinds}
        for kind in B.interleaved(kinds, a.repeat):
            runs[kind].append(connect_round(kind, n))
        rows = {}
        for kind, rs in runs.items():
            rows[kind] = {
                "backend": kind,
                "clients": n,
                "rounds": len(rs),
                "connect_s_median": round(statistics.median(r[0] for r in rs), 4),
                "master_cpu_connect_s_median": round(statistics.median(r[1] for r in rs), 4),
                "master_cpu_connect_s": [round(r[1], 4) for r in rs],
                "errors": sum(r[2] for r in rs),
            }
        base = rows.get("torch")
        for kind, r in rows.items():
            if base and kind != "torch":
                r["connect_median_vs_torch"] = round(
                    r["connect_s_median"] / base["connect_s_median"], 3
                )
                r["master_cpu_median_vs_torch"] = round(
                    r["master_cpu_connect_s_median"] / base["master_cpu_connect_s_median"], 3
                )
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
