"""The agent's store feeds: one event per key of a numbered sequence, in order, from a start."""

from __future__ import annotations

import queue
import time

from launcher.agent.agent_events import InjectEvent, PlanEvent, inject_feed, plan_feed
from launcher.protocol import plan as P
from rendezvous.store.memory import LocalKV


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


def test_a_feed_stopped_while_its_store_call_hangs_delivers_nothing_afterwards() -> None:
    """A self-fenced agent stops its plan feed while the store is unreachable: stop() gives up
    joining the blocked call, and when the link came back the old feed still delivered the plan
    of the round the node was cut off in, after the rejoined agent had moved on (CI: the agent's
    generation went from 2 back to 1 and the job's end barrier never filled)."""
    import threading

    class Unreachable(LocalKV):
        def __init__(self) -> None:
            super().__init__()
            self.blocked, self.link = threading.Event(), threading.Event()

        def wait(self, keys, timeout):  # type: ignore[no-untyped-def]
            self.blocked.set()
            self.link.wait(10)  # ignores the timeout, as a call on a cut link did
            return super().wait(keys, timeout)

    kv, q = Unreachable(), queue.Queue()
    feed = plan_feed(kv, 0, q)
    feed.start()
    assert kv.blocked.wait(5)
    feed.stop(timeout=0.1)
    kv.set(P.plan_key(1), P.Plan(generation=1, strategy=P.RECOVER_IN_PLACE).to_json())
    kv.link.set()
    feed._thread.join(5)
    assert not feed._thread.is_alive()
    assert q.empty()


def test_an_idle_feed_on_the_tcp_store_waits_long_and_stops_at_once() -> None:
    """bench_scale at 4096 ranks: two feeds per agent waiting 0.5 s at a time were 8 store
    requests per node per second (WAIT + CANCEL_WAIT each). On the TCP store a feed waits
    LONG_WAIT s, still delivers a plan as soon as it is written, and stop() interrupts the
    wait instead of joining it out."""
    import time

    from launcher.agent.agent_events import LONG_WAIT
    from rendezvous.store.client import StoreClient
    from rendezvous.store.server import StoreServer

    class Counting(StoreClient):
        waits = 0

        def wait_values(self, keys, timeout):  # type: ignore[no-untyped-def]
            Counting.waits += 1  # the feed's waits (FT_WAIT_VALUES on ftrun's server)
            return super().wait_values(keys, timeout)

    with StoreServer(host="127.0.0.1") as server:
        kv, q = Counting("127.0.0.1", server.port, timeout=30), queue.Queue()
        feed = plan_feed(kv, 0, q)
        assert feed.wait_s == LONG_WAIT >= 5.0
        feed.start()
        try:
            time.sleep(2.0)
            assert Counting.waits == 1  # one wait, still blocked (0.5 s waits: 4 by now)
            t0 = time.monotonic()
            kv.set(P.plan_key(1), P.Plan(generation=1, strategy=P.RETRY).to_json())
            ev = q.get(timeout=5)
            assert isinstance(ev, PlanEvent) and time.monotonic() - t0 < 0.5
            time.sleep(0.2)  # waiting for plan 2 now
            t0 = time.monotonic()
            feed.stop()
            assert not feed._thread.is_alive() and time.monotonic() - t0 < 0.5
        finally:
            feed.stop()
            kv.close()


def test_a_plan_reaches_a_feed_on_ftruns_server_in_one_request() -> None:
    """The plan's fan-out (issue 35): each waiting agent's wake-up carries the plan
    (FT_WAIT_VALUES), one request per agent and plan instead of WAIT then MULTI_GET."""
    from rendezvous.store.client import StoreClient
    from rendezvous.store.server import StoreServer

    with StoreServer(host="127.0.0.1") as server:
        kv, q = StoreClient("127.0.0.1", server.port, timeout=30), queue.Queue()
        feed = plan_feed(kv, 0, q)
        feed.start()
        try:
            deadline = time.monotonic() + 5
            while server.stats["requests"] < 3 and time.monotonic() < deadline:
                time.sleep(0.01)  # VALIDATE, PING and the feed's wait arrived
            time.sleep(0.1)
            before = server.stats["requests"]
            plan = P.Plan(generation=1, strategy=P.RETRY)
            server.kv.set(P.plan_key(1), plan.to_json())  # not a request of any connection
            ev = q.get(timeout=5)
            assert isinstance(ev, PlanEvent) and ev.plan == plan
            time.sleep(0.2)  # the feed now waits for plan 2: one more request
            assert server.stats["requests"] - before == 1
        finally:
            feed.stop()
            kv.close()


def test_a_feed_on_a_store_that_cannot_interrupt_waits_keeps_short_waits() -> None:
    from launcher.agent.agent_events import SHORT_WAIT

    kv = LocalKV()
    assert not kv.interruptible_waits and plan_feed(kv, 0, queue.Queue()).wait_s == SHORT_WAIT
