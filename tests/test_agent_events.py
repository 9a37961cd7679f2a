"""The agent's store feeds: one event per key of a numbered sequence, in order, from a start."""
from __future__ import annotations

import queue

from launcher import plan as P
from launcher.agent_events import InjectEvent, PlanEvent, inject_feed, plan_feed
from rendezvous.memory import LocalKV


def test_plan_feed_delivers_the_plans_after_a_generation_in_order() -> None:
    kv, q = LocalKV(), queue.Queue()
    kv.set(P.plan_key(1), P.Plan(generation=1, strategy=P.RETRY).to_json())  # before: not replayed
    feed = plan_feed(kv, 1, q)
    feed.start()
    try:
        kv.set(P.plan_key(3), P.Plan(generation=3, strategy=P.EXIT).to_json())
        kv.set(P.plan_key(2), P.Plan(generation=2, strategy=P.RESTART_ALL).to_json())
        got = [q.get(timeout=5), q.get(timeout=5)]
        assert all(isinstance(e, PlanEvent) for e in got)
        assert [e.plan.generation for e in got] == [2, 3]
        assert q.empty()
    finally:
        feed.stop()
    assert not feed._thread.is_alive()


def test_inject_feed_skips_requests_made_before_the_agent_started() -> None:
    kv, q = LocalKV(), queue.Queue()
    kv.add(P.INJECT_SEQ, 1)
    kv.set(P.inject_key(1), P.Injection(rank=0, kind="kill").to_json())
    feed = inject_feed(kv, q)
    feed.start()
    try:
        seq = kv.add(P.INJECT_SEQ, 1)
        kv.set(P.inject_key(seq), P.Injection(rank=1, kind="uce-low", step=4).to_json())
        ev = q.get(timeout=5)
        assert isinstance(ev, InjectEvent) and (ev.injection.rank, ev.injection.step) == (1, 4)
    finally:
        feed.stop()
