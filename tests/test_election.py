"""Tests for rendezvous.nodes.election: controller election on a real etcd (one winner, takeover
when the controller's node crashes or is cut off, resign on leave)."""

from __future__ import annotations

import threading
import time

import pytest
from helpers_etcd import EtcdServer, etcd_server  # noqa: F401 - fixture
from helpers_membership import member
from helpers_relay import Relay

from rendezvous.nodes.membership import NodeWorld

pytestmark = pytest.mark.etcd
T = dict(keep_alive_interval=0.2, heartbeat_timeout=1.0)


class Roles:
    """Records (kind, group rank) of election callbacks."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []
        self.cv = threading.Condition()

    def hooks(self, gr: int) -> tuple:
        return (lambda: self._add("elected", gr), lambda: self._add("deposed", gr))

    def _add(self, kind: str, gr: int) -> None:
        with self.cv:
            self.seen.append((kind, gr))
            self.cv.notify_all()

    def wait(self, pred, timeout: float) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: pred(self.seen), timeout), self.seen


def _world(server: EtcdServer, n: int, relay_for: int | None = None):
    from rendezvous.store.etcd import EtcdConf, EtcdKV

    relay = Relay("127.0.0.1", server.client_port) if relay_for is not None else None
    kvs = [
        EtcdKV(
            relay.endpoint if i == relay_for and relay else server.endpoint,
            "/ftrun/elect",
            EtcdConf(request_timeout=3.0),
        )
        for i in range(n)
    ]
    ms = [member(kv, i, n, n, 1, f"h{i}", "elect", **T) for i, kv in enumerate(kvs)]
    out: list = [None] * n
    threads = [
        threading.Thread(target=lambda i=i: out.__setitem__(i, ms[i].join(timeout=15)))
        for i in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert all(isinstance(w, NodeWorld) for w in out), out
    return kvs, ms, relay


def _close(kvs, ms, relay) -> None:
    for m in ms:
        m.stop()
    if relay is not None:
        relay.close()
    for kv in kvs:
        kv.close()


def test_one_controller_and_takeover_when_its_node_crashes(etcd_server: EtcdServer) -> None:
    kvs, ms, relay = _world(etcd_server, 3)
    roles = Roles()
    try:
        ms[0].elect(*roles.hooks(0))
        time.sleep(0.3)
        for gr in (1, 2):
            ms[gr].elect(*roles.hooks(gr))
        time.sleep(0.5)
        assert roles.seen == [("elected", 0)]
        assert {m.controller() for m in ms} == {0}
        t0 = time.monotonic()
        ms[0].stop(leave=False)  # node 0 crashes: its lease runs out
        roles.wait(lambda s: len(s) == 2, 1.0 + 2.5)
        took = time.monotonic() - t0
        new = roles.seen[1]
        assert new[0] == "elected" and new[1] in (1, 2) and took <= 1.0 + 2.0
        assert ms[3 - new[1]].controller() == new[1]
        # a graceful leave resigns at once
        t0 = time.monotonic()
        ms[new[1]].stop()
        roles.wait(lambda s: len(s) == 3, 2.0)
        assert roles.seen[2] == ("elected", 3 - new[1]) and time.monotonic() - t0 < 1.0
    finally:
        _close(kvs, ms, relay)


def test_cut_off_controller_is_deposed_and_replaced(etcd_server: EtcdServer) -> None:
    kvs, ms, relay = _world(etcd_server, 2, relay_for=0)
    roles = Roles()
    try:
        election = ms[0].elect(*roles.hooks(0))
        roles.wait(lambda s: s == [("elected", 0)], 2.0)
        ms[1].elect(*roles.hooks(1))
        assert election.leading
        relay.cut()
        roles.wait(lambda s: ("elected", 1) in s and ("deposed", 0) in s, 1.0 + 3.0)
        assert not election.leading and ms[1].controller() == 1
        relay.heal()
        time.sleep(0.5)
        assert ms[0].controller() == 1 and roles.seen.count(("elected", 0)) == 1
    finally:
        _close(kvs, ms, relay)


def test_the_leader_rule_leader_is_preferred_and_a_takeover_knows_its_predecessor(
    etcd_server: EtcdServer,
) -> None:
    """Others defer their first campaign (two keep-alive intervals), so node 0 wins even when
    it runs last; the one that takes over after node 0's crash names it (`previous`)."""
    kvs, ms, relay = _world(etcd_server, 3)
    roles = Roles()
    try:
        others = [ms[gr].elect(*roles.hooks(gr)) for gr in (2, 1)]
        time.sleep(0.1)
        ms[0].elect(*roles.hooks(0))
        roles.wait(lambda s: len(s) >= 1, 2.0)
        time.sleep(0.5)
        assert roles.seen == [("elected", 0)]
        ms[0].stop(leave=False)  # node 0 crashes
        roles.wait(lambda s: len(s) == 2, 1.0 + 2.5)
        new = roles.seen[1][1]
        winner = others[0] if new == 2 else others[1]
        assert winner.previous is not None and winner.previous["group_rank"] == 0
        assert winner.previous["host"] == "h0"
        assert "lease expired" in ms[new].why_gone(0, winner.previous["incarnation"])
    finally:
        _close(kvs, ms, relay)
