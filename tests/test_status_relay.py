"""launcher.agent.status_relay: an agent posts its ranks' statuses of a round as one record,
once every one is in; a newer round or a stop ends the older relay; through a real store."""

from __future__ import annotations

import threading
import time

from launcher.agent.status_relay import StatusRelay
from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from rendezvous.store.client import StoreClient
from rendezvous.store.memory import LocalKV
from rendezvous.store.server import StoreServer


def status(rank: int, g: int) -> bytes:
    return P.RankStatus(rank, g, rank == 5, 4, 5, shard="dp").to_json()


def test_the_record_comes_once_every_local_rank_reported() -> None:
    with StoreServer(host="127.0.0.1") as server:
        with StoreClient("127.0.0.1", server.port, timeout=10) as kv:
            relay = StatusRelay(kv, 1, AgentLog(1, None, quiet=True), timeout=10.0)
            relay.follow(3, [4, 5, 6, 7])
            for r in (4, 5, 6):
                kv.set(P.status_key(3, r), status(r, 3))
            time.sleep(0.1)
            assert kv.try_get(P.node_statuses_key(3, 1)) is None  # rank 7 has not reported
            kv.set(P.status_key(3, 7), status(7, 3))
            raw = kv.get(P.node_statuses_key(3, 1), 5.0)
            rec = P.NodeStatuses.from_json(raw)
            assert rec.generation == 3 and rec.node == 1
            by_rank = rec.ranks()
            assert sorted(by_rank) == [4, 5, 6, 7] and by_rank[5].replacement
            relay.stop()


def test_a_newer_round_or_a_stop_ends_the_relay() -> None:
    kv = LocalKV()
    halt = threading.Event()
    relay = StatusRelay(kv, 0, AgentLog(0, None, quiet=True), timeout=10.0, halt=halt)
    relay.follow(1, [0, 1])
    old = relay._thread
    relay.follow(2, [0, 1])  # round 2 supersedes round 1
    assert old is not None
    old.join(2.0)
    assert not old.is_alive()
    for r in (0, 1):
        kv.set(P.status_key(1, r), status(r, 1))
    time.sleep(0.1)
    assert kv.try_get(P.node_statuses_key(1, 0)) is None  # nobody relays round 1 any more
    halt.set()  # the agent's own stop
    t = relay._thread
    assert t is not None
    t.join(2.0)
    assert not t.is_alive()
    relay.follow(3, [])  # no local rank in the round: nothing to relay, no thread
    assert relay._thread is None or not relay._thread.is_alive()
