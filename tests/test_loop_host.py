"""Tests for rendezvous.store.loop_host: the listening socket, and a server's lifecycle and
connection admission (through `StoreServer`, its usual subclass)."""

from __future__ import annotations

import socket
import time

import pytest

from rendezvous.kv import StoreError
from rendezvous.store import protocol as P
from rendezvous.store.loop_host import bind_listener
from rendezvous.store.server import StoreServer


def test_bind_listener_gives_a_non_blocking_listening_socket_on_a_free_port() -> None:
    s = bind_listener("127.0.0.1", 0)
    try:
        host, port = s.getsockname()[:2]
        assert host == "127.0.0.1" and port > 0 and not s.getblocking()
        with pytest.raises(StoreError, match=f"cannot listen on 127.0.0.1:{port}: address already"):
            bind_listener("127.0.0.1", port)
    finally:
        s.close()


def test_bind_listener_names_an_unknown_host() -> None:
    with pytest.raises(StoreError, match="cannot listen on no-such-host.invalid:0"):
        bind_listener("no-such-host.invalid", 0)


def test_admission_past_max_connections_refuses_and_stop_closes_every_connection() -> None:
    lines: list[str] = []
    limits = P.Limits(max_connections=2)
    with StoreServer("127.0.0.1", 0, limits=limits, log=lines.append) as srv:
        socks = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(3)]
        deadline = time.monotonic() + 5
        while srv.stats["dropped"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.connection_count() == 2 and srv.stats["accepted"] == 2
        assert any("2 connections open (max_connections)" in x for x in lines), lines
        for s in socks:
            s.close()
    assert srv.connection_count() == 0  # stop() closed them all


def test_a_server_stopped_before_it_started_cannot_start() -> None:
    srv = StoreServer("127.0.0.1", 0)
    srv.stop()
    with pytest.raises(StoreError, match="this StoreServer was stopped; create a new one"):
        srv.start()
