"""StoreClient: the KVStore contract over the wire, timeouts, threads, failures."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from helpers_store import free_port

from rendezvous.kv import StoreError, StoreTimeout
from rendezvous.store import protocol as P
from rendezvous.store.client import StoreClient
from rendezvous.store.server import StoreServer


@pytest.fixture
def server():
    with StoreServer(host="127.0.0.1") as s:
        yield s


class _DeletedBetweenCheckAndGet(StoreClient):
    """A client whose first CHECK of `victim` is followed by another client's delete of it."""

    def __init__(self, port: int, victim: str, other: StoreClient) -> None:
        super().__init__("127.0.0.1", port, timeout=5)
        self.victim, self.other, self.raced = victim, other, False

    def _call(self, req, **kw):
        out = super()._call(req, **kw)
        if req.op == P.Op.CHECK and not self.raced:
            self.raced = True
            self.other.delete(self.victim)
        return out


def test_try_get_of_a_key_deleted_between_check_and_get_is_none(server: StoreServer) -> None:
    # CI: a spare read the world marker as b"" (deleted by the round's wipe between the two
    # requests) and died on json.loads(b"")
    other = StoreClient("127.0.0.1", server.port, timeout=5)
    other.set("job/world", b'{"retired": true}')
    c = _DeletedBetweenCheckAndGet(server.port, "job/world", other)
    assert c.try_get("job/world") is None and c.raced
    other.set("job/empty", b"")
    assert c.try_get("job/empty") == b""  # a value that is really empty stays b""


def test_kv_contract(server: StoreServer) -> None:
    c = StoreClient("127.0.0.1", server.port, timeout=5)
    c.set("job/a", b"1")
    assert server.kv.get("job/a", 1) == b"1"
    assert c.get("job/a", 1.0) == b"1"
    assert c.try_get("job/a") == b"1" and c.try_get("job/none") is None
    c.set("job/empty", b"")
    assert c.try_get("job/empty") == b""
    assert c.add("job/n", 3) == 3 and c.add("job/n", -1) == 2
    assert c.compare_set("job/a", b"1", b"2") == b"2"
    assert c.compare_set("job/a", b"1", b"3") == b"2"
    assert c.wait(["job/a", "job/n"], 1.0) is True
    assert c.delete("job/empty") and not c.delete("job/empty")
    c.set("other/x", b"x")
    assert c.keys("job/") == ["job/a", "job/n"]
    assert c.keys() == ["job/a", "job/n", "other/x"]
    assert c.clear_except("job/") == 1
    assert c.delete_prefix("job/") == 2 and c.keys() == []
    c.multi_set({"m/1": b"a", "m/2": b"b"})
    assert c.multi_get(["m/1", "m/2"], 1.0) == [b"a", b"b"]
    c.append("m/1", b"+")
    assert c.get("m/1", 1) == b"a+" and c.num_keys() == 2 and c.check(["m/1"])
    assert c.ping() < 1.0
    c.close()


def test_wait_timeout_cancels_and_connection_stays_usable(server: StoreServer) -> None:
    c = StoreClient("127.0.0.1", server.port, timeout=5)
    t = time.monotonic()
    assert c.wait(["never"], 0.2) is False
    assert 0.15 < time.monotonic() - t < 1.5
    assert server.table.pending_waiters() == 0
    with pytest.raises(StoreTimeout, match="'never' did not appear"):
        c.get("never", 0.1)
    c.set("after", b"ok")
    assert c.get("after", 1) == b"ok"


def test_threads_each_get_their_own_connection(server: StoreServer) -> None:
    c = StoreClient("127.0.0.1", server.port, timeout=5)
    got: list[bytes] = []
    waiters = [threading.Thread(target=lambda: got.append(c.get("late", 5.0))) for _ in range(4)]
    for w in waiters:
        w.start()
    time.sleep(0.2)
    c.set("late", b"v")  # from this thread while the others block in WAIT
    for w in waiters:
        w.join(5)
    assert got == [b"v"] * 4
    assert server.connection_count() == 5


def test_dead_address_fails_within_timeout() -> None:
    port = free_port()
    c = StoreClient("127.0.0.1", port, timeout=0.5)
    t = time.monotonic()
    with pytest.raises(
        StoreError,
        match=f"cannot connect to the store at 127.0.0.1:{port} within 0.5 s: Connection refused",
    ):
        c.get("x", 1.0)
    assert time.monotonic() - t < 1.5


def test_server_going_away_is_a_store_error() -> None:
    s = StoreServer(host="127.0.0.1").start()
    c = StoreClient("127.0.0.1", s.port, timeout=1)
    c.set("a", b"1")
    s.stop()
    with pytest.raises(StoreError):
        c.get("a", 0.5)


def test_against_torch_own_server() -> None:
    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    c = StoreClient("127.0.0.1", master.port, timeout=5)
    c.set("t/a", b"1")
    assert master.get("t/a") == b"1"
    master.set("t/b", b"2")
    assert c.get("t/b", 1) == b"2" and c.add("t/n", 2) == 2
    assert c.keys("t/") == ["t/a", "t/b", "t/n"]
    assert c.wait(["t/none"], 0.2) is False
    # torch's server echoes the capability PING: no FT_WAIT_VALUES, a WAIT then a MULTI_GET
    assert c.wait_values(["t/a", "t/b"], 1) == [b"1", b"2"]
    assert c.wait_values(["t/none"], 0.2) is None
    assert c.delete_prefix("t/") == 3


def test_wait_values_on_ftruns_server_and_through_a_proxy(server: StoreServer) -> None:
    """ftrun's server answers FT_WAIT_VALUES (the handshake said so); the node proxy does not
    offer it and echoes the capability PING, so the client waits there with WAIT + MULTI_GET.
    Same answers either way: the values once all exist, None when the time runs out, and the
    connection usable after a timed-out wait."""
    from rendezvous.store.proxy import StoreProxy

    direct = StoreClient("127.0.0.1", server.port, timeout=5)
    proxy = StoreProxy(("127.0.0.1", server.port), listen_host="127.0.0.1", port=0)
    proxy.start()
    via = StoreClient("127.0.0.1", proxy.port, timeout=5)
    try:
        for c, caps in ((direct, P.CAP_WAIT_VALUES), (via, 0)):
            assert c.wait_values(["wv/a"], 0.1) is None
            c.set("wv/b", b"")
            got: list = []
            t = threading.Thread(target=lambda: got.append(c.wait_values(["wv/a", "wv/b"], 5)))
            t.start()
            time.sleep(0.2)
            server.kv.set("wv/a", b"plan")
            t.join(5)
            assert got == [[b"plan", b""]]
            assert c._link().caps == caps
            assert c.get("wv/a", 1) == b"plan"  # the reply stream is in order
            server.kv.delete_prefix("wv/")
    finally:
        via.close()
        proxy.stop()
        direct.close()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="store port 0"):
        StoreClient("127.0.0.1", 0)
    with pytest.raises(ValueError, match="timeout=-2"):
        StoreClient("127.0.0.1", 1, timeout=-2)


def test_non_store_peer_is_a_clear_error() -> None:
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen()

    def serve() -> None:
        conn, _ = ls.accept()
        conn.recv(100)
        conn.sendall(b"HTTP")
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    with pytest.raises(StoreError, match="answered the handshake wrongly"):
        StoreClient("127.0.0.1", ls.getsockname()[1], timeout=2).set("x", b"1")
    ls.close()


def test_calls_after_the_first_connection_use_the_call_timeout_not_the_connect_timeout() -> None:
    """An agent waits join_timeout for the store host to come up, but a store that stops
    answering must not block a later call for join_timeout (only read_timeout)."""
    port = free_port()
    late = StoreServer(host="127.0.0.1", port=port)
    threading.Timer(0.6, late.start).start()  # the store host comes up after a while
    c = StoreClient("127.0.0.1", port, timeout=0.3, connect_timeout=10.0)
    try:
        c.set("k", b"v")  # the first connection waited for it (longer than the call timeout)
        assert c.get("k", 1.0) == b"v"
    finally:
        c.close()
        late.stop()
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)  # accepts connections (backlog) but never answers
    c = StoreClient("127.0.0.1", mute.getsockname()[1], timeout=0.3, connect_timeout=30.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreError):
            c.set("k", b"v")
        assert time.monotonic() - t0 < 3.0
    finally:
        c.close()
        mute.close()


def test_interrupt_waits_ends_another_threads_wait_at_once(server: StoreServer) -> None:
    """A feed or the event follower waits long on the TCP store (one request per key or per
    long timeout, not per 0.5 s); its owner's stop() ends the wait by shutting down the
    waiting thread's connection, and only that one."""
    c = StoreClient("127.0.0.1", server.port, timeout=30)
    try:
        assert c.interruptible_waits
        c.set("other", b"1")  # this thread's connection: untouched by the interrupt
        out: list[object] = []

        def wait_long() -> None:
            try:
                out.append(c.wait(["never"], 20.0))
            except StoreError as e:
                out.append(e)

        t = threading.Thread(target=wait_long)
        t.start()
        time.sleep(0.3)  # blocked in its WAIT
        t0 = time.monotonic()
        c.interrupt_waits(t)
        t.join(5.0)
        assert not t.is_alive() and time.monotonic() - t0 < 1.0
        assert len(out) == 1 and isinstance(out[0], StoreError)
        assert c.get("other", 1.0) == b"1"
    finally:
        c.close()


def test_a_connection_shut_down_during_its_handshake_is_a_store_error(server, monkeypatch):
    """interrupt_waits shuts down a thread's connection; when that lands while the thread is
    opening a new one, its handshake's send fails with BrokenPipeError. It must surface as a
    StoreError (which every loop handles), not kill the thread (a CI-subset warning: the
    liveness event follower died of it)."""
    import rendezvous.store.client as client_mod

    real_connect = client_mod.connect

    def shut_down_at_once(*args, **kw):
        sock = real_connect(*args, **kw)
        sock.shutdown(socket.SHUT_RDWR)
        return sock

    monkeypatch.setattr(client_mod, "connect", shut_down_at_once)
    c = StoreClient("127.0.0.1", server.port, timeout=5)
    try:
        with pytest.raises(StoreError):
            c.set("k", b"v")
    finally:
        c.close()
