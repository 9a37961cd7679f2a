"""launcher.runtime.build_stores: a newer stop leaves a store wait of an older build at once."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from launcher.runtime.build_stores import BuildStores
from tests.helpers_ports import free_port


def test_a_newer_stop_fails_an_older_builds_wait_at_once_and_spares_the_current_one() -> None:
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    target = [0]

    def connect() -> dist.TCPStore:
        return dist.TCPStore(
            "127.0.0.1",
            port,
            is_master=False,
            timeout=timedelta(seconds=60),
            wait_for_workers=False,
        )

    stores = BuildStores(connect, lambda: target[0])
    old = stores.open(1)
    current = stores.open(2)
    assert stores.open_generations() == [1, 2]
    outcome: list[object] = []

    def wait_for_a_dead_peer() -> None:
        t0 = time.monotonic()
        try:
            old.wait(["address/of/a/dead/rank"])
            outcome.append("returned")
        except Exception as exc:  # noqa: BLE001 - the failure is what is expected
            outcome.append((type(exc).__name__, time.monotonic() - t0))

    waiter = threading.Thread(target=wait_for_a_dead_peer, daemon=True)
    waiter.start()
    time.sleep(0.3)
    assert not outcome  # waiting (60 s timeout)
    target[0] = 2
    assert stores.interrupt(2) == [1]  # generation 1's build was still running: left
    waiter.join(10)
    assert outcome and outcome[0] != "returned", outcome
    assert outcome[0][1] < 5.0, outcome  # left at once, not after the store timeout
    assert stores.open_generations() == [2]
    current.set("k", b"v")  # the current generation's connection still works
    assert server.get("k") == b"v"
    stores.finished(2)
    assert stores.interrupt(3) == []  # a finished build's connection is shut, no build left
    assert stores.open_generations() == []
    with pytest.raises(Exception):  # noqa: B017 - torch's store raises DistNetworkError & co.
        current.set("k", b"w")


def test_a_stop_that_arrived_while_connecting_shuts_the_new_connection_at_once() -> None:
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)

    def connect() -> dist.TCPStore:
        return dist.TCPStore(
            "127.0.0.1",
            port,
            is_master=False,
            timeout=timedelta(seconds=60),
            wait_for_workers=False,
        )

    stores = BuildStores(connect, lambda: 4)  # a stop for generation 4 is already known
    late = stores.open(3)
    assert stores.open_generations() == []
    t0 = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - torch's store raises DistNetworkError & co.
        late.wait(["never/set"])
    assert time.monotonic() - t0 < 5.0  # not the 60 s store timeout
    del server
