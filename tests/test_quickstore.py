"""The store server's C read path (rendezvous/store/_quickstore.c): the same replies and table as
the Python paths, nothing executed while another thread holds the table's lock, writes that
wake waiters left to Python, large replies finished by the Python flush, and the switch."""

from __future__ import annotations

import os
import select
import socket
import threading
import time

import pytest
from helpers_store import recv_exact

from rendezvous.store import protocol as P
from rendezvous.store.auth import AUTH_KEY
from rendezvous.store.connection import Conn
from rendezvous.store.server import StoreServer


def req(op, keys=(), values=(), num=0) -> bytes:
    return P.encode_request(P.Request(op, tuple(keys), tuple(values), num))


def validated(port: int, n: int) -> list[socket.socket]:
    """`n` connections to the store (or proxy) at `port`, each through the handshake."""
    socks = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(P.handshake_bytes(i))
        assert recv_exact(s, 4) == P.enc_u32(i)
        socks.append(s)
    return socks


def frames() -> list[bytes]:
    """What the C path executes and what it must hand over, interleaved."""
    k, cnt = b"/k", b"/cnt"
    return [
        req(P.Op.GET, [k]),  # missing: empty value
        req(P.Op.SET, [k], [b"v1"]),
        req(P.Op.GET, [k]),
        req(P.Op.ADD, [cnt], num=5),
        req(P.Op.ADD, [cnt], num=-9),
        req(P.Op.WAIT, [k]),
        req(P.Op.WAIT, [k, cnt]),
        req(P.Op.CHECK, [k, cnt]),
        req(P.Op.CHECK, [k, b"/absent"]),  # not ready: Python (queues count as present)
        req(P.Op.QUEUE_PUSH, [b"/q"], [b"x"]),
        req(P.Op.WAIT, [b"/q"]),
        req(P.Op.CHECK, [b"/q"]),
        req(P.Op.SET, [b"/plus"], [b" +7 "]),
        req(P.Op.ADD, [b"/plus"], num=1),  # int() spelling
        req(P.Op.SET, [b"/big"], [b"9223372036854775806"]),
        req(P.Op.ADD, [b"/big"], num=1),
        req(P.Op.ADD, [b"/big"], num=-3),  # 19 digits: Python
        req(P.Op.SET, [AUTH_KEY], [b"tok"]),
        req(P.Op.GET, [AUTH_KEY]),  # never stored
        req(P.Op.SET, [b"/v"], [bytes(range(256)) * 300]),
        req(P.Op.GET, [b"/v"]),
        req(P.Op.PING, num=3),
        req(P.Op.SET, [k], [b""]),
        req(P.Op.GET, [k]),
        req(P.Op.WAIT, [b"/later"]),  # registers a waiter: no reply now
        req(P.Op.SET, [b"/later"], [b"here"]),  # watched: Python wakes the waiter
        req(P.Op.ADD, [cnt], num=1),
    ]


def feed(srv: StoreServer, c: Conn, b: socket.socket, stream: bytes, chunk: int) -> bytes:
    """Send `stream` (in `chunk`-byte pieces, 0: whole) from `b` to the server's connection `c`
    (the other end), run `_read` / the backlog / the flush as the loop would, and return what
    came back."""
    a = c.sock
    srv._ep = select.epoll()
    srv._conns[c.fd] = c
    srv._ep.register(c.fd, 1)
    srv._loop_ident = threading.get_ident()
    pieces = (
        [stream] if chunk == 0 else [stream[i : i + chunk] for i in range(0, len(stream), chunk)]
    )
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
                got += b.recv(1 << 20)
            except BlockingIOError:
                break
    return got


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
        c = Conn(a, "test", True, 0.0)
        c.validated = not handshake
        got = feed(srv, c, b, stream, chunk)
        assert c.validated and not c.closed
        return got, dict(srv.table._data)
    finally:
        srv._ep.close()
        a.close()
        b.close()


def mux_frames() -> list[tuple[int, P.Request, str]]:
    """A node proxy's link: (tag, request, reply kind) -- what C takes, then a CANCEL_WAIT."""
    R = P.Request
    return [
        (1, R(P.Op.MULTI_SET, (b"/a", b"/b"), (b"1", b"22")), ""),
        (2, R(P.Op.GET, (b"/a",)), "bytes"),
        (3, R(P.Op.WAIT, (b"/w",)), "u8"),  # absent: waits under tag 3, the frames behind go on
        (4, R(P.Op.ADD, (b"/n",), (), 5), "i64"),
        (5, R(P.Op.WAIT, (b"/a",)), "u8"),
        (6, R(P.Op.CHECK, (b"/a", b"/b")), "u8"),
        (7, R(P.Op.PING, num=7), "u32"),
        (8, R(P.Op.SET, (b"/w",), (b"x",)), ""),  # wakes tag 3 of this same connection
        (9, R(P.Op.WAIT, (b"/z",)), "u8"),  # cancelled below
        (11, R(P.Op.MULTI_SET, (b"/c",), (b"3",)), ""),
        (12, R(P.Op.GET, (b"/c",)), "bytes"),
        (13, R(P.Op.ADD, (b"/n",), (), -2), "i64"),
        (10, R(P.Op.CANCEL_WAIT, num=9), "u8"),  # WAIT_CANCELED, by the Python path
    ]


def parse_mux_replies(data: bytes, kinds: dict[int, str]) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    pos = 0
    while pos < len(data):
        tag = int.from_bytes(data[pos : pos + 4], "little")
        pos += 4
        kind = kinds[tag]
        size = {"u8": 1, "i64": 8, "u32": 4}.get(kind)
        if kind == "bytes":
            size = 8 + int.from_bytes(data[pos : pos + 8], "little")
        assert tag not in out, f"tag {tag} answered twice"
        out[tag] = data[pos : pos + size]
        pos += size
    return out


def run_mux_stream(mode: str, chunk: int, handled: list | None = None) -> tuple[dict, dict]:
    """`mux_frames()` on a mux connection (`mode` "c" or "python"): the reply of each tag and
    the table; `handled` collects the tags that reached the Python handler."""
    srv = StoreServer(host="127.0.0.1")
    if mode != "c":
        srv._read_quick = None
    if handled is not None:
        orig = srv._handle

        def counted(c, r, tag):  # noqa: ANN001
            handled.append(tag)
            return orig(c, r, tag)

        srv._handle = counted
    stream = b"".join(P.encode_mux_request(t, r) for t, r, _ in mux_frames())
    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        c = Conn(a, "test", True, 0.0)
        c.validated, c.mux = True, True
        got = feed(srv, c, b, stream, chunk)
        assert not c.closed and not c.mux_waiters  # tag 3 answered, tag 9 cancelled
        kinds = {t: k for t, _, k in mux_frames()}
        return parse_mux_replies(got, kinds), dict(srv.table._data)
    finally:
        srv._ep.close()
        a.close()
        b.close()


@pytest.mark.parametrize("chunk", [0, 1, 7, 64])
def test_a_mux_connection_gets_the_python_paths_replies_from_c(chunk: int) -> None:
    """A node proxy's multiplexed link (tagged frames, MULTI_SET for its rounds of SETs, waits
    that do not hold up the frames behind them) is read in C: the same reply for every tag and
    the same table as the Python path, in whatever order the wake-ups come."""
    results = {mode: run_mux_stream(mode, chunk) for mode in ("c", "python")}
    assert results["c"] == results["python"]
    replies, table = results["c"]
    assert replies == {
        2: P.enc_bytes(b"1"),
        3: P.STOP_WAITING_REPLY,
        4: P.enc_i64(5),
        5: P.STOP_WAITING_REPLY,
        6: bytes((P.READY,)),
        7: P.enc_u32(7),
        10: bytes((P.WAIT_CANCELED,)),
        12: P.enc_bytes(b"3"),
        13: P.enc_i64(3),
    }
    assert (
        table[b"/a"] == b"1"
        and table[b"/b"] == b"22"
        and table[b"/w"] == b"x"
        and table[b"/n"] == b"3"
    )


def test_only_what_c_does_not_take_reaches_the_python_handler_on_a_mux_connection() -> None:
    handled: list[int] = []
    run_mux_stream("c", 0, handled)
    assert handled == [10]  # the CANCEL_WAIT; everything before it ran in C


def test_the_extension_is_built_and_a_default_server_uses_it() -> None:
    """Installs run setup.py, which builds it; a missing compiler leaves the Python path."""
    from rendezvous.store import _quickstore  # noqa: F401

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


@pytest.mark.parametrize(
    "first",
    [
        req(P.Op.GET, [b"/k"]),  # not a VALIDATE
        req(P.Op.VALIDATE, num=0x12345678),  # the wrong magic
        req(P.Op.PING, num=1),
    ],
    ids=["get", "magic", "ping"],
)
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
    assert len(logs) == 1 and (
        "expected VALIDATE" in logs[0] or "expected 0x3c85f7ce" in logs[0]
    ), logs


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
        waiter, writer = validated(srv.port, 2)
        waiter.sendall(req(P.Op.WAIT, [b"/go"]))
        deadline = time.monotonic() + 5
        while not srv.table._waiters and time.monotonic() < deadline:
            time.sleep(0.01)
        writer.sendall(req(P.Op.SET, [b"/go"], [b"1"]) + req(P.Op.GET, [b"/go"]))
        assert recv_exact(writer, 9) == P.enc_bytes(b"1")
        assert recv_exact(waiter, 1) == P.STOP_WAITING_REPLY
        waiter.close()
        writer.close()


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


def test_accel_false_turns_it_off() -> None:
    """`accel=False` (FTRUN_STORE_ACCEL=0, read by launcher.config and `ftctl store serve`):
    the Python paths only, in the server and in the proxy."""
    from rendezvous.store.proxy import StoreProxy

    px = StoreProxy(("127.0.0.1", 1), accel=False)
    assert px._proxy_read is None and px._turn is None and px._flush_out is None
    srv = StoreServer(host="127.0.0.1", accel=False)
    assert srv._read_quick is None and srv._turn is None and srv._flush_out is None
    with srv:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        s.sendall(P.handshake_bytes(2) + req(P.Op.ADD, [b"/x"], num=4))
        assert recv_exact(s, 12) == P.enc_u32(2) + P.enc_i64(4)
        s.close()


class _Loop:
    """A server driven by hand on this thread: validated plain connections over socketpairs,
    `read(conn)` as the loop reads; `_consume` (the Python request loop) counted."""

    def __init__(self) -> None:
        self.srv = StoreServer(host="127.0.0.1")
        self.srv._loop_ident = threading.get_ident()
        self.srv._ep = select.epoll()
        self.python_frames = 0
        consume = self.srv._consume

        def counted(c, data):
            self.python_frames += 1
            consume(c, data)

        self.srv._consume = counted
        self.pairs: list = []

    def conn(self):
        a, b = socket.socketpair()
        a.setblocking(False)
        b.settimeout(5)
        c = Conn(a, "test", True, 0.0)
        c.validated = True
        self.srv._conns[c.fd] = c
        self.srv._ep.register(c.fd, select.EPOLLIN)
        self.pairs += [a, b]
        return c, b

    def send(self, c, b, data: bytes) -> None:
        b.sendall(data)
        self.srv._read(c)
        self.srv._flush_dirty()

    def close(self) -> None:
        self.srv._ep.close()
        for s in self.pairs:
            s.close()


@pytest.fixture
def lp():
    loop = _Loop()
    yield loop
    loop.close()


def assert_nothing_arrives(b: socket.socket) -> None:
    b.settimeout(0.2)
    with pytest.raises(socket.timeout):
        b.recv(1)
    b.settimeout(5)


def test_waits_register_and_writes_wake_them_in_c(lp: _Loop) -> None:
    """A WAIT for an absent key registers its waiter in C (the connection's waiter, indexed
    under the key); a SET or ADD of that key wakes all of them in C, each answered once."""
    waiting = [lp.conn() for _ in range(20)]
    for c, b in waiting:
        lp.send(c, b, req(P.Op.WAIT, [b"/go"]))
        assert c.waiter is not None and c.waiter in lp.srv.table._waiters[b"/go"]
    wc, wb = lp.conn()
    lp.send(wc, wb, req(P.Op.ADD, [b"/go"], num=2))
    assert recv_exact(wb, 8) == P.enc_i64(2)
    for c, b in waiting:
        assert recv_exact(b, 1) == P.STOP_WAITING_REPLY
        assert c.waiter is None
    assert lp.srv.table._waiters == {} and lp.python_frames == 0
    for c, b in waiting:  # the next wait is answered at once, the next write wakes nobody
        lp.send(c, b, req(P.Op.WAIT, [b"/go"]) + req(P.Op.SET, [b"/go"], [b"x"]))
        assert recv_exact(b, 1) == P.STOP_WAITING_REPLY
    assert_nothing_arrives(b)
    assert lp.python_frames == 0


def test_a_waiter_for_two_keys_fires_on_the_second_write(lp: _Loop) -> None:
    c, b = lp.conn()
    lp.send(c, b, req(P.Op.WAIT, [b"/a", b"/b"]))  # two keys: the Python path registers
    wc, wb = lp.conn()
    lp.send(wc, wb, req(P.Op.SET, [b"/a"], [b"1"]))
    assert_nothing_arrives(b)
    lp.send(wc, wb, req(P.Op.SET, [b"/b"], [b"1"]))
    assert recv_exact(b, 1) == P.STOP_WAITING_REPLY and c.waiter is None


def test_a_waiter_of_a_connection_with_queued_output_is_answered_behind_it(lp: _Loop) -> None:
    """C sends STOP_WAITING itself only to a connection with nothing queued; otherwise the
    Python delivery queues it behind the output already there, in order."""
    c, b = lp.conn()
    lp.send(c, b, req(P.Op.WAIT, [b"/go"]))
    c.out.append(b"EARLIER")  # e.g. the rest of a large reply the socket did not take
    c.out_bytes += 7
    wc, wb = lp.conn()
    lp.send(wc, wb, req(P.Op.SET, [b"/go"], [b"1"]))
    lp.srv._flush(c)
    assert recv_exact(b, 8) == b"EARLIER" + P.STOP_WAITING_REPLY


def test_a_cancel_after_a_c_registered_wait_is_answered_in_order(lp: _Loop) -> None:
    c, b = lp.conn()
    lp.send(c, b, req(P.Op.WAIT, [b"/go"]))
    lp.send(c, b, req(P.Op.CANCEL_WAIT, num=0))  # the waiter's connection: Python
    assert recv_exact(b, 1) == P.encode_reply(P.Op.CANCEL_WAIT, P.WAIT_CANCELED)
    assert c.waiter is None and lp.srv.table._waiters == {}
    wc, wb = lp.conn()
    lp.send(wc, wb, req(P.Op.SET, [b"/go"], [b"1"]) + req(P.Op.GET, [b"/go"]))
    assert recv_exact(wb, 9) == P.enc_bytes(b"1")
    assert_nothing_arrives(b)


def test_waiters_of_a_running_server_wake_on_c_writes_and_on_local_writes() -> None:
    """Through a real loop: torch-style clients wait in C; a wire ADD wakes some, a LocalKV
    write of another thread the others; a closed waiter's connection is forgotten."""
    with StoreServer(host="127.0.0.1") as srv:

        def client(i):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            s.sendall(P.handshake_bytes(i))
            assert recv_exact(s, 4) == P.enc_u32(i)
            return s

        a = [client(i) for i in range(10)]
        z = [client(i) for i in range(10)]
        gone = client(99)
        for s in a:
            s.sendall(req(P.Op.WAIT, [b"/wire"]))
        for s in z:
            s.sendall(req(P.Op.WAIT, [b"/local"]))
        gone.sendall(req(P.Op.WAIT, [b"/wire"]))
        deadline = time.monotonic() + 5
        while (
            len(srv.table._waiters.get(b"/wire", ())) < 11
            or len(srv.table._waiters.get(b"/local", ())) < 10
        ) and time.monotonic() < deadline:
            time.sleep(0.01)
        gone.close()
        while len(srv.table._waiters.get(b"/wire", ())) > 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(srv.table._waiters[b"/wire"]) == 10
        w = client(7)
        w.sendall(req(P.Op.ADD, [b"/wire"], num=1))
        assert recv_exact(w, 8) == P.enc_i64(1)
        for s in a:
            assert recv_exact(s, 1) == P.STOP_WAITING_REPLY
        srv.kv.set("local", b"1")
        for s in z:
            assert recv_exact(s, 1) == P.STOP_WAITING_REPLY
        for s in a + z + [w]:
            s.sendall(req(P.Op.GET, [b"/local"]))
            assert recv_exact(s, 9) == P.enc_bytes(b"1")
            s.close()


# ----------------------------------------------------------------- the node proxy's read path


def proxy_frames() -> list[bytes]:
    """What the proxy's C read path queues, and what it must hand over, interleaved."""
    return [
        req(P.Op.SET, [b"/a"], [b"1"]),
        req(P.Op.GET, [b"/a"]),
        req(P.Op.ADD, [b"/n"], num=-4),
        req(P.Op.WAIT, [b"/a"]),
        req(P.Op.WAIT, [b"/a", b"/b"]),
        req(P.Op.CHECK, [b"/a"]),
        req(P.Op.PING, num=7),  # answered by the proxy itself: Python
        req(P.Op.SET, [AUTH_KEY], [b"tok"]),  # dropped by the proxy: Python
        req(P.Op.SET, [b"/v"], [bytes(range(256)) * 300]),
        req(P.Op.MULTI_SET, [b"/x"], [b"y"]),
        req(P.Op.WAIT, [b"/k%d" % i for i in range(20)]),  # more keys than C takes: Python
        req(P.Op.ADD, [b"/n"], num=1),
        req(P.Op.GETNUMKEYS),
        req(P.Op.GET, [b"/n"]),
    ]


def run_proxy_stream(accel: bool, chunk: int) -> tuple[list, int, bytes, dict]:
    """Feed the frames through `StoreProxy._read` on one end of a socketpair (the proxy not
    started: nothing goes upstream); (the batch as (request, has a slot), slots queued, the
    local replies, stats)."""
    from rendezvous.store.proxy import StoreProxy

    px = StoreProxy(("127.0.0.1", 1))
    if not accel:
        px._proxy_read = None
    stream = b"".join(proxy_frames())
    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        b.setblocking(False)
        c = Conn(a, "test", True, 0.0)
        c.validated = True
        px._conns[c.fd] = c
        px._loop_ident = threading.get_ident()
        pieces = (
            [stream]
            if chunk == 0
            else [stream[i : i + chunk] for i in range(0, len(stream), chunk)]
        )
        got = b""
        for p in pieces:
            b.sendall(p)
            while select.select([a], [], [], 0)[0] and not c.closed:
                px._read(c)
            while px._backlog:
                backlog, px._backlog = px._backlog, []
                for x in backlog:
                    px._consume(x, b"")
            px._flush_dirty()
            try:
                got += b.recv(1 << 20)
            except BlockingIOError:
                pass
        assert not c.closed and not c.buf
        batch = [(r, slot is not None) for conn, r, slot in px._batch if conn is c]
        return batch, len(c.slots), got, {k: px.stats[k] for k in ("requests", "dropped")}
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("chunk", [0, 1, 6, 64])
def test_the_proxy_read_path_queues_what_the_python_path_queues(chunk: int) -> None:
    from rendezvous.store.proxy import StoreProxy

    assert StoreProxy(("127.0.0.1", 1))._proxy_read is not None
    c_run, py_run = run_proxy_stream(True, chunk), run_proxy_stream(False, chunk)
    assert c_run == py_run
    batch, slots, replies, stats = c_run
    assert [r.op for r, _ in batch] == [
        P.Op.SET,
        P.Op.GET,
        P.Op.ADD,
        P.Op.WAIT,
        P.Op.WAIT,
        P.Op.CHECK,
        P.Op.SET,
        P.Op.MULTI_SET,
        P.Op.WAIT,
        P.Op.ADD,
        P.Op.GETNUMKEYS,
        P.Op.GET,
    ]
    assert batch[2][0] == P.Request(P.Op.ADD, (b"/n",), (), -4) and type(batch[2][0]) is P.Request
    assert [has for _, has in batch] == [
        False,
        True,
        True,
        True,
        True,
        True,
        False,
        False,
        True,
        True,
        True,
        True,
    ]
    assert slots == 9 + 1  # the PING's slot, answered, is still first in line
    assert replies == b""  # the PING's reply waits behind the unanswered GET
    assert stats == {"requests": 14, "dropped": 0}


def test_the_proxy_read_path_keeps_the_per_turn_budget() -> None:
    from rendezvous.store.proxy import StoreProxy

    px = StoreProxy(("127.0.0.1", 1))
    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        c = Conn(a, "test", True, 0.0)
        c.validated = True
        n = px._budget + 5
        b.sendall(b"".join(req(P.Op.ADD, [b"/n"], num=1) for _ in range(n)))
        time.sleep(0.05)
        px._read(c)
        assert len(px._batch) == px._budget and px._backlog == [c] and c.buf
        px._backlog.clear()
        px._consume(c, b"")
        assert len(px._batch) == n and not c.buf and len(c.slots) == n
    finally:
        a.close()
        b.close()


def test_flush_out_sends_each_connections_output_and_leaves_short_sends_to_python() -> None:
    from rendezvous.store._quickstore import flush_out

    pairs = [socket.socketpair() for _ in range(4)]
    try:
        conns = []
        for a, _ in pairs:
            a.setblocking(False)
            conns.append(Conn(a, "test", True, 0.0))
        full, closed, waiting, big = conns
        full.out, full.out_bytes = [b"ab", b"cd"], 4
        closed.out, closed.closed = [b"x"], True
        waiting.out, waiting.want_write = [b"y"], True
        pairs[3][0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        payload = bytes(range(256)) * 4096  # 1 MiB: more than the socket takes at once
        big.out, big.out_bytes = [payload[:10], payload[10:]], len(payload)
        left = flush_out(conns + [full])  # a connection twice: its output goes once
        assert left == [big]
        assert pairs[0][1].recv(16) == b"abcd" and full.out == [] and full.out_bytes == 0
        assert closed.out == [b"x"] and waiting.out == [b"y"]
        assert len(big.out) == 1 and 0 < big.out_bytes == len(big.out[0]) < len(payload)
        sent = len(payload) - big.out_bytes
        got = b""
        while len(got) < sent:
            got += pairs[3][1].recv(1 << 20)
        assert got + big.out[0] == payload
        odd = conns[0]
        odd.out = [bytearray(b"z")]  # not bytes: the Python flush
        assert flush_out([odd]) == [odd] and odd.out == [bytearray(b"z")]
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def test_a_running_servers_loop_takes_plain_reads_in_c_and_leaves_the_rest_to_python() -> None:
    """`loop_turn`: a plain connection's reads are done in C (no Python `_read`), a cut frame
    still goes through the Python loop; the counters add up either way."""
    srv = StoreServer(host="127.0.0.1")
    assert srv._turn is not None
    python_reads: list[int] = []
    orig = srv._read

    def counted(c):
        python_reads.append(c.fd)
        orig(c)

    srv._read = counted
    with srv:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        s.sendall(P.handshake_bytes(4))
        assert recv_exact(s, 4) == P.enc_u32(4)
        before = len(python_reads)
        for i in range(50):
            s.sendall(req(P.Op.ADD, [b"/n"], num=1))
            assert recv_exact(s, 8) == P.enc_i64(i + 1)
        assert len(python_reads) == before  # all 50 in C
        frame = req(P.Op.SET, [b"/k"], [b"v" * 100]) + req(P.Op.GET, [b"/k"])
        s.sendall(frame[:20])
        time.sleep(0.1)
        s.sendall(frame[20:])  # the cut SET was buffered: the Python path finishes it
        assert recv_exact(s, 108) == P.enc_bytes(b"v" * 100)
        assert len(python_reads) > before
        s.close()
        deadline = time.monotonic() + 5
        while srv.connection_count() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.stats["requests"] >= 53 and srv.stats["dropped"] == 0


def test_a_running_proxys_loop_queues_plain_reads_in_c() -> None:
    from rendezvous.store.proxy import StoreProxy

    with StoreServer(host="127.0.0.1") as srv:
        px = StoreProxy(("127.0.0.1", srv.port))
        assert px._turn is not None and px._turn_proxy
        python_reads: list[int] = []
        handled: list[int] = []
        orig, orig_handle = px._read, px._handle

        def counted(c):
            python_reads.append(c.fd)
            orig(c)

        def counted_handle(c, r, tag):
            handled.append(r.op)
            return orig_handle(c, r, tag)

        px._read, px._handle = counted, counted_handle
        px.start()
        try:
            s = socket.create_connection(("127.0.0.1", px.port), timeout=5)
            s.sendall(P.handshake_bytes(4))
            assert recv_exact(s, 4) == P.enc_u32(4)
            before = len(python_reads)
            for i in range(30):
                s.sendall(req(P.Op.ADD, [b"/n"], num=2))
                assert recv_exact(s, 8) == P.enc_i64(2 * (i + 1))
            s.sendall(req(P.Op.SET, [b"/k"], [b"v"]) + req(P.Op.GET, [b"/k"]))
            assert recv_exact(s, 9) == P.enc_bytes(b"v")
            assert len(python_reads) == before and handled == [P.Op.VALIDATE, P.Op.PING]
            s.sendall(req(P.Op.PING, num=9))  # the proxy answers PING itself: Python
            assert recv_exact(s, 4) == P.enc_u32(9)
            assert handled == [P.Op.VALIDATE, P.Op.PING, P.Op.PING]
            assert srv.table._data[b"/n"] == b"60"
            s.close()
        finally:
            px.stop()


def _counting_turns(loop) -> list[float]:
    """Record the times the Python loop of `loop` finishes a turn (`_end_turn` runs once per
    Python turn, whatever `loop_turn` did in C before it)."""
    turns: list[float] = []
    orig = loop._end_turn

    def counted():
        turns.append(time.monotonic())
        orig()

    loop._end_turn = counted
    return turns


def test_a_servers_loop_turns_in_c_while_its_turns_need_no_python() -> None:
    """`loop_turn` with `until`: 60 round trips of plain frames take no Python turn of their
    own (before: one each); a write of another thread (the wake fd), a new connection and
    stop() still reach the Python loop at once."""
    srv = StoreServer(host="127.0.0.1")
    turns = _counting_turns(srv)
    with srv:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        s.sendall(P.handshake_bytes(4))
        assert recv_exact(s, 4) == P.enc_u32(4)
        time.sleep(0.05)
        before = len(turns)
        for i in range(60):
            s.sendall(req(P.Op.ADD, [b"/n"], num=1))
            assert recv_exact(s, 8) == P.enc_i64(i + 1)
        assert len(turns) - before <= 3, turns  # a sweep (1 s) may fall in the window
        s.sendall(req(P.Op.WAIT, [b"/late"]))
        time.sleep(0.05)
        t0 = time.monotonic()
        srv.kv.set("late", b"1")  # another thread: the loop leaves C for the delivery
        assert recv_exact(s, 1) == P.STOP_WAITING_REPLY
        assert time.monotonic() - t0 < 0.5
        t0 = time.monotonic()
        s2 = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        s2.sendall(P.handshake_bytes(5))
        assert recv_exact(s2, 4) == P.enc_u32(5)
        assert time.monotonic() - t0 < 0.5
        assert srv.stats["requests"] >= 62 and srv.stats["busy_s"] > 0
        s.close()
        s2.close()
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 1.0  # stop() wakes the loop out of C


@pytest.mark.parametrize(
    "host,connect_to", [("127.0.0.1", "127.0.0.1"), ("::", "127.0.0.1"), ("::1", "::1")]
)
def test_new_connections_are_accepted_in_c_as_python_accepts_them(
    host: str, connect_to: str
) -> None:
    """`loop_turn` with `accept`: a burst of connects takes no Python `_accept` and no Python
    turn per connection; each connection is what `_accept` makes: non-blocking, TCP_NODELAY,
    registered, counted, its peer written as `connection.peer_str` writes it (an IPv4 client of a
    dual-stack socket as IPv4, an IPv6 one in brackets), and answered."""
    srv = StoreServer(host=host)
    accepts: list[int] = []
    orig = srv._accept

    def counted():
        accepts.append(1)
        orig()

    srv._accept = counted
    turns = _counting_turns(srv)
    with srv:
        time.sleep(0.05)
        before = len(turns)
        socks = [socket.create_connection((connect_to, srv.port), timeout=5) for _ in range(40)]
        for i, s in enumerate(socks):
            s.sendall(P.handshake_bytes(i))
            assert recv_exact(s, 4) == P.enc_u32(i)
        assert accepts == [] and srv.stats["accepted"] == 40
        assert len(turns) - before <= 3, turns  # a sweep (1 s) may fall in the window
        conns = dict(srv._conns)
        assert len(conns) == 40
        want = {
            (f"[{connect_to}]" if ":" in connect_to else connect_to) + f":{s.getsockname()[1]}"
            for s in socks
        }
        assert {c.peer for c in conns.values()} == want
        for fd, c in conns.items():
            assert c.fd == fd == c.sock.fileno() and c.validated and c.authed
            assert c.sock.gettimeout() == 0.0
            assert c.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        socks[0].sendall(req(P.Op.ADD, [b"/n"], num=3))
        assert recv_exact(socks[0], 8) == P.enc_i64(3)
        for s in socks:
            s.close()
        deadline = time.monotonic() + 5
        while srv.connection_count() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.connection_count() == 0


def _listening() -> tuple[socket.socket, select.epoll]:
    """A non-blocking listening socket on loopback and an epoll set watching it for reads."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)
    lsock.setblocking(False)
    ep = select.epoll()
    ep.register(lsock.fileno(), select.EPOLLIN)
    return lsock, ep


def test_an_adopt_that_raises_ends_the_turn_with_its_error_and_no_fd_is_left() -> None:
    """`loop_turn`'s accept hands each connection to `adopt(fd, peer)`, which owns the fd: an
    exception comes out of `loop_turn`, and the accepted fd is closed by the adopt that
    failed (here, as `LoopServer._adopt` does, before it made a socket object)."""
    from rendezvous.store import _quickstore

    srv = StoreServer(host="127.0.0.1")  # not started: only its context tuple is used
    lsock, ep = _listening()
    seen: list[tuple[int, str]] = []

    def adopt(fd: int, peer: str) -> None:
        seen.append((fd, peer))
        os.close(fd)
        raise RuntimeError("adopt failed")

    client = socket.create_connection(lsock.getsockname(), timeout=5)
    try:
        with pytest.raises(RuntimeError, match="adopt failed"):
            _quickstore.loop_turn(
                ep.fileno(),
                {},
                srv._turn_ctx,
                1.0,
                False,
                0.0,
                None,
                0.0,
                (lsock.fileno(), 10, 4, adopt),
            )
        assert [p for _, p in seen] == [f"127.0.0.1:{client.getsockname()[1]}"]
        assert client.recv(1) == b""  # the server's end is closed
        with pytest.raises(TypeError, match="accept is None or"):
            _quickstore.loop_turn(
                ep.fileno(), {}, srv._turn_ctx, 0.0, False, 0.0, None, 0.0, (lsock.fileno(), 10, 4)
            )
    finally:
        client.close()
        ep.close()
        lsock.close()


def test_past_the_connection_limit_the_accept_is_left_to_python() -> None:
    """At `max_connections` `loop_turn` does not accept: the listening socket's event comes
    back to the Python loop (whose `_accept` refuses with its log line)."""
    from rendezvous.store import _quickstore

    srv = StoreServer(host="127.0.0.1")
    lsock, ep = _listening()
    adopted: dict[int, str] = {}  # the connections table: the limit counts it
    clients = [socket.create_connection(lsock.getsockname(), timeout=5) for _ in range(3)]
    try:
        time.sleep(0.05)
        events, *_ = _quickstore.loop_turn(
            ep.fileno(),
            adopted,
            srv._turn_ctx,
            1.0,
            False,
            0.0,
            None,
            0.0,
            (lsock.fileno(), 2, 8, adopted.__setitem__),
        )
        assert len(adopted) == 2 and events == [(lsock.fileno(), select.EPOLLIN)]
    finally:
        for fd in adopted:
            os.close(fd)
        for c in clients:
            c.close()
        ep.close()
        lsock.close()


def _blocked_upstream(srv: StoreServer):
    """Hold the table's lock: the server's loop blocks in its Python path (the C read path
    never blocks on it) and answers nothing until the lock is released."""
    lock = srv.table._lock
    lock.acquire()
    return lock


def test_a_proxy_collects_a_held_round_in_c_and_sends_it_as_one() -> None:
    """While a round is upstream, the requests that arrive are held (`max_hold`) and collected
    by `loop_turn` in C -- no Python turn per arrival -- then go upstream as one round when
    the answer comes: two ADDs of two clients become one ADD of their sum, each client gets a
    value of a serial order."""
    from rendezvous.store.proxy import StoreProxy

    with StoreServer(host="127.0.0.1") as srv:
        px = StoreProxy(("127.0.0.1", srv.port), max_hold=2.0)
        turns = _counting_turns(px)
        with px:
            socks = validated(px.port, 3)
            time.sleep(0.05)
            lock = _blocked_upstream(srv)
            try:
                socks[0].sendall(req(P.Op.ADD, [b"/a"], num=1))  # goes up at once: in flight
                deadline = time.monotonic() + 5
                while px.upstream_requests < 1 and time.monotonic() < deadline:
                    time.sleep(0.005)
                time.sleep(0.05)
                before, sent = len(turns), px.upstream_requests
                socks[1].sendall(req(P.Op.ADD, [b"/b"], num=1))
                time.sleep(0.05)
                socks[2].sendall(req(P.Op.ADD, [b"/b"], num=2))
                time.sleep(0.1)
                assert len(turns) == before, "an arrival into a held round took a Python turn"
                assert px.upstream_requests == sent == 1 and len(px._batch) == 2
            finally:
                released = time.monotonic()
                lock.release()
            assert recv_exact(socks[0], 8) == P.enc_i64(1)
            got = {recv_exact(socks[1], 8), recv_exact(socks[2], 8)}
            assert time.monotonic() - released < 1.0  # the answer ended the 2 s hold
            assert got in ({P.enc_i64(1), P.enc_i64(3)}, {P.enc_i64(3), P.enc_i64(2)})
            assert px.upstream_requests == 2  # the held round: one ADD of 3
            assert srv.table._data[b"/b"] == b"3"
            for s in socks:
                s.close()


def test_a_held_round_goes_upstream_when_its_hold_ends() -> None:
    """The hold is bounded: with the upstream's answer late, a round collected in C leaves
    after `max_hold` s anyway (the C loop stops at the hold's end)."""
    from rendezvous.store.proxy import StoreProxy

    with StoreServer(host="127.0.0.1") as srv:
        with StoreProxy(("127.0.0.1", srv.port), max_hold=0.1) as px:
            a, b = validated(px.port, 2)
            lock = _blocked_upstream(srv)
            try:
                a.sendall(req(P.Op.ADD, [b"/a"], num=1))
                deadline = time.monotonic() + 5
                while px.upstream_requests < 1 and time.monotonic() < deadline:
                    time.sleep(0.005)
                t0 = time.monotonic()
                b.sendall(req(P.Op.ADD, [b"/b"], num=5))
                while px.upstream_requests < 2 and time.monotonic() < deadline:
                    time.sleep(0.005)
                waited = time.monotonic() - t0
                assert px.upstream_requests == 2 and 0.05 < waited < 1.0, waited
            finally:
                lock.release()
            assert recv_exact(a, 8) == P.enc_i64(1)
            assert recv_exact(b, 8) == P.enc_i64(5)
            a.close()
            b.close()
