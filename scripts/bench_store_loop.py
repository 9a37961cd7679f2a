#!/usr/bin/env python3
"""Micro-benchmark: the store server's cost per request in its read path, without torch.

Drives `StoreServer._read` over N socketpairs in one thread (no loop thread, no clients to
schedule): every round each pair sends one frame, the server reads and answers every ready
connection, the time of that part is kept (best of `--rounds`). Reported per op, in µs per
request, beside `floor` (a bare recv + send per connection: the syscalls alone), so the
difference is the server's own (Python) work. `wait_wake` is a WAIT of a missing key plus its
wake-up by one SET (two syscalls per waiter, as `floor`). Run it with `--repo` on another
checkout for a before/after: `--repo /path/to/old` imports that checkout's `rendezvous`.

Usage: python scripts/bench_store_loop.py [--conns 256] [--rounds 40] [--repo PATH]
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conns", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--repo", default=REPO, help="checkout whose rendezvous package to time")
    a = ap.parse_args()
    if a.conns < 1 or a.rounds < 1:
        sys.exit("bench_store_loop: --conns and --rounds must be >= 1")
    if not os.path.isdir(os.path.join(a.repo, "rendezvous")):
        sys.exit(f"bench_store_loop: {a.repo} has no rendezvous package")
    sys.path.insert(0, os.path.abspath(a.repo))
    from rendezvous.store import protocol as P
    from rendezvous.store.connection import Conn
    from rendezvous.store.server import StoreServer

    srv = StoreServer(host="127.0.0.1")
    srv._ep = select.epoll()
    srv._loop_ident = threading.get_ident()
    pairs = []
    for _ in range(a.conns):
        s, peer = socket.socketpair()
        s.setblocking(False)
        c = Conn(s, "bench", True, 0.0)
        c.validated = True
        srv._conns[c.fd] = c
        srv._ep.register(c.fd, select.EPOLLIN)
        pairs.append((c, peer))
    srv.table.set(b"/uid", b"u" * 128)

    def frame(op: int, keys: tuple, values: tuple = (), num: int = 0) -> bytes:
        return P.encode_request(P.Request(op, keys, values, num))

    frames = {
        "get": frame(P.Op.GET, (b"/uid",)),
        "add": frame(P.Op.ADD, (b"/count",), (), 1),
        "set": frame(P.Op.SET, (b"/rank/17",), (b"10.0.0.1:30017",)),
        "wait_present": frame(P.Op.WAIT, (b"/uid",)),
    }

    def serve_ready() -> None:
        for fd, _ in srv._ep.poll(0):
            srv._read(srv._conns[fd])
        if srv._dirty:
            srv._flush_dirty()

    def drain() -> None:
        for _, peer in pairs:
            peer.recv(4096)

    def timed(op: str) -> float:
        best = float("inf")
        for r in range(a.rounds):
            if op == "wait_wake":
                data = frame(P.Op.WAIT, (b"/w%d" % r,))
            else:
                data = frames["get" if op == "floor" else op]
            for _, peer in pairs:
                peer.send(data)
            t0 = time.perf_counter()
            if op == "floor":
                for fd, _ in srv._ep.poll(0):
                    sock = srv._conns[fd].sock
                    sock.recv(P.READ_SIZE)
                    sock.send(P.STOP_WAITING_REPLY)
            else:
                serve_ready()
                if op == "wait_wake":
                    srv.table.set(b"/w%d" % r, b"1")
                    if srv._dirty:
                        srv._flush_dirty()
            best = min(best, time.perf_counter() - t0)
            if op != "set":
                drain()
        return round(best / a.conns * 1e6, 3)

    out = {"repo": os.path.abspath(a.repo), "conns": a.conns, "rounds": a.rounds, "unit": "us"}
    for op in ("floor", "get", "add", "set", "wait_present", "wait_wake"):
        out[op] = timed(op)
    for _, peer in pairs:
        peer.close()
    for c, _ in pairs:
        c.sock.close()
    srv._ep.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
