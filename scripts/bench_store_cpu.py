#!/usr/bin/env python3
"""Benchmark: the store server's CPU per request, torch's libuv TCPStore master against ftrun's
server with its C read path and with its Python path only (`FTRUN_STORE_ACCEL=0`), in one run.

Where `bench_store.py` times the whole process-group init pattern (whose wall time on a small
machine is mostly the torch clients' CPU, and varies 15-40 % between runs), this measures what
the server alone spends: each server runs in its own process; this process holds `--conns`
raw TCPStore connections and drives `--rounds` rounds of the requests that dominate a
rendezvous, each connection one write per step (SET + ADD together, then a WAIT for a present
key, then a GET), and reads every reply. Reported per backend (one JSON line): server CPU
(on-CPU time of its threads, from schedstat) per request, the rounds' wall time, and the ratio
to torch; backends run interleaved `--repeat` times, the median kept.

Usage: python scripts/bench_store_cpu.py [--conns 64] [--rounds 200] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from bench_store import start_master, stop  # noqa: E402  (scripts/ is sys.path[0])

from rendezvous.store import protocol as P  # noqa: E402

BACKENDS = ("torch", "ftrun", "ftrun-python")


def start(kind: str) -> tuple[subprocess.Popen, int]:
    """bench_store's master for `kind`; ftrun-python is ftrun's with FTRUN_STORE_ACCEL=0."""
    if kind == "torch":
        return start_master("torch")
    os.environ["FTRUN_STORE_ACCEL"] = "0" if kind == "ftrun-python" else "1"
    return start_master("ftrun")


def cpu_seconds(pid: int) -> float:
    """On-CPU time of every live thread of `pid` (schedstat: ns, not 10 ms ticks)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total / 1e9


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        more = s.recv(n - len(buf))
        if not more:
            raise RuntimeError("the server closed the connection")
        buf += more
    return buf


def req(op: int, keys=(), values=(), num: int = 0) -> bytes:
    return P.encode_request(P.Request(op, tuple(keys), tuple(values), num))


def drive(port: int, conns: int, rounds: int) -> tuple[int, float]:
    socks = []
    for i in range(conns):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(P.handshake_bytes(i))
        assert recv_exact(s, 4) == P.enc_u32(i)
        socks.append(s)
    t0 = time.perf_counter()
    for r in range(rounds):
        value = b"value-%06d" % r
        for i, s in enumerate(socks):
            s.sendall(req(P.Op.SET, [b"/k%d" % i], [value]) + req(P.Op.ADD, [b"/cnt"], num=1))
        for s in socks:
            recv_exact(s, 8)
        for i, s in enumerate(socks):
            s.sendall(req(P.Op.WAIT, [b"/k%d" % i]))
        for s in socks:
            assert recv_exact(s, 1) == P.STOP_WAITING_REPLY
        for i, s in enumerate(socks):
            s.sendall(req(P.Op.GET, [b"/k%d" % ((i + 1) % conns)]))
        for s in socks:
            assert recv_exact(s, 8 + len(value))[8:] == value
    wall = time.perf_counter() - t0
    for s in socks:
        s.close()
    return rounds * conns * 4, wall


def one(kind: str, conns: int, rounds: int) -> dict:
    p, port = start(kind)
    try:
        drive(port, conns, 5)  # warm-up: connections, table, caches
        c0 = cpu_seconds(p.pid)
        n, wall = drive(port, conns, rounds)
        cpu = cpu_seconds(p.pid) - c0
    finally:
        stop(p)
    return {"requests": n, "server_cpu_s": cpu, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conns", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    if a.conns < 1 or a.rounds < 1 or a.repeat < 1:
        sys.exit("bench_store_cpu: --conns, --rounds and --repeat must be >= 1")
    runs: dict[str, list[dict]] = {k: [] for k in BACKENDS}
    for i in range(a.repeat):
        order = BACKENDS[i % 3 :] + BACKENDS[: i % 3]
        for kind in order:
            runs[kind].append(one(kind, a.conns, a.rounds))
    base = None
    for kind in BACKENDS:
        rs = runs[kind]
        us = statistics.median(r["server_cpu_s"] / r["requests"] * 1e6 for r in rs)
        out = {
            "backend": kind,
            "conns": a.conns,
            "requests": rs[0]["requests"],
            "runs": len(rs),
            "server_cpu_us_per_request": round(us, 2),
            "server_cpu_us_per_request_all": [
                round(r["server_cpu_s"] / r["requests"] * 1e6, 2) for r in rs
            ],
            "wall_s_median": round(statistics.median(r["wall_s"] for r in rs), 3),
        }
        if kind == "torch":
            base = us
        elif base:
            out["server_cpu_vs_torch"] = round(us / base, 3)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
