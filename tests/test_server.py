"""StoreServer with real torch clients, gloo workers, raw sockets and limits."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from helpers_store import recv_exact, run_gloo_world, run_torch_ops

from rendezvous.kv import StoreError
from rendezvous.store import protocol as P
from rendezvous.store.client import StoreClient
from rendezvous.store.server import StoreServer


def raw_conn(port: int, handshake: bool = True) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    if handshake:
        s.sendall(P.handshake_bytes(7))
        assert recv_exact(s, 4) == P.enc_u32(7)
    return s


def is_closed(s: socket.socket, within: float = 3.0) -> bool:
    s.settimeout(within)
    try:
        while True:
            if not s.recv(4096):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


@pytest.fixture
def server():
    logs: list[str] = []
    s = StoreServer(host="127.0.0.1", log=logs.append)
    s.logs = logs
    with s:
        yield s


def test_torch_client_every_op(server: StoreServer) -> None:
    r = run_torch_ops("127.0.0.1", server.port)
    assert "ALL-OPS-OK" in r.stdout, r.stdout + r.stderr[-3000:]
    assert server.logs == []


def test_gloo_workers_through_server(server: StoreServer) -> None:
    outs = run_gloo_world("127.0.0.1", [server.port] * 3)
    assert all("sum=6 group_sum=3" in o for o in outs), outs


def test_port_in_use_names_host_and_port(server: StoreServer) -> None:
    with pytest.raises(
        StoreError, match=f"cannot listen on 127.0.0.1:{server.port}: address already in use"
    ):
        StoreServer(host="127.0.0.1", port=server.port).start()


def test_stop_is_idempotent_and_closes_clients() -> None:
    s = StoreServer(host="127.0.0.1").start()
    c = raw_conn(s.port)
    s.stop()
    s.stop()
    assert is_closed(c)
    with pytest.raises(StoreError, match="cannot connect"):
        StoreClient("127.0.0.1", s.port, timeout=0.3).set("x", b"1")


def test_kv_facade_shares_the_table_and_wakes_wire_waiters(server: StoreServer) -> None:
    c = raw_conn(server.port)
    c.sendall(P.encode_request(P.Request(P.Op.WAIT, (b"/from/kv",))))
    time.sleep(0.1)
    threading.Thread(target=server.kv.set, args=("from/kv", b"v")).start()
    assert recv_exact(c, 1) == b"\x00"
    c.sendall(P.encode_request(P.Request(P.Op.GET, (b"/from/kv",))))
    assert recv_exact(c, 9) == P.enc_bytes(b"v")
    c.sendall(P.encode_request(P.Request(P.Op.SET, (b"/from/wire",), (b"w",))))
    assert server.kv.get("from/wire", 2.0) == b"w"


def test_fan_out_to_a_thousand_waiters(server: StoreServer) -> None:
    socks = [raw_conn(server.port) for _ in range(1000)]
    for s in socks:
        s.sendall(P.encode_request(P.Request(P.Op.WAIT, (b"/go",))))
    deadline = time.monotonic() + 10
    while server.table.pending_waiters() < 1000 and time.monotonic() < deadline:
        time.sleep(0.01)
    t = time.perf_counter()
    server.kv.set("go", b"1")
    for s in socks:
        assert recv_exact(s, 1) == b"\x00"
    assert time.perf_counter() - t < 2.0
    for s in socks:
        s.close()


def _wait_values(keys: tuple) -> bytes:
    return P.encode_request(P.Request(P.Op.FT_WAIT_VALUES, keys))


def _values_reply(*values: bytes) -> bytes:
    return P.STOP_WAITING_REPLY + b"".join(P.enc_bytes(v) for v in values)


@pytest.mark.parametrize("accel", [True, False])
def test_the_capability_ping_and_every_other_ping(accel: bool) -> None:
    """The handshake's PING with CAPS_NONCE is answered with the extension bits (C read path
    or not); every other nonce (torch's: its pid) is echoed."""
    with StoreServer(host="127.0.0.1", accel=accel) as srv:
        s = raw_conn(srv.port, handshake=False)
        s.sendall(P.handshake_bytes(P.CAPS_NONCE))
        assert recv_exact(s, 4) == P.enc_u32(P.CAPS_NONCE ^ P.CAP_WAIT_VALUES)
        s.sendall(P.encode_request(P.Request(P.Op.PING, num=os.getpid())))
        assert recv_exact(s, 4) == P.enc_u32(os.getpid())
        s.close()


def test_fan_out_of_a_value_to_a_thousand_waiters(server: StoreServer) -> None:
    """FT_WAIT_VALUES: each waiter's wake-up carries the value (one reply per waiter); a key
    present already is answered at once; a write through the C read path (a torch client's
    SET) and one of another thread (LocalKV) both wake them."""
    socks = [raw_conn(server.port) for _ in range(1000)]
    for s in socks:
        s.sendall(_wait_values((b"/plan",)))
    deadline = time.monotonic() + 10
    while server.table.pending_waiters() < 1000 and time.monotonic() < deadline:
        time.sleep(0.01)
    t = time.perf_counter()
    writer = raw_conn(server.port)
    writer.sendall(P.encode_request(P.Request(P.Op.SET, (b"/plan",), (b"p" * 300,))))
    want = _values_reply(b"p" * 300)
    for s in socks:
        assert recv_exact(s, len(want)) == want
    assert time.perf_counter() - t < 2.0
    socks[0].sendall(_wait_values((b"/plan", b"/plan")))
    assert recv_exact(socks[0], 1 + 2 * 308) == _values_reply(b"p" * 300, b"p" * 300)
    socks[1].sendall(_wait_values((b"/next",)))
    time.sleep(0.1)
    server.kv.set("next", b"n")
    assert recv_exact(socks[1], 10) == _values_reply(b"n")
    for s in socks + [writer]:
        s.close()


def test_wait_values_cancel_and_mux_tags(server: StoreServer) -> None:
    """A cancelled FT_WAIT_VALUES is answered WAIT_CANCELED alone and the connection goes on;
    on a mux connection the values come under the wait's tag."""
    s = raw_conn(server.port)
    s.sendall(_wait_values((b"/x",)))
    time.sleep(0.1)
    s.sendall(bytes((P.Op.CANCEL_WAIT,)))
    assert recv_exact(s, 1) == P.WAIT_CANCELED_REPLY
    assert server.table.pending_waiters() == 0
    s.sendall(P.encode_request(P.Request(P.Op.GET, (b"/x",))))
    assert recv_exact(s, 8) == P.enc_bytes(b"")
    m = raw_conn(server.port)
    m.sendall(bytes((P.Op.FT_MUX,)) + P.enc_u32(P.MUX_MAGIC))
    assert recv_exact(m, 4) == P.enc_u32(P.MUX_MAGIC)
    m.sendall(P.encode_mux_request(5, P.Request(P.Op.FT_WAIT_VALUES, (b"/x",))))
    server.kv.set("x", b"v")
    assert recv_exact(m, 4 + 10) == P.enc_u32(5) + _values_reply(b"v")
    s.close()
    m.close()


def test_malformed_and_stalled_clients_do_not_delay_others(server: StoreServer) -> None:
    stalled = raw_conn(server.port)
    stalled.sendall(P.encode_request(P.Request(P.Op.SET, (b"/k",), (b"x" * 1000,)))[:30])
    bad = raw_conn(server.port)
    bad.sendall(b"\x63garbage")
    noval = raw_conn(server.port, handshake=False)
    noval.sendall(P.encode_request(P.Request(P.Op.GET, (b"/k",))))
    nonreader = raw_conn(server.port)
    nonreader.sendall(P.encode_request(P.Request(P.Op.WAIT, (b"/never",))))
    good = StoreClient("127.0.0.1", server.port, timeout=5)
    for i in range(50):
        t = time.perf_counter()
        good.set(f"g{i}", b"v")
        assert good.get(f"g{i}", 1.0) == b"v"
        assert time.perf_counter() - t < 0.1
    assert is_closed(bad) and is_closed(noval)
    assert not is_closed(stalled, within=0.2)
    assert any("unknown query type 99" in line for line in server.logs)
    assert any("expected VALIDATE" in line for line in server.logs)


def test_limits_close_with_one_log_line() -> None:
    logs: list[str] = []
    lim = P.Limits(max_key_bytes=16, max_value_bytes=64, max_keys_per_request=4, max_connections=3)
    with StoreServer(host="127.0.0.1", limits=lim, log=logs.append) as s:
        c = raw_conn(s.port)
        c.sendall(P.encode_request(P.Request(P.Op.GET, (b"/" + b"k" * 40,))))
        assert is_closed(c)
        c = raw_conn(s.port)
        c.sendall(P.encode_request(P.Request(P.Op.SET, (b"/k",), (b"v" * 65,))))
        assert is_closed(c)
        c = raw_conn(s.port)
        c.sendall(P.encode_request(P.Request(P.Op.WAIT, tuple(b"/%d" % i for i in range(5)))))
        assert is_closed(c)
        assert [ln.split(": ", 1)[1] for ln in logs] == [
            "key of 41 bytes: at most 16 allowed",
            "value of 65 bytes: at most 64 allowed",
            "request with 5 keys: at most 4 allowed",
        ]
        held = [raw_conn(s.port) for _ in range(3)]
        extra = socket.create_connection(("127.0.0.1", s.port), timeout=5)
        assert is_closed(extra)
        assert "3 connections open (max_connections)" in logs[-1]
        for h in held:
            h.close()
        time.sleep(0.2)
        assert StoreClient("127.0.0.1", s.port, timeout=5).add("n", 1) == 1


def test_handshake_timeout_closes_silent_connections() -> None:
    logs: list[str] = []
    lim = P.Limits(handshake_timeout=0.3)
    with StoreServer(host="127.0.0.1", limits=lim, log=logs.append) as s:
        c = socket.create_connection(("127.0.0.1", s.port), timeout=5)
        assert is_closed(c, within=4.0)
        assert "no VALIDATE within 0.3 s" in logs[0]


def test_non_integer_add_closes_that_connection_only(server: StoreServer) -> None:
    c = StoreClient("127.0.0.1", server.port, timeout=5)
    c.set("s", b"text")
    with pytest.raises(StoreError, match="closed the connection"):
        c.add("s", 1)
    assert c.add("n", 2) == 2  # reconnects
    assert "not a decimal integer" in server.logs[-1]


def test_mux_connection_runs_waits_concurrently(server: StoreServer) -> None:
    c = raw_conn(server.port)
    c.sendall(bytes((P.Op.FT_MUX,)) + P.enc_u32(P.MUX_MAGIC))
    assert recv_exact(c, 4) == P.enc_u32(P.MUX_MAGIC)
    c.sendall(
        P.encode_mux_request(1, P.Request(P.Op.WAIT, (b"/a",)))
        + P.encode_mux_request(2, P.Request(P.Op.WAIT, (b"/b",)))
        + P.encode_mux_request(3, P.Request(P.Op.ADD, (b"/n",), (), 4))
    )
    assert recv_exact(c, 12) == P.enc_u32(3) + P.enc_i64(4)
    server.kv.set("b", b"1")
    assert recv_exact(c, 5) == P.enc_u32(2) + b"\x00"
    c.sendall(P.encode_mux_request(4, P.Request(P.Op.CANCEL_WAIT, num=1)))
    assert recv_exact(c, 5) == P.enc_u32(4) + b"\x01"
    assert server.table.pending_waiters() == 0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="port=70000"):
        StoreServer(port=70000)
    with pytest.raises(ValueError, match="max_connections=0"):
        P.Limits(max_connections=0)


def test_pipelined_burst_and_byte_by_byte_give_the_same_replies(server: StoreServer) -> None:
    reqs = []
    for i in range(50):
        k = b"/p%d" % (i % 7)
        reqs += [
            P.Request(P.Op.SET, (k,), (b"v%d" % i,)),
            P.Request(P.Op.ADD, (b"/pc",), (), 2),
            P.Request(P.Op.GET, (k,)),
            P.Request(P.Op.WAIT, (k,)),
            P.Request(P.Op.CHECK, (k, b"/none")),
            P.Request(P.Op.PING, num=i),
            P.Request(P.Op.CHECK, (k,)),
        ]
    raw = b"".join(P.encode_request(r) for r in reqs)
    expect = b""
    for i in range(50):
        expect += (
            P.enc_i64(2 * (i + 1))
            + P.enc_bytes(b"v%d" % i)
            + b"\x00"
            + b"\x01"
            + P.enc_u32(i)
            + b"\x00"
        )
    burst = raw_conn(server.port)
    burst.sendall(raw)
    assert recv_exact(burst, len(expect)) == expect
    server.kv.delete("pc")
    slow = raw_conn(server.port)
    slow.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for i in range(0, len(raw), 7):
        slow.sendall(raw[i : i + 7])
    assert recv_exact(slow, len(expect)) == expect


def _frames_for_quick_path() -> list[bytes]:
    """Frames the quick path executes (GET, SET, ADD, a satisfied one-key WAIT) and frames
    it must hand to the general path (missing WAIT key, multi-key WAIT, CHECK, non-counter
    ADD, the auth key, an over-limit key), interleaved."""

    def req(op, keys=(), values=(), num=0):
        return P.encode_request(P.Request(op, tuple(keys), tuple(values), num))

    k, cnt, q = b"/k", b"/cnt", b"/q"
    return [
        req(P.Op.GET, [k]),  # missing: empty value
        req(P.Op.SET, [k], [b"v1"]),
        req(P.Op.GET, [k]),
        req(P.Op.ADD, [cnt], num=5),
        req(P.Op.ADD, [cnt], num=-2),
        req(P.Op.WAIT, [k]),  # present
        req(P.Op.WAIT, [k, cnt]),  # two keys: general path
        req(P.Op.CHECK, [k]),
        req(P.Op.QUEUE_PUSH, [q], [b"x"]),
        req(P.Op.WAIT, [q]),  # a queue key: general path
        req(P.Op.SET, [k], [b""]),
        req(P.Op.GET, [k]),
        req(P.Op.WAIT, [b"/absent"]),  # registers a waiter: no reply now
        req(P.Op.SET, [b"/absent"], [b"here"]),
    ]


@pytest.mark.parametrize("entry", ["consume", "read"])
@pytest.mark.parametrize("chunk", [0, 1, 7])
def test_quick_path_gives_the_general_paths_replies(chunk: int, entry: str) -> None:
    """The in-place decoder (StoreServer._quick) answers exactly as the general path does,
    whole bursts and byte-by-byte, fed to the request loop directly (`_consume`) or read from
    the socket (`_read`, which answers a lone quick request itself)."""
    stream = b"".join(_frames_for_quick_path())
    seen = []
    for quick in (True, False):
        srv = StoreServer(host="127.0.0.1")
        srv._read_quick = None  # the Python paths; the C read path: test_quickstore.py
        if not quick:
            srv._quick = None
        a, b = socket.socketpair()
        try:
            from rendezvous.store.connection import Conn

            c = Conn(a, "test", True, 0.0)
            c.validated = True
            srv._loop_ident = threading.get_ident()
            pieces = (
                [stream]
                if chunk == 0
                else [stream[i : i + chunk] for i in range(0, len(stream), chunk)]
            )
            for p in pieces:
                if entry == "read":
                    b.sendall(p)
                    srv._read(c)
                else:
                    srv._consume(c, p)
            srv._flush_dirty()
            b.setblocking(False)  # a socketpair: what was sent is readable at once
            got = b""
            while True:
                try:
                    more = b.recv(65536)
                except BlockingIOError:
                    break
                if not more:
                    break
                got += more
            seen.append((got, dict(srv.table._data)))
        finally:
            a.close()
            b.close()
    assert seen[0] == seen[1]
    assert seen[0][1][b"/cnt"] == b"3"


def test_quick_path_leaves_auth_and_bad_counters_to_the_general_path() -> None:
    """The auth key is never stored through the quick path, and an ADD to a non-counter still
    closes that connection with the general path's log line."""
    logs: list[str] = []
    with StoreServer(host="127.0.0.1", log=logs.append) as srv:
        s = raw_conn(srv.port)
        s.sendall(P.encode_request(P.Request(P.Op.SET, (b"/s",), (b"text",))))
        s.sendall(P.encode_request(P.Request(P.Op.ADD, (b"/s",), (), 1)))
        assert is_closed(s)
        assert any("ADD failed" in line for line in logs), logs
        s2 = raw_conn(srv.port)
        from rendezvous.store.auth import AUTH_KEY

        s2.sendall(P.encode_request(P.Request(P.Op.SET, (AUTH_KEY,), (b"tok",))))
        s2.sendall(P.encode_request(P.Request(P.Op.GET, (AUTH_KEY,))))
        assert recv_exact(s2, 8) == P.enc_u32(0) * 2  # empty: the key was not stored
        s2.close()


@pytest.mark.parametrize("op", ["wait", "wait-values"])
def test_cancel_after_a_queued_wakeup_keeps_the_reply_stream_in_order(op: str) -> None:
    """A WAIT fired by a write of another thread (the hosting agent's LocalKV) queues its
    STOP_WAITING for the loop; a CANCEL_WAIT the client sent at the same moment (its wait slice
    ran out) must be answered STOP_WAITING then WAIT_CANCELED, with nothing left over. Before,
    the queued STOP_WAITING came after WAIT_CANCELED, and the client's next request read it as
    its own reply (an agent joining a rendezvous hung: CI failure of
    test_scale_up_restart_grows_the_world_with_a_late_node). The same for FT_WAIT_VALUES, whose
    queued wake-up carries the values."""
    from rendezvous.store.connection import Conn

    if op == "wait":
        request, woken = P.encode_request(P.Request(P.Op.WAIT, (b"/world",))), P.STOP_WAITING_REPLY
    else:
        request, woken = _wait_values((b"/world",)), _values_reply(b"w")
    srv = StoreServer(host="127.0.0.1")
    a, b = socket.socketpair()
    try:
        c = Conn(a, "test", True, 0.0)
        c.validated = True
        srv._loop_ident = -1  # this thread is "another thread": wake-ups are queued
        srv._wake_fd = os.eventfd(0, os.EFD_NONBLOCK)
        srv._consume(c, request)
        srv.kv.set("world", b"w")  # fires the waiter from "another thread": queued
        assert srv._xq, "the wake-up should be queued for the loop"
        srv._consume(c, bytes((P.Op.CANCEL_WAIT,)))
        srv._drain_xq()
        srv._flush_dirty()
        b.setblocking(False)
        got = b.recv(100)
        assert got == woken + P.WAIT_CANCELED_REPLY, got
        srv._consume(c, P.encode_request(P.Request(P.Op.GET, (b"/world",))))
        assert b.recv(100) == P.enc_bytes(b"w")
    finally:
        os.close(srv._wake_fd)
        srv._wake_fd = -1
        a.close()
        b.close()


def _pair_conn(srv: StoreServer):
    """A validated plain connection of `srv` over a socketpair: (conn, the client's end)."""
    from rendezvous.store.connection import Conn

    a, b = socket.socketpair()
    a.setblocking(False)
    b.settimeout(5)
    c = Conn(a, "test", True, 0.0)
    c.validated = True
    srv._conns[c.fd] = c
    return c, b


def test_read_runs_each_request_of_a_burst_once() -> None:
    """`_read` executes a lone quick request itself; when more follow in the same read, the
    first (already executed) is answered first and only the rest go to the request loop (an
    ADD executed twice would make the counter 3)."""
    srv = StoreServer(host="127.0.0.1")
    srv._loop_ident = threading.get_ident()
    c, b = _pair_conn(srv)
    add = P.encode_request(P.Request(P.Op.ADD, (b"/n",), (), 1))
    b.sendall(add + add + P.encode_request(P.Request(P.Op.GET, (b"/n",))))
    srv._read(c)
    srv._flush_dirty()
    assert recv_exact(b, 8 + 8 + 9) == P.enc_i64(1) + P.enc_i64(2) + P.enc_bytes(b"2")
    b.sendall(add)
    srv._read(c)
    assert recv_exact(b, 8) == P.enc_i64(3)
    assert srv.table.get(b"/n") == b"3"
    assert srv.stats["requests"] == 4
    c.sock.close()
    b.close()


def test_wakeups_are_sent_by_the_write_that_satisfies_them() -> None:
    """A SET that satisfies waiters sends each STOP_WAITING at once, in the loop over the
    waiters (as libuv's server does), not after the rest of the loop turn; a waiter whose
    connection still has output queued gets it behind that output."""
    srv = StoreServer(host="127.0.0.1")
    srv._loop_ident = threading.get_ident()
    waiters = [_pair_conn(srv) for _ in range(5)]
    wait = P.encode_request(P.Request(P.Op.WAIT, (b"/all",)))
    for c, b in waiters:
        b.sendall(wait)
        srv._read(c)
        assert c.waiter is not None
    queued, qb = waiters[0]
    queued.out.append(b"Q")  # output that is not sent yet: the wake-up must come after it
    setter, sb = _pair_conn(srv)
    sb.sendall(P.encode_request(P.Request(P.Op.SET, (b"/all",), (b"1",))))
    srv._read(setter)
    for c, b in waiters[1:]:  # no end-of-turn flush: already sent
        assert recv_exact(b, 1) == P.STOP_WAITING_REPLY
        assert c.waiter is None
    srv._flush_dirty()
    assert recv_exact(qb, 2) == b"Q" + P.STOP_WAITING_REPLY


def test_waiters_leave_no_garbage_cycles() -> None:
    """A fired or cancelled waiter is freed by reference counting (its callback does not
    refer back to it), so a rendezvous of thousands of waits gives the cyclic garbage
    collector nothing to find."""
    import gc

    from rendezvous.store.memory import Waiter

    def waiters() -> int:
        return sum(1 for o in gc.get_objects() if type(o) is Waiter)

    srv = StoreServer(host="127.0.0.1")
    srv._loop_ident = threading.get_ident()
    conns = [_pair_conn(srv) for _ in range(3)]
    gc.collect()
    gc.disable()
    try:
        before = waiters()
        for c, b in conns:
            b.sendall(P.encode_request(P.Request(P.Op.WAIT, (b"/k",))))
            srv._read(c)
        assert waiters() == before + 3
        srv.table.set(b"/k", b"v")
        srv._flush_dirty()
        for c, b in conns:
            assert recv_exact(b, 1) == P.STOP_WAITING_REPLY
        assert waiters() == before
        c, b = conns[2]
        b.sendall(P.encode_request(P.Request(P.Op.WAIT, (b"/other",))))
        srv._read(c)
        b.sendall(bytes((P.Op.CANCEL_WAIT,)))
        srv._read(c)
        srv._flush_dirty()
        assert recv_exact(b, 1) == P.WAIT_CANCELED_REPLY
        assert waiters() == before
    finally:
        gc.enable()
