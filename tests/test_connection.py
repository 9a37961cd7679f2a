"""Tests for rendezvous.store.connection: a new connection's state, the handshake rule and how a
peer address is written."""

from __future__ import annotations

import socket

import pytest

from rendezvous.store import protocol as P
from rendezvous.store.connection import Conn, DropConnection, check_validate, peer_str


def test_peer_str_writes_ipv4_mapped_addresses_as_ipv4_and_brackets_ipv6() -> None:
    assert peer_str(("10.0.0.1", 5)) == "10.0.0.1:5"
    assert peer_str(("::ffff:10.0.0.1", 5, 0, 0)) == "10.0.0.1:5"
    assert peer_str(("fe80::1", 29500, 0, 0)) == "[fe80::1]:29500"
    assert peer_str("/tmp/sock") == "/tmp/sock"


def test_check_validate_wants_validate_with_torchs_magic_first() -> None:
    check_validate(P.Request(P.Op.VALIDATE, (), (), P.VALIDATION_MAGIC))
    with pytest.raises(DropConnection, match="first message was GET, expected VALIDATE"):
        check_validate(P.Request(P.Op.GET, (b"/k",)))
    with pytest.raises(DropConnection, match="VALIDATE with magic 0x1, expected 0x3c85f7ce"):
        check_validate(P.Request(P.Op.VALIDATE, (), (), 1))


def test_a_new_connection_has_nothing_buffered_and_is_not_validated() -> None:
    a, b = socket.socketpair()
    try:
        c = Conn(a, "peer", authed=False, now=12.5)
        assert (c.fd, c.peer, c.since) == (a.fileno(), "peer", 12.5)
        assert c.buf == b"" and c.out == [] and c.out_bytes == 0 and not c.slots
        assert not (c.validated or c.authed or c.mux or c.closed or c.want_write or c.more)
        assert c.waiter is None and c.mux_waiters == {} and c.partial_since == 0.0
    finally:
        a.close()
        b.close()
