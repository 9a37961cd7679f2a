"""StoreProxy: torch clients and gloo workers through it, coalescing, freshness, failures."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from helpers_etcd import EtcdServer, etcd_server  # noqa: F401 - fixture
from helpers_store import recv_exact, run_gloo_world, run_torch, run_torch_ops

from rendezvous.kv import StoreAuthError, StoreError
from rendezvous.store import protocol as P
from rendezvous.store.client import StoreClient
from rendezvous.store.memory import LocalKV
from rendezvous.store.proxy import StoreProxy
from rendezvous.store.server import StoreServer

TOKEN = "proxy-token"


@pytest.fixture
def stack():
    logs: list[str] = []
    with (
        StoreServer(host="127.0.0.1", token=TOKEN, log=logs.append) as s,
        StoreProxy(("127.0.0.1", s.port, TOKEN), log=logs.append) as px,
    ):
        s.logs = logs
        yield s, px


def raw_conn(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(P.handshake_bytes(3))
    assert s.recv(4) == P.enc_u32(3)
    return s


def test_torch_client_every_op_through_proxy(stack) -> None:
    s, px = stack
    r = run_torch_ops("127.0.0.1", px.port)
    assert "ALL-OPS-OK" in r.stdout, r.stdout + r.stderr[-3000:]
    assert s.kv.get("t/a", 1) == b"2" and s.logs == []


def test_gloo_workers_through_two_proxies(stack) -> None:
    s, px = stack
    with StoreProxy(("127.0.0.1", s.port, TOKEN)) as px2:
        outs = run_gloo_world("127.0.0.1", [px.port, px.port, px2.port, px2.port])
    assert all("sum=10 group_sum=4" in o for o in outs), outs
    assert s.connection_count() <= 3  # the master sees the proxies, not the ranks


def test_waits_and_adds_are_coalesced(stack) -> None:
    s, px = stack
    n = 40
    socks = [raw_conn(px.port) for _ in range(n)]
    before = px.upstream_requests
    for c in socks:
        c.sendall(P.encode_request(P.Request(P.Op.WAIT, (b"/go",))))
    time.sleep(0.3)
    assert px.upstream_requests - before == 1  # one upstream WAIT for 40 local waiters
    assert s.table.pending_waiters() == 1
    s.kv.set("go", b"1")
    for c in socks:
        assert c.recv(1) == b"\x00"
    before = px.upstream_requests
    for c in socks:  # 40 concurrent ADDs arrive together
        c.sendall(P.encode_request(P.Request(P.Op.ADD, (b"/cnt",), (), 1)))
    got = sorted(P.parse_reply(c.recv(8), 0, P.Reply.I64)[0] for c in socks)
    assert got == list(range(1, n + 1))  # every caller got a distinct, valid count
    assert s.kv.get("cnt", 1) == str(n).encode()
    assert px.upstream_requests - before < n
    for c in socks:
        c.close()


# timing-dependent (the 40 CHECKs must reach the proxy within one of its rounds; on main it merged
# 8-23 of 40 in 2 of 3 runs): out of the CI subset until it is made deterministic
@pytest.mark.slow
def test_identical_checks_are_coalesced_and_answered_fresh(stack) -> None:
    """Ranks polling one key (a round's repair plan) cost one upstream CHECK per round."""
    s, px = stack
    n = 40
    socks = [raw_conn(px.port) for _ in range(n)]
    check = P.encode_request(P.Request(P.Op.CHECK, (b"/repair",)))

    def poll_all() -> list[int]:
        for c in socks:
            c.sendall(check)
        return [P.parse_reply(c.recv(1), 0, P.Reply.U8)[0] for c in socks]

    before = px.upstream_requests
    assert poll_all() == [P.NOT_READY] * n
    assert px.upstream_requests - before < n // 2  # merged (a round holds many of them)
    s.kv.set("repair", b"plan")  # written behind the proxy's back: the next poll sees it
    assert poll_all() == [P.READY] * n
    for c in socks:  # a CHECK of other keys is not merged with it
        c.sendall(P.encode_request(P.Request(P.Op.CHECK, (b"/repair", b"/other"))))
    assert [P.parse_reply(c.recv(1), 0, P.Reply.U8)[0] for c in socks] == [P.NOT_READY] * n
    for c in socks:
        c.close()


def test_reads_are_never_stale(stack) -> None:
    s, px = stack
    stop = threading.Event()
    errors: list[str] = []

    def hammer() -> None:
        c = StoreClient("127.0.0.1", px.port, timeout=10)
        while not stop.is_set():
            c.try_get("k")

    readers = [threading.Thread(target=hammer) for _ in range(4)]
    for r in readers:
        r.start()
    writer = StoreClient("127.0.0.1", px.port, timeout=10)
    direct = StoreClient("127.0.0.1", s.port, token=TOKEN, timeout=10)
    for i in range(200):
        writer.set("k", str(i).encode())
        if writer.get("k", 5) != str(i).encode():
            errors.append(f"read-your-write {i}")
        direct.set("k2", str(i).encode())  # written behind the proxy's back
        if writer.get("k2", 5) != str(i).encode():
            errors.append(f"external write {i}")
    stop.set()
    for r in readers:
        r.join(10)
    assert errors == []


def test_cancelled_wait_releases_the_upstream_waiter(stack) -> None:
    s, px = stack
    c = StoreClient("127.0.0.1", px.port, timeout=10)
    assert c.wait(["never"], 0.2) is False
    deadline = time.monotonic() + 5
    while s.table.pending_waiters() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert s.table.pending_waiters() == 0
    assert c.add("n", 1) == 1  # the connection still works


def test_proxy_on_a_local_kv_upstream() -> None:
    logs: list[str] = []
    kv = LocalKV()
    with StoreProxy(kv, log=logs.append) as px:
        r = run_torch_ops("127.0.0.1", px.port, queues=False)
        assert "ALL-OPS-OK" in r.stdout, r.stdout + r.stderr[-3000:]
        assert kv.get("t/ap", 1) == b"xy"
        c = raw_conn(px.port)
        c.sendall(P.encode_request(P.Request(P.Op.QUEUE_LEN, (b"/q",))))
        assert c.recv(8) == b""  # closed
        assert logs[-1].endswith(
            "QUEUE_LEN failed upstream: QUEUE_LEN is not supported by a LocalKV upstream"
        )


@pytest.mark.etcd
def test_proxy_on_etcd(etcd_server: EtcdServer) -> None:  # noqa: F811
    from rendezvous.store.etcd import EtcdKV

    with StoreProxy(lambda: EtcdKV(etcd_server.endpoint, "/ftrun/proxytest")) as px:
        r = run_torch_ops("127.0.0.1", px.port, queues=False)
        assert "ALL-OPS-OK" in r.stdout, r.stdout + r.stderr[-3000:]
        outs = run_gloo_world("127.0.0.1", [px.port] * 2)
        assert all("sum=3 group_sum=2" in o for o in outs), outs


def test_upstream_failures_are_clear() -> None:
    with StoreServer(host="127.0.0.1", token=TOKEN) as s:
        with pytest.raises(StoreAuthError, match="refused the job token"):
            StoreProxy(("127.0.0.1", s.port, "wrong"), upstream_timeout=2).start()
        with pytest.raises(StoreError, match="closed the connection during the handshake"):
            StoreProxy(("127.0.0.1", s.port), upstream_timeout=2).start()
        port = s.port
    with pytest.raises(
        StoreError, match=f"cannot reach the store at 127.0.0.1:{port} within 0.3 s"
    ):
        StoreProxy(("127.0.0.1", port), upstream_timeout=0.3).start()


def test_upstream_loss_closes_waiting_clients_with_a_log_line() -> None:
    logs: list[str] = []
    s = StoreServer(host="127.0.0.1").start()
    with StoreProxy(("127.0.0.1", s.port), log=logs.append, upstream_timeout=0.5) as px:
        c = raw_conn(px.port)
        c.sendall(P.encode_request(P.Request(P.Op.WAIT, (b"/x",))))
        time.sleep(0.2)
        s.stop()
        c.settimeout(5)
        assert c.recv(1) == b""
        assert any("lost its upstream link" in ln for ln in logs)
        assert any("WAIT failed upstream" in ln for ln in logs)


# A torch client given a world size increments the counter "init/" (sent without the "/")
# on connect.
INIT_COUNTER = r"""
import sys
from datetime import timedelta
import torch.distributed as d
d.TCPStore("127.0.0.1", int(sys.argv[1]), world_size=2, is_master=False,
           timeout=timedelta(seconds=10))
print("CONNECTED", flush=True)
"""


def test_torch_init_counter_is_one_key_direct_and_through_a_kv_proxy() -> None:
    with StoreServer(host="127.0.0.1") as s, StoreProxy(s.kv) as px:
        for port in (s.port, px.port):
            r = run_torch(INIT_COUNTER, port)
            assert "CONNECTED" in r.stdout, r.stderr[-3000:]
        assert s.table.get(b"init/") == b"2"  # the same key, whichever way a client came
        assert s.kv.try_get("ftrun/wire/init/") == b"2"
        assert s.kv.keys("ftrun/wire/") == ["ftrun/wire/init/"]
        c = raw_conn(px.port)  # LIST_KEYS through the proxy names it as torch sent it
        c.sendall(P.encode_request(P.Request(P.Op.LIST_KEYS)))
        assert P.parse_reply(recv_exact(c, 8 + 8 + 5), 0, P.Reply.KEY_LIST) == ([b"init/"], 21)


def test_queue_pop_through_the_proxy_answers_as_torch_does(stack) -> None:
    s, px = stack
    c = raw_conn(px.port)
    for v in (b"a", b"b", b"c"):
        c.sendall(P.encode_request(P.Request(P.Op.QUEUE_PUSH, (b"/q",), (v,))))
    c.sendall(P.encode_request(P.Request(P.Op.QUEUE_POP, (b"/q",))))
    # torch's own server answers the queue length before the pop, then the value
    assert recv_exact(c, 17) == P.enc_queue_pop(3, b"a")


def test_a_write_without_reply_does_not_hold_back_later_batches(stack) -> None:
    s, px = stack
    c = StoreClient("127.0.0.1", px.port, timeout=10)
    c.append("ap", b"x")  # no reply comes back for it from the upstream
    assert c.add("n", 1) == 1
    assert px._inflight == 0  # else every later batch waits max_hold before it goes out
