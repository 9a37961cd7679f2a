"""Fuzz: 100,000 random/truncated/absurd frames plus slowloris connections against the
server, while an unmodified torch client's ops must each finish within 100 ms."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import time

from helpers_store import FUZZER, STEADY_CLIENT, child_env

from rendezvous.store import protocol as P
from rendezvous.store.client import StoreClient
from rendezvous.store.server import StoreServer


def test_fuzz_and_slowloris_do_not_disturb_a_well_behaved_client() -> None:
    # The store's real host is the agent process, which never imports torch: ~18k objects, a full
    # garbage collection takes ~5 ms there. This pytest process carries torch, megatron and 600
    # tests' leftovers (~400k objects, a full collection ~250 ms, which once landed in a server turn
    # in CI). Freezing the heap for this test gives the server the agent's GC cost, not pytest's.
    gc.collect()
    gc.freeze()
    try:
        _fuzz_and_slowloris()
    finally:
        gc.unfreeze()


def test_the_agent_process_stays_small_for_the_garbage_collector() -> None:
    code = (
        "import gc, sys, time; import launcher.cli.ftrun; t = time.perf_counter(); gc.collect(); "
        "print('torch' in sys.modules, len(gc.get_objects()), time.perf_counter() - t)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    assert out[0] == "False", "the agent (store host) must not import torch"
    assert int(out[1]) < 100_000, out


def _fuzz_and_slowloris() -> None:
    logs: list[str] = []
    lim = P.Limits(max_value_bytes=1 << 20, stalled_frame_timeout=60.0)
    with StoreServer(host="127.0.0.1", limits=lim, log=logs.append) as s:
        # slowloris: silent connections, and connections dribbling a large frame
        silent = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(20)]
        dribble = []
        for _ in range(20):
            c = socket.create_connection(("127.0.0.1", s.port))
            c.sendall(
                P.handshake_bytes(1)
                + b"\x01"
                + (4).to_bytes(8, "little")
                + b"/slo"
                + (1 << 20).to_bytes(8, "little")
            )
            dribble.append(c)
        steady = subprocess.Popen(
            [sys.executable, "-c", STEADY_CLIENT, "127.0.0.1", str(s.port)],
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert s.kv.wait(["steady/ready"], 30.0), steady.stderr
        # The flood runs at low CPU priority: this box has 2 shared cores, and what is under
        # test is the server's fairness, not the kernel scheduler's.
        fuzz = subprocess.Popen(
            [sys.executable, "-c", FUZZER, "127.0.0.1", str(s.port), "100000", "7"],
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: os.nice(19),
        )
        deadline = time.monotonic() + 60
        while fuzz.poll() is None and time.monotonic() < deadline:
            for c in dribble:
                c.send(b"x")
            time.sleep(0.2)
        fout, ferr = fuzz.communicate(timeout=30)
        s.kv.set("stop", b"1")
        sout, serr = steady.communicate(timeout=30)
        assert fuzz.returncode == 0, ferr[-2000:]
        assert steady.returncode == 0, serr[-2000:]
        summary = json.loads(fout)
        client = json.loads(sout)
        assert summary["frames"] == 100000 and summary["bad"] > 1000
        assert client["ops"] > 100
        # Fair service: a turn does at most one budget (128 requests) per ready connection and
        # one more per connection left over (the backlog): with the flood's 8 connections up to
        # ~2000 requests. An ordinary request arriving mid-turn waits for the rest of that turn and
        # its place in the next: at most four flood turns' worth (a flood turn of ~1000 requests
        # is 15-40 ms of server CPU depending on the machine). The bound is that turn's cost as
        # measured in this run (server busy time per request), with 100 ms as the floor: a
        # server that let the flood starve the client, or a turn that did more than its budgets
        # (a collection over pytest's heap, an unbounded loop), fails.
        per_request = s.stats["busy_s"] / max(1, s.stats["requests"])
        flood_turn = (8 + 1) * s._budget * per_request
        bound_ms = max(100.0, 4 * flood_turn * 1000 + 20)
        print(
            f"server {per_request * 1e6:.1f} us/request, flood turn {flood_turn * 1000:.1f} ms, "
            f"client p99 {client['p99_ms']} ms (bound {bound_ms:.0f} ms), max {client['max_ms']} ms"
        )
        assert client["p99_ms"] < bound_ms and client["max_ms"] < 2000, (client, s.stats)
        # a turn's events and its backlog are two flood turns at most
        assert s.stats["max_turn_cpu_s"] < 3 * flood_turn + 0.02, (client, summary, s.stats)
        # the server is up, serving, and still holds the slowloris connections
        assert StoreClient("127.0.0.1", s.port, timeout=5).add("alive", 1) == 1
        assert s._thread.is_alive()
        assert s.connection_count() >= 40
        assert s.stats["dropped"] >= summary["bad"] * 0.9
        assert len(logs) == s.stats["dropped"]  # one line per closed connection
        for c in silent + dribble:
            c.close()
