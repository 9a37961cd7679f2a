"""The store server's C read path (rendezvous/_quickstore.c): the same replies and table as
the Python paths, nothing executed while another thread holds the table's lock, writes that
wake waiters left to Python, large replies finished by the Python flush, and the switch."""
from __future__ import annotations

import select
import socket
import threading
import time

import pytest

from helpers_store import recv_exact
from rendezvous import protocol as P
from rendezvous.auth import AUTH_KEY
from rendezvous.server import StoreServer, _Conn


def req(op, keys=(), values=(), num=0) -> bytes:
    return P.encode_request(P.Request(op, tuple(keys), tuple(values), num))


def frames() -> list[bytes]:
    """What the C path executes and what it must hand over, interleaved."""
    k, cnt = b"/k", b"/cnt"
    return [
        req(P.Op.GET, [k]),  # missing: empty value
        req(P.Op.SET, [k], [b"v1"]), req(P.Op.GET, [k]),
        req(P.Op.ADD, [cnt], num=5), req(P.Op.ADD, [cnt], num=-9),
        req(P.Op.WAIT, [k]), req(P.Op.WAIT, [k, cnt]), req(P.Op.CHECK, [k, cnt]),
        req(P.Op.CHECK, [k, b"/absent"]),  # not ready: Python (queues count as present)
        req(P.Op.QUEUE_PUSH, [b"/q"], [b"x"]), req(P.Op.WAIT, [b"/q"]), req(P.Op.CHECK, [b"/q"]),
        req(P.Op.SET, [b"/plus"], [b" +7 "]), req(P.Op.ADD, [b"/plus"], num=1),  # int() spelling
        req(P.Op.SET, [b"/big"], [b"9223372036854775806"]), req(P.Op.ADD, [b"/big"], num=1),
        req(P.Op.ADD, [b"/big"], num=-3),  # 19 digits: Python
        req(P.Op.SET, [AUTH_KEY], [b"tok"]), req(P.Op.GET, [AUTH_KEY]),  # never stored
        req(P.Op.SET, [b"/v"], [bytes(range(256)) * 300]), req(P.Op.GET, [b"/v"]),
        req(P.Op.PING, num=3), req(P.Op.SET, [k], [b""]), req(P.Op.GET, [k]),
        req(P.Op.WAIT, [b"/later"]),  # registers a waiter: no reply now
        req(P.Op.SET, [b"/later"], [b"here"]),  # watched: Python wakes the waiter
        req(P.Op.ADD, [cnt], num=1),
    ]


def run_stream(mode: str, chunk: int, handshake: bool = False) -> tuple[bytes, dict]:
    """Feed the frames through `_read` of a server on one end of a socketpair; the replies
    read at the other end and the table. `handshake`: a new connection, the frames behind
    torch's VALIDATE + PING."""
    srv = StoreServer(host="127.0.0.1")
    if mode != "c":
        srv._read_quick = None
    if mode == "general":
        srv._quick = None
    stream = (P.handshake_bytes(9) if handshake else b"") + b"".join(frames())
    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        c = _Conn(a, "test", True, 0.0)
        c.validated = not handshake
        srv._ep = select.epoll()
        srv._conns[c.fd] = c
        srv._ep.register(c.fd, 1)
        srv._loop_ident = threading.get_ident()
        pieces = [stream] if chunk == 0 else [stream[i:i + chunk]
                                              for i in range(0, len(stream), chunk)]
        got = b""
        b.setblocking(False)
        for p in pieces:
            b.sendall(p)
            while select.select([a], [], [], 0)[0] and not c.closed:
                srv._read(c)
            while srv._backlog:
                backlog, srv._backlog = srv._backlog, []
                for x in backlog:
                    srv._consume(x, b"")
            srv._flush_dirty()
            while True:
                try:
                    more = b.recv(1 << 20)
                except BlockingIOError:
                    break
                got += more
        assert c.validated and not c.closed
        return got, dict(srv.table._data)
    finally:
        srv._ep.close()
        a.close()
        b.close()


def test_the_extension_is_built_and_a_default_server_uses_it() -> None:
    """Installs run setup.py, which builds it; a missing compiler leaves the Python path."""
    from rendezvous import _quickstore  # noqa: F401
    assert StoreServer(host="127.0.0.1")._read_quick is not None


@pytest.mark.parametrize("handshake", [False, True], ids=["validated", "handshake"])
@pytest.mark.parametrize("chunk", [0, 1, 5, 64, 4096])
def test_same_replies_and_table_as_the_python_paths(chunk: int, handshake: bool) -> None:
    results = {mode: run_stream(mode, chunk, handshake) for mode in ("c", "python", "general")}
    assert results["c"] == results["python"] == results["general"]
    replies, table = results["c"]
    assert table[b"/cnt"] == b"-3" and table[b"/plus"] == b"8" and AUTH_KEY not in table
    assert table[b"/big"] == b"9223372036854775804" and table[b"/later"] == b"here"
    assert replies.endswith(P.enc_i64(-3)) and P.STOP_WAITING_REPLY in replies


@pytest.mark.parametrize("first", [
    req(P.Op.GET, [b"/k"]),  # not a VALIDATE
    req(P.Op.VALIDATE, num=0x12345678),  # the wrong magic
    req(P.Op.PING, num=1),
], ids=["get", "magic", "ping"])
def test_a_bad_handshake_is_refused_as_the_python_path_refuses_it(first: bytes) -> None:
    logs: list[str] = []
    with StoreServer(host="127.0.0.1", log=logs.append) as srv:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        s.sendall(first + req(P.Op.PING, num=2))
        assert s.recv(16) == b""  # closed, nothing answered
        s.close()
        good = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        good.sendall(P.handshake_bytes(3) + req(P.Op.ADD, [b"/n"], num=1))
        assert recv_exact(good, 12) == P.enc_u32(3) + P.enc_i64(1)
        good.close()
    assert len(logs) == 1 and ("expected VALIDATE" in logs[0] or "expected 0x3c85f7ce" in logs[0]), logs


def test_nothing_executes_while_another_thread_holds_the_tables_lock() -> None:
    """A LocalKV write may be between its read and its write (ADD) with the lock held; the C
    path must not run its own read-modify-write in between."""
    with StoreServer(host="127.0.0.1") as srv:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        s.sendall(P.handshake_bytes(1))
        assert recv_exact(s, 4) == P.enc_u32(1)
        srv.table._lock.acquire()
        try:
            s.sendall(req(P.Op.ADD, [b"/n"], num=2))
            time.sleep(0.3)
            assert b"/n" not in srv.table._data
        finally:
            srv.table._lock.release()
        assert recv_exact(s, 8) == P.enc_i64(2)
        s.sendall(req(P.Op.ADD, [b"/n"], num=3) + req(P.Op.GET, [b"/n"]))
        assert recv_exact(s, 17) == P.enc_i64(5) + P.enc_bytes(b"5")
        s.close()


def test_a_set_that_satisfies_a_waiter_wakes_it() -> None:
    with StoreServer(host="127.0.0.1") as srv:
        conns = []
        for i in range(2):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            s.sendall(P.handshake_bytes(i))
            assert recv_exact(s, 4) == P.enc_u32(i)
            conns.append(s)
        waiter, writer = conns
        waiter.sendall(req(P.Op.WAIT, [b"/go"]))
        deadline = time.monotonic() + 5
        while not srv.table._waiters and time.monotonic() < deadline:
            time.sleep(0.01)
        writer.sendall(req(P.Op.SET, [b"/go"], [b"1"]) + req(P.Op.GET, [b"/go"]))
        assert recv_exact(writer, 9) == P.enc_bytes(b"1")
        assert recv_exact(waiter, 1) == P.STOP_WAITING_REPLY
        for s in conns:
            s.close()


def test_a_reply_larger_than_the_socket_buffer_arrives_whole() -> None:
    """The C path's one send() is short; the Python flush sends the rest when writable."""
    value = bytes(range(256)) * (24 * 1024 * 4)  # 24 MiB
    with StoreServer(host="127.0.0.1") as srv:
        srv.kv.set("huge", value)
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        s.sendall(P.handshake_bytes(5))
        assert recv_exact(s, 4) == P.enc_u32(5)
        s.sendall(req(P.Op.GET, [b"/huge"]) + req(P.Op.ADD, [b"/after"], num=1))
        time.sleep(0.2)  # the server is stuck on a full socket, the client reads late
        assert recv_exact(s, 8 + len(value)) == P.enc_bytes(value)
        assert recv_exact(s, 8) == P.enc_i64(1)
        s.close()


def test_ftrun_store_accel_0_turns_it_off(monkeypatch) -> None:
    monkeypatch.setenv("FTRUN_STORE_ACCEL", "0")
    srv = StoreServer(host="127.0.0.1")
    assert srv._read_quick is None
    with srv:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        s.sendall(P.handshake_bytes(2) + req(P.Op.ADD, [b"/x"], num=4))
        assert recv_exact(s, 12) == P.enc_u32(2) + P.enc_i64(4)
        s.close()
