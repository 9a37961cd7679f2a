"""The agent's worker channel: messages in, stop pushed out, no stale socket left."""

from __future__ import annotations

import json
import os
import queue
import socket
import time

import pytest

from launcher.protocol.messages import Heartbeat, Hello, Stop
from launcher.workers.channel import ChannelMessage, ChannelServer


def test_hello_heartbeat_and_push(tmp_path) -> None:
    q: queue.Queue = queue.Queue()
    path = str(tmp_path / "a.sock")
    srv = ChannelServer(path, q)
    try:
        c = socket.socket(socket.AF_UNIX)
        c.connect(path)
        c.sendall(
            b'{"op":"hello","rank":3,"pid":99}\n{"op":"heartbeat","rank":3,"step":1}\nnot json\n'
            b'{"op":"stop","generation":"x"}\n{"op":"bye","rank":3}\n'
        )
        m1, m2, m3 = q.get(timeout=5), q.get(timeout=5), q.get(timeout=5)
        assert isinstance(m1, ChannelMessage) and m1.rank == 3 and m1.msg == Hello(rank=3, pid=99)
        assert m2.msg == Heartbeat(rank=3, step=1) and m2.pid == 99
        assert m3.msg.op == "bye" and srv.malformed == 2  # the two bad lines were dropped
        assert srv.connected_ranks() == {3}
        assert srv.send(3, Stop(generation=2))
        c.settimeout(5)
        assert json.loads(c.recv(4096).decode().strip()) == {
            "op": "stop",
            "generation": 2,
            "strategy": "",
            "failed_ranks": [],
        }
        assert not srv.send(4, Stop(generation=2))
        c.close()
    finally:
        srv.stop()
    assert not os.path.exists(path)


def test_connecting_knows_a_connection_by_its_process_and_a_pending_one(tmp_path) -> None:
    """Issue 32: a spare may overtake a cold replacement only while that process has no
    connection to the channel (open, or waiting to be accepted)."""
    q: queue.Queue = queue.Queue()
    path = str(tmp_path / "c.sock")
    srv = ChannelServer(path, q)
    try:
        assert not srv.connecting(os.getpid())
        c = socket.socket(socket.AF_UNIX)
        c.connect(path)  # no hello yet: known by its process (SO_PEERCRED) once accepted
        other = os.getpid() + 1_000_000
        deadline = time.monotonic() + 5
        while srv.connecting(other) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not srv.connecting(other)  # a pending one might be anyone's; accepted, it is known
        assert srv.connecting(os.getpid())
        c.close()
    finally:
        srv.stop()


def test_a_kept_rank_stays_with_its_process_until_the_other_is_promoted(tmp_path) -> None:
    """A hot switch: the rank's second process says hello while the first still runs; the
    rank's messages stay with the first until `release(promote=True)`; without promote the
    second connection never becomes the rank's."""
    q: queue.Queue = queue.Queue()
    path = str(tmp_path / "k.sock")
    srv = ChannelServer(path, q)
    conns = []
    try:

        def hello(pid: int) -> socket.socket:
            c = socket.socket(socket.AF_UNIX)
            c.connect(path)
            c.settimeout(5)
            c.sendall(b'{"op":"hello","rank":1,"pid":%d}\n' % pid)
            assert q.get(timeout=5).pid == pid
            conns.append(c)
            return c

        old = hello(10)
        srv.keep(1, 10)
        new = hello(11)
        assert srv.send(1, Stop(generation=1))
        assert json.loads(old.recv(4096).decode())["generation"] == 1
        srv.release(1, promote=True)
        assert srv.send(1, Stop(generation=2))
        assert json.loads(new.recv(4096).decode())["generation"] == 2
        srv.keep(1, 11)
        third = hello(12)
        srv.release(1, promote=False)  # abandoned: the third stays out
        assert srv.send(1, Stop(generation=3))
        assert json.loads(new.recv(4096).decode())["generation"] == 3
        third.settimeout(0.2)
        with pytest.raises(socket.timeout):
            third.recv(4096)
    finally:
        for c in conns:
            c.close()


def test_a_send_for_a_process_skips_its_killed_predecessors_connection(tmp_path) -> None:
    """Issue 32: a rank killed during a round may leave its connection open for a while (the
    kernel tears a big process down before closing its files); a stop meant for the replacement
    must not go there, and lands on the replacement's own connection once it said hello."""
    q: queue.Queue = queue.Queue()
    path = str(tmp_path / "p.sock")
    srv = ChannelServer(path, q)
    try:
        old = socket.socket(socket.AF_UNIX)
        old.connect(path)
        old.sendall(b'{"op":"hello","rank":1,"pid":100}\n')
        q.get(timeout=5)
        assert not srv.send(1, Stop(generation=2), pid=200)  # the replacement is pid 200
        old.settimeout(0.2)
        try:
            assert old.recv(4096) == b""
        except socket.timeout:
            pass  # nothing came: the predecessor got no stop
        new = socket.socket(socket.AF_UNIX)
        new.connect(path)
        new.sendall(b'{"op":"hello","rank":1,"pid":200}\n')
        q.get(timeout=5)
        assert srv.send(1, Stop(generation=2), pid=200)
        new.settimeout(5)
        assert json.loads(new.recv(4096).decode().strip())["generation"] == 2
        old.close()
        new.close()
    finally:
        srv.stop()
