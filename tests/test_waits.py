"""Tests for rendezvous.nodes.waits: sliced store waits that end promptly on a stop request."""

from __future__ import annotations

import threading
import time

import pytest

from rendezvous.errors import JoinInterrupted
from rendezvous.nodes.waits import SLICE, Interrupt, wait_keys
from rendezvous.store.client import StoreClient
from rendezvous.store.memory import LocalKV
from rendezvous.store.server import StoreServer


def test_wait_keys_returns_on_key_timeout_and_stop() -> None:
    server = StoreServer(host="127.0.0.1", port=0).start()
    kv = StoreClient("127.0.0.1", server.port)
    try:
        stop = Interrupt()
        threading.Timer(0.3, kv.set, args=("k", b"1")).start()
        t0 = time.monotonic()
        assert wait_keys(kv, ["k"], time.monotonic() + 5, stop, "test")
        assert time.monotonic() - t0 < 1.0
        t0 = time.monotonic()
        assert not wait_keys(kv, ["never"], time.monotonic() + 0.4, stop, "test")
        assert 0.35 < time.monotonic() - t0 < 0.4 + SLICE + 0.2
        outside = threading.Event()
        stop.follow(outside)
        threading.Timer(0.3, outside.set).start()
        t0 = time.monotonic()
        with pytest.raises(JoinInterrupted, match="test: interrupted"):
            wait_keys(kv, ["never"], time.monotonic() + 30, stop, "test")
        assert time.monotonic() - t0 < 0.3 + SLICE + 0.3
    finally:
        kv.close()
        server.stop()


def test_interrupt_sleep_and_set() -> None:
    stop = Interrupt()
    assert stop.sleep(0.05) and not stop.is_set()
    threading.Timer(0.1, stop.set).start()
    t0 = time.monotonic()
    assert not stop.sleep(10)
    assert time.monotonic() - t0 < 0.1 + SLICE
    with pytest.raises(JoinInterrupted):
        wait_keys(LocalKV(), ["k"], time.monotonic() + 10, stop, "x")
