"""launcher.agent.status_relay: an agent posts its ranks' statuses of a round as one record,
once every one is in; a newer round or a stop ends the older relay; one thread (one store
connection) for every round; through a real store."""

from __future__ import annotations

import threading
import time

from launcher.agent.status_relay import WAIT_SLICE, StatusRelay
from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from rendezvous.store.client import StoreClient
from rendezvous.store.memory import LocalKV
from rendezvous.store.server import StoreServer


def status(rank: int, g: int) -> bytes:
    return P.RankStatus(rank, g, rank == 5, 4, 5, shard="dp").to_json()


def test_the_record_comes_once_every_local_rank_reported_on_one_connection() -> None:
    with StoreServer(host="127.0.0.1") as server:
        with StoreClient("127.0.0.1", server.port, timeout=10) as kv:
            halt = threading.Event()
            relay = StatusRelay(kv, 1, AgentLog(1, None, quiet=True), timeout=10.0, halt=halt)
            for g in (3, 4):  # two rounds, one after the other
                relay.follow(g, [4, 5, 6, 7])
                for r in (4, 5, 6):
                    kv.set(P.status_key(g, r), status(r, g))
                time.sleep(0.1)
                assert kv.try_get(P.node_statuses_key(g, 1)) is None  # rank 7 not in yet
                kv.set(P.status_key(g, 7), status(7, g))
                rec = P.NodeStatuses.from_json(kv.get(P.node_statuses_key(g, 1), 5.0))
                assert rec.generation == g and rec.node == 1
                by_rank = rec.ranks()
                assert sorted(by_rank) == [4, 5, 6, 7] and by_rank[5].replacement
            # the test's connection plus the relay's one thread: not one per round
            assert len(kv._links) == 2
            halt.set()
            relay.stop(join=2.0)
            assert not relay.running


def test_an_idle_relay_ends_and_releases_its_connection() -> None:
    with StoreServer(host="127.0.0.1") as server:
        with StoreClient("127.0.0.1", server.port, timeout=10) as kv:
            relay = StatusRelay(kv, 0, AgentLog(0, None, quiet=True), timeout=10.0, idle=0.2)
            relay.follow(1, [0])
            kv.set(P.status_key(1, 0), status(0, 1))
            assert kv.wait([P.node_statuses_key(1, 0)], 5.0)
            deadline = time.monotonic() + 5.0
            while relay.running and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not relay.running and len(kv._links) == 1  # only the test's own


def test_a_newer_round_or_a_stop_ends_the_relay() -> None:
    kv = LocalKV()
    halt = threading.Event()
    relay = StatusRelay(kv, 0, AgentLog(0, None, quiet=True), timeout=10.0, halt=halt, idle=0.3)
    relay.follow(1, [0, 1])
    relay.follow(2, [0, 1])  # round 2 supersedes round 1
    for r in (0, 1):
        kv.set(P.status_key(1, r), status(r, 1))
    time.sleep(0.7)
    assert kv.try_get(P.node_statuses_key(1, 0)) is None  # nobody relays round 1 any more
    relay.stop()  # nor round 2
    kv.set(P.status_key(2, 0), status(0, 2))
    kv.set(P.status_key(2, 1), status(1, 2))
    time.sleep(0.7)
    assert kv.try_get(P.node_statuses_key(2, 0)) is None
    assert not relay.running  # idle: its thread ended
    relay.follow(3, [])  # no local rank in the round: nothing to relay, no thread
    assert not relay.running
    relay.follow(4, [0])  # a thread again
    kv.set(P.status_key(4, 0), status(0, 4))
    assert kv.wait([P.node_statuses_key(4, 0)], 5.0)
    halt.set()  # the agent's own stop
    relay.stop(join=2.0)
    assert not relay.running


def test_a_newer_round_is_relayed_at_once_while_the_older_ones_wait_is_pending() -> None:
    """Issue 32: a rank killed during a round leaves that round's keys incomplete; the newer
    round's record comes as soon as its statuses are in, not after the older wait's slice."""
    with StoreServer(host="127.0.0.1") as server:
        with StoreClient("127.0.0.1", server.port, timeout=10) as kv:
            halt = threading.Event()
            relay = StatusRelay(kv, 0, AgentLog(0, None, quiet=True), timeout=10.0, halt=halt)
            relay.follow(1, [0, 1])
            kv.set(P.status_key(1, 0), status(0, 1))  # rank 1 died: round 1 never completes
            time.sleep(0.1)  # the relay waits on round 1's keys
            relay.follow(2, [0, 1])
            t0 = time.monotonic()
            for r in (0, 1):
                kv.set(P.status_key(2, r), status(r, 2))
            assert kv.wait([P.node_statuses_key(2, 0)], 5.0)
            assert time.monotonic() - t0 < WAIT_SLICE / 2  # was the rest of a 0.5 s slice
            assert kv.try_get(P.node_statuses_key(1, 0)) is None
            halt.set()
            relay.stop(join=2.0)


def test_the_statuses_a_wait_found_are_read_in_one_request_without_waiting_again() -> None:
    with StoreServer(host="127.0.0.1") as server:
        with StoreClient("127.0.0.1", server.port, timeout=10) as kv:
            halt = threading.Event()
            calls: list[str] = []
            real_wait, real_present = kv.wait, kv.present
            kv.wait = lambda keys, t: calls.append("wait") or real_wait(keys, t)  # type: ignore
            kv.present = lambda keys: calls.append("present") or real_present(keys)  # type: ignore
            kv.multi_get = lambda keys, t: calls.append("multi_get") or []  # type: ignore
            relay = StatusRelay(kv, 0, AgentLog(0, None, quiet=True), timeout=10.0, halt=halt)
            for r in (0, 1):
                kv.set(P.status_key(2, r), status(r, 2))
            relay.follow(2, [0, 1])
            assert real_wait([P.node_statuses_key(2, 0)], 5.0)
            rec = P.NodeStatuses.from_json(kv.try_get(P.node_statuses_key(2, 0)))
            assert sorted(rec.ranks()) == [0, 1]
            assert calls[-2:] == ["wait", "present"] and "multi_get" not in calls
            halt.set()
            relay.stop(join=2.0)
