"""Tests for rendezvous.nodes.hosting: is_host by the endpoint's address, and the second agent on
the store host joining as a client (the same c10d command started twice on one host)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest
from helpers_membership import member
from helpers_store import free_port, stop_process

from rendezvous.kv import StoreError
from rendezvous.nodes.hosting import host_or_join, is_local_address, wants_to_host
from rendezvous.nodes.keys import RUN_ID_KEY
from rendezvous.nodes.membership import NodeWorld
from rendezvous.store.client import StoreClient


def test_is_host_by_address_and_override() -> None:
    assert is_local_address("127.0.0.1") and is_local_address("localhost")
    assert not is_local_address("192.0.2.77")  # TEST-NET-1: never this machine
    assert not is_local_address("no-such-host.invalid")
    assert wants_to_host("127.0.0.1", {}) and not wants_to_host("192.0.2.77", {})
    assert wants_to_host("192.0.2.77", {"is_host": "true"})
    assert not wants_to_host("127.0.0.1", {"is_host": "False"})
    with pytest.raises(ValueError, match="is_host='maybe': must be true or false"):
        wants_to_host("127.0.0.1", {"is_host": "maybe"})


def test_same_command_twice_on_one_host_one_hosts_one_joins() -> None:
    port = free_port()
    first = host_or_join("127.0.0.1", port, "j1", want_host=True)
    second = host_or_join("127.0.0.1", port, "j1", want_host=True)
    try:
        assert first.hosting and first.server is not None
        assert not second.hosting and second.server is None
        ms = [
            member(
                h.kv,
                None,
                2,
                2,
                1,
                f"h{i}",
                "j1",
                hosts_store=h.hosting,
                keep_alive_interval=0.2,
                heartbeat_timeout=1.0,
            )
            for i, h in enumerate((first, second))
        ]
        out: list = [None, None]
        ts = [
            threading.Thread(target=lambda i=i: out.__setitem__(i, ms[i].join(timeout=10)))
            for i in range(2)
        ]
        for t in ts:
            t.start()
        for t in ts:
            t.join(15)
        assert all(isinstance(w, NodeWorld) for w in out), out
        assert sorted(w.group_rank for w in out) == [0, 1]
        host = out[0].store_host()
        assert host is not None and host.host == "h0"
        for m in ms:
            m.stop()
        # another run's agent on the same port is told so
        first.kv.set(RUN_ID_KEY, b"j1")
        with pytest.raises(StoreError, match="in use by the store of run 'j1', not 'j2'"):
            host_or_join("127.0.0.1", port, "j2", want_host=True)
    finally:
        second.kv.close()
        first.server.stop()


def test_port_held_by_something_else_is_one_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen(1)
        port = s.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="in use on this host by something that is not"):
            host_or_join("127.0.0.1", port, "j", want_host=True, probe_timeout=2.0)
        assert 2.0 <= time.monotonic() - t0 < 6.0


def test_a_store_that_answers_late_is_joined_not_taken_for_something_else() -> None:
    """The agent that lost the race for the port waits for the store holding it to answer (up
    to `probe_timeout`): on a loaded host the winner's store can take seconds to answer its
    first connection. CI at stop 34: both agents of `the same c10d command twice` exited 1,
    one with "in use ... by something that is not an ftrun/torch store" after a 3 s probe.
    Here the holder is stopped (SIGSTOP) for 4 s.

    The holder is this test's own store, and the test makes sure of it: the run id is unique to
    the test and written into that store (a stranger's store would be refused as another run's),
    the store's key `nonce` is read back through the joined client, and the probe starts only
    once every thread of the holder is stopped (CI: the holder answered 1 ms after kill(),
    before its loop thread had stopped)."""
    port = free_port()
    run_id, nonce = f"late-{uuid.uuid4().hex}", uuid.uuid4().hex.encode()
    srv = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rendezvous.store.store_cli",
            "serve",
            "--host",
            "0.0.0.0",
            "--port",
            str(port),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    resume = threading.Timer(4.0, srv.send_signal, (signal.SIGCONT,))
    try:
        assert "listening on" in srv.stdout.readline()
        with StoreClient("127.0.0.1", port, timeout=10) as own:
            own.set(RUN_ID_KEY, run_id.encode())
            own.set("nonce", nonce)
        stop_process(srv.pid)
        resume.start()
        t0 = time.monotonic()
        h = host_or_join("127.0.0.1", port, run_id, want_host=True, timeout=10)
        took = time.monotonic() - t0
        try:
            assert not h.hosting and h.server is None and 3.5 <= took < 14.0, took
            assert h.kv.try_get("nonce") == nonce  # this test's store, not a stranger's
            h.kv.set("late", b"1")
            assert h.kv.try_get("late") == b"1"
        finally:
            h.kv.close()
    finally:
        resume.cancel()
        srv.send_signal(signal.SIGCONT)
        srv.terminate()
        srv.wait(10)
