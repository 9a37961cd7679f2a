"""Tests for rendezvous.nodes.membership: in-process agents on LocalKV, real agent processes
(SIGKILL) through a real etcd and through the embedded TCP store."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
from helpers_etcd import AgentProc, EtcdServer, etcd_server  # noqa: F401 - fixture
from helpers_membership import member
from helpers_relay import Relay

from rendezvous.errors import (
    STORE_UNREACHABLE,
    SUPERSEDED,
    FencedError,
    JoinInterrupted,
    RendezvousGracefulExit,
    StoreHostLostError,
)
from rendezvous.kv import StoreTimeout
from rendezvous.nodes.keys import GENERATION_KEY, LEAVE_SIGNAL
from rendezvous.nodes.membership import Membership, NodeWorld, RendezvousError
from rendezvous.store.memory import LocalKV

FAST = dict(keep_alive_interval=0.2, heartbeat_timeout=1.0)


def _join_all(makers: list, timeout: float = 15.0) -> list:
    """Run m.join() for every Membership in threads; return worlds (or exceptions)."""
    out: list = [None] * len(makers)

    def run(i: int) -> None:
        try:
            out[i] = makers[i].join()
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(makers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return out


# -- rendezvous ------------------------------------------------------------------------------


def test_static_rendezvous_assigns_ranks_and_bases() -> None:
    kv = LocalKV()
    ms = [
        member(kv, r, 3, 3, lws, f"host{r}", "job", join_timeout=10, **FAST)
        for r, lws in ((2, 4), (0, 2), (1, 3))
    ]
    worlds = _join_all(ms)
    try:
        assert all(isinstance(w, NodeWorld) for w in worlds), worlds
        for m, w in zip(ms, worlds):
            assert w.group_rank == m.node_rank and w.group_world_size == 3
            assert w.world_size == 9 and w.leader_node == 0 and w.generation == 0
            assert [(n.host, n.local_world_size, n.rank_base) for n in w.nodes] == [
                ("host0", 2, 0),
                ("host1", 3, 2),
                ("host2", 4, 5),
            ]
            assert not w.rejoined
        assert ms[0].current_generation() == 0
        kv.set(GENERATION_KEY, b"3")
        assert {m.current_generation() for m in ms} == {3}
    finally:
        for m in ms:
            m.stop()


def test_dynamic_closes_after_last_call_and_rejects_extra_agent() -> None:
    kv = LocalKV()
    ms = [
        member(kv, None, 2, 3, 2, f"h{i}", "job", last_call_timeout=0.6, **FAST) for i in range(2)
    ]
    t0 = time.monotonic()
    worlds = _join_all(ms)
    took = time.monotonic() - t0
    try:
        assert all(isinstance(w, NodeWorld) for w in worlds), worlds
        assert 0.55 <= took < 3.0
        assert sorted(w.group_rank for w in worlds) == [0, 1]
        assert {w.world_size for w in worlds} == {4} and {w.group_world_size for w in worlds} == {2}
        # the world is closed and every member is alive: a late agent waits as a hot spare
        late = member(kv, None, 2, 3, 2, "late", "job", spare_timeout=0.5, **FAST)
        with pytest.raises(
            RendezvousError, match="no node of run job was lost within spare_timeout=0.5s"
        ):
            late.join(timeout=5)
        assert ms[0].spares() == []  # its record went with it
    finally:
        for m in ms:
            m.stop()


def test_dynamic_closes_at_max_without_waiting_for_last_call() -> None:
    kv = LocalKV()
    ms = [member(kv, None, 1, 3, 1, f"h{i}", "job", last_call_timeout=30, **FAST) for i in range(3)]
    t0 = time.monotonic()
    worlds = _join_all(ms)
    try:
        assert time.monotonic() - t0 < 5.0
        assert sorted(w.group_rank for w in worlds) == [0, 1, 2]
        assert {tuple(n.rank_base for n in w.nodes) for w in worlds} == {(0, 1, 2)}
    finally:
        for m in ms:
            m.stop()


def test_join_timeout_wrong_run_and_bad_arguments() -> None:
    kv = LocalKV()
    lonely = member(kv, 0, 2, 2, 1, "h0", "job", **FAST)
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout, match="1 of 2 nodes joined within 0.4s"):
        lonely.join(timeout=0.4)
    assert time.monotonic() - t0 < 2.0
    other = member(kv, 1, 2, 2, 1, "h1", "another-job", **FAST)
    with pytest.raises(RendezvousError, match="belongs to run 'job'"):
        other.join(timeout=1)
    for kwargs, msg in [
        (dict(node_rank=0, nnodes_min=1, nnodes_max=2), "fixed node count"),
        (dict(node_rank=5, nnodes_min=2), "must be in 0..1"),
        (dict(nnodes_min=3), "MIN <= MAX"),
        (dict(heartbeat_timeout=0.1), "must exceed"),
        (dict(run_id="a/b"), "without '/'"),
    ]:
        args = dict(
            kv=kv,
            node_rank=None,
            nnodes_min=1,
            nnodes_max=2,
            local_world_size=1,
            host="h",
            run_id="job",
            keep_alive_interval=0.2,
            heartbeat_timeout=1.0,
        )
        args.update(kwargs)
        with pytest.raises(ValueError, match=msg):
            member(**args)


# -- liveness, in-process (heartbeats on a plain KV) ---------------------------------------------


def test_heartbeat_death_replacement_and_leave_local() -> None:
    kv = LocalKV()
    ms = [member(kv, r, 3, 3, 1, f"h{r}", "job", **FAST) for r in range(3)]
    assert all(isinstance(w, NodeWorld) for w in _join_all(ms))
    events: list[tuple[int, str, int, float]] = []
    for m in ms:
        m.watch_nodes(
            lambda g, me=m.node_rank: events.append((me, "dead", g, time.monotonic())),
            lambda g, me=m.node_rank: events.append((me, "join", g, time.monotonic())),
        )
    try:
        t0 = time.monotonic()
        ms[0].stop(leave=False)  # node 0 (the checker) "crashes": its heartbeat stops
        deadline = time.monotonic() + 5
        while len([e for e in events if e[1] == "dead"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = sorted((me, g) for me, kind, g, _ in events if kind == "dead")
        assert dead == [(1, 0), (2, 0)]
        assert max(t for *_, t in events) - t0 < 1.0 + 1.0  # heartbeat_timeout + slack
        assert ms[1].alive_nodes() == [1, 2]
        # a replacement with the same node rank joins; both survivors hear of it
        repl = member(kv, 0, 3, 3, 1, "h0-new", "job", **FAST)
        w = repl.join(timeout=5)
        assert w.rejoined and w.group_rank == 0 and w.nodes[0].host == "h0-new"
        assert w.leader_node == 0 and w.nodes[0].incarnation == 2
        deadline = time.monotonic() + 3
        while len([e for e in events if e[1] == "join"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted((me, g) for me, kind, g, _ in events if kind == "join") == [(1, 0), (2, 0)]
        ms[0] = repl
        repl.watch_nodes(lambda g: events.append((0, "dead", g, time.monotonic())))
        # a graceful leave is not a death
        n_dead = len([e for e in events if e[1] == "dead"])
        ms[2].stop(leave=True)
        time.sleep(1.6)
        assert len([e for e in events if e[1] == "dead"]) == n_dead
        assert ms[1].alive_nodes() == [0, 1]
    finally:
        for m in ms:
            m.stop()


# -- real agent processes, SIGKILL ---------------------------------------------------------------


def _kill_and_replace(backend: str, endpoint: str, ttl: float) -> None:
    a = AgentProc(backend, endpoint, "proc-job", 0, "2", name="a")
    b = AgentProc(backend, endpoint, "proc-job", 1, "2", local_world_size=2, name="b")
    procs = [a, b]
    try:
        wa, wb = a.expect("world", 20), b.expect("world", 20)
        assert (wa["group_rank"], wb["group_rank"]) == (0, 1)
        assert wa["world_size"] == wb["world_size"] == 3 and wa["rank_bases"] == [0, 1]
        assert wa["leader"] == wb["leader"] == 0
        time.sleep(0.3)  # both are watching
        killed = b.kill()
        dead = a.expect("dead", ttl + 3, node=1)
        noticed = dead["t"] - killed
        print(f"\n{backend}: SIGKILLed agent noticed after {noticed:.2f}s (limit {ttl:.1f}s)")
        assert noticed <= ttl + 0.6
        b2 = AgentProc(backend, endpoint, "proc-job", 1, "2", local_world_size=2, name="b2")
        procs.append(b2)
        w2 = b2.expect("world", 20)
        assert w2["rejoined"] and w2["group_rank"] == 1 and w2["hosts"] == ["a", "b2"]
        a.expect("join", 10, node=1)
        if backend == "etcd":
            # node 0 dies too: the replacement, watching since its join, notices it
            time.sleep(0.3)
            killed = a.kill()
            dead = b2.expect("dead", ttl + 3, node=0)
            assert dead["t"] - killed <= ttl + 0.6
    finally:
        for p in procs:
            p.stop()


@pytest.mark.etcd
def test_etcd_agents_sigkill_noticed_and_replaced(etcd_server: EtcdServer) -> None:
    # hb_timeout 1.5 s -> lease TTL 2 s; etcd checks expiry every 0.5 s
    _kill_and_replace("etcd", etcd_server.endpoint, ttl=2.5)


def test_embedded_store_agents_sigkill_noticed_and_replaced() -> None:
    server_mod = pytest.importorskip("rendezvous.store.server")
    server = server_mod.StoreServer(host="127.0.0.1", port=0).start()
    try:
        _kill_and_replace("tcp", f"127.0.0.1:{server.port}", ttl=1.5 + 0.5)
    finally:
        server.stop()


@pytest.mark.etcd
def test_etcd_dynamic_rendezvous_threads(etcd_server: EtcdServer) -> None:
    from rendezvous.store.etcd import EtcdKV

    kvs = [EtcdKV(etcd_server.endpoint, "/ftrun/dyn") for _ in range(3)]
    ms = [
        member(
            kv,
            None,
            2,
            4,
            1,
            f"h{i}",
            "dyn",
            last_call_timeout=0.5,
            join_timeout=10,
            keep_alive_interval=0.3,
            heartbeat_timeout=1.5,
        )
        for i, kv in enumerate(kvs)
    ]
    try:
        worlds = _join_all(ms)
        assert all(isinstance(w, NodeWorld) for w in worlds), worlds
        assert sorted(w.group_rank for w in worlds) == [0, 1, 2]
        assert {w.world_size for w in worlds} == {3} and {w.leader_node for w in worlds} == {0}
    finally:
        for m in ms:
            m.stop()
        for kv in kvs:
            kv.close()


# -- an earlier run's leftovers ------------------------------------------------------------------


def _fresh_after_dead_run(make_kv, leave: bool, wait_gone: float) -> None:
    kvs = [make_kv() for _ in range(4)]
    try:
        first = [
            member(kvs[i], i, 2, 2, 1, f"h{i}", "reused", join_timeout=10, **FAST) for i in range(2)
        ]
        assert all(isinstance(w, NodeWorld) for w in _join_all(first))
        kvs[0].set(GENERATION_KEY, b"4")
        kvs[0].set("worker/stale", b"old")
        for m in first:
            m.stop(leave=leave)
        time.sleep(wait_gone)  # crashed agents: until their leases/heartbeats run out
        second = [
            member(kvs[2 + i], i, 2, 2, 1, f"n{i}", "reused", join_timeout=10, **FAST)
            for i in range(2)
        ]
        worlds = _join_all(second)
        try:
            assert all(isinstance(w, NodeWorld) for w in worlds), worlds
            for w in worlds:
                assert not w.rejoined and w.generation == 0
                assert [n.host for n in w.nodes] == ["n0", "n1"]
            assert kvs[2].try_get("worker/stale") is None
        finally:
            for m in second:
                m.stop()
    finally:
        for kv in kvs:
            kv.close()


def test_dead_earlier_run_is_cleared_local() -> None:
    kv = LocalKV()
    _fresh_after_dead_run(lambda: kv, leave=True, wait_gone=0.0)


@pytest.mark.etcd
def test_crashed_earlier_run_is_cleared_etcd(etcd_server: EtcdServer) -> None:
    from rendezvous.store.etcd import EtcdKV

    # leases of 1 s (heartbeat_timeout 1.0) run out within ~1.5 s of the "crash"
    _fresh_after_dead_run(
        lambda: EtcdKV(etcd_server.endpoint, "/ftrun/reused"), leave=False, wait_gone=2.0
    )


@pytest.mark.etcd
def test_duplicate_node_rank_on_etcd_is_refused(etcd_server: EtcdServer) -> None:
    from rendezvous.store.etcd import EtcdKV

    kvs = [EtcdKV(etcd_server.endpoint, "/ftrun/dup") for _ in range(2)]
    first = member(kvs[0], 0, 2, 2, 1, "first", "dup", **FAST)
    second = member(kvs[1], 0, 2, 2, 1, "second", "dup", **FAST)
    t = threading.Thread(target=lambda: pytest.raises(StoreTimeout, first.join, timeout=2.2))
    t.start()
    try:
        time.sleep(0.3)
        with pytest.raises(RendezvousError, match="already registered by first pid"):
            second.join(timeout=1.5)
    finally:
        t.join(10)
        first.stop()
        second.stop()
        for kv in kvs:
            kv.close()


# -- issue 10: dynamic ranks, interruptible join, leaving at once, hot spares, fencing ---------


class Stores:
    """Store clients of one backend ("tcp": a real embedded StoreServer, "etcd": a real etcd),
    optionally through a cuttable relay; closes everything at the end."""

    def __init__(self, backend: str, etcd: EtcdServer | None = None) -> None:
        self.backend = backend
        self._owned: list = []
        if backend == "tcp":
            from rendezvous.store.server import StoreServer

            self.server = StoreServer(host="127.0.0.1", port=0).start()
            self._owned.append(self.server)
            self.host, self.port = "127.0.0.1", self.server.port
        else:
            assert etcd is not None
            self.host, self.port = "127.0.0.1", etcd.client_port

    def client(self, relay: Relay | None = None):
        port = relay.port if relay is not None else self.port
        if self.backend == "tcp":
            from rendezvous.store.client import StoreClient

            kv = StoreClient(self.host, port, timeout=30)
        else:
            from rendezvous.store.etcd import EtcdConf, EtcdKV

            kv = EtcdKV(f"{self.host}:{port}", "/ftrun/m10", EtcdConf(request_timeout=3.0))
        self._owned.append(kv)
        return kv

    def relay(self) -> Relay:
        r = Relay(self.host, self.port)
        self._owned.append(r)
        return r

    def close(self) -> None:
        for thing in reversed(self._owned):
            with contextlib.suppress(Exception):
                (
                    thing.stop
                    if hasattr(thing, "stop") and not hasattr(thing, "close")
                    else thing.close
                )()


@pytest.fixture(params=["tcp", pytest.param("etcd", marks=pytest.mark.etcd)])
def stores(request) -> Stores:
    etcd = request.getfixturevalue("etcd_server") if request.param == "etcd" else None
    s = Stores(request.param, etcd)
    yield s
    s.close()


T = dict(keep_alive_interval=0.2, heartbeat_timeout=1.0)


class Events:
    def __init__(self) -> None:
        self.items: list[tuple[str, int]] = []
        self.cv = threading.Condition()

    def hooks(self) -> tuple:
        return (
            lambda g: self.add("dead", g),
            lambda g: self.add("join", g),
            lambda g: self.add("leader", g),
        )

    def add(self, kind: str, g: int) -> None:
        with self.cv:
            self.items.append((kind, g))
            self.cv.notify_all()

    def wait(self, item: tuple[str, int], timeout: float) -> float:
        t0 = time.monotonic()
        with self.cv:
            assert self.cv.wait_for(lambda: item in self.items, timeout), (
                f"no {item} within {timeout}s: {self.items}"
            )
        return time.monotonic() - t0


def _members(kvs: list, n: int, static: bool = True, **kw) -> list[Membership]:
    args = dict(T, join_timeout=15)
    args.update(kw)
    ms = [
        member(kv, i if static else None, n, n, 1, f"h{i}", "m10", **args)
        for i, kv in enumerate(kvs)
    ]
    worlds = _join_all(ms)
    assert all(isinstance(w, NodeWorld) for w in worlds), worlds
    return ms


def test_join_ends_promptly_on_stop_event_and_on_interrupt(stores: Stores) -> None:
    kv = stores.client()
    for how in ("event", "interrupt"):
        m = member(kv, 0, 2, 2, 1, "alone", f"m10{how}", **T)
        stop = threading.Event()
        t0 = time.monotonic()
        threading.Timer(0.3, stop.set if how == "event" else m.interrupt).start()
        with pytest.raises(JoinInterrupted):
            m.join(timeout=30, stop=stop)
        assert time.monotonic() - t0 < 0.3 + 0.8
        kv.delete_prefix("ftrun/")  # the next round uses a fresh store


def test_dynamic_agents_take_distinct_ranks_by_arrival(stores: Stores) -> None:
    kvs = [stores.client() for _ in range(3)]
    ms = [
        member(kv, None, 2, 3, 1, f"h{i}", "m10", last_call_timeout=0.5, **T)
        for i, kv in enumerate(kvs)
    ]
    try:
        w0 = ms[0]
        first = threading.Thread(target=w0.join)  # arrives first: group rank 0
        first.start()
        time.sleep(0.2)
        worlds = _join_all(ms[1:])
        first.join(10)
        assert w0.world is not None and w0.world.group_rank == 0
        assert sorted(w.group_rank for w in worlds) == [1, 2]
        assert {n.host for n in w0.world.nodes} == {"h0", "h1", "h2"}
    finally:
        for m in ms:
            m.stop()


def test_leave_is_seen_as_a_leave_within_a_second(stores: Stores) -> None:
    kvs = [stores.client() for _ in range(2)]
    ms = _members(kvs, 2)
    ev = Events()
    ms[0].watch_nodes(*ev.hooks())
    try:
        time.sleep(0.3)
        t0 = time.monotonic()
        ms[1].leave(LEAVE_SIGNAL)
        deadline = time.monotonic() + 1.0
        while 1 in ms[0].alive_nodes() and time.monotonic() < deadline:
            time.sleep(0.02)
        took = time.monotonic() - t0
        assert ms[0].alive_nodes() == [0], f"leave not seen after {took:.2f}s"
        time.sleep(T["heartbeat_timeout"] + 0.5)
        assert ("dead", 1) not in ev.items
    finally:
        for m in ms:
            m.stop()


def test_hot_spare_waits_visibly_and_takes_the_lost_nodes_rank(stores: Stores) -> None:
    kvs = [stores.client() for _ in range(3)]
    ms = _members(kvs[:2], 2, static=False, last_call_timeout=0.3)
    ev = Events()
    ms[0].watch_nodes(*ev.hooks())
    spare = member(kvs[2], None, 2, 2, 1, "spare-host", "m10", **T)
    box: list = []
    t = threading.Thread(target=lambda: box.append(spare.join(timeout=30)))
    t.start()
    try:
        deadline = time.monotonic() + 3
        while not ms[0].spares() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [s.host for s in ms[0].spares()] == ["spare-host"]
        lost = ms[1].world.me  # ranks follow arrival: node 1 may hold group rank 0
        ms[1].stop(leave=False)  # that node crashes
        ev.wait(("dead", lost.node_rank), T["heartbeat_timeout"] + 2.5)
        ev.wait(("join", lost.node_rank), 3.0)
        t.join(5)
        w = box[0]
        assert w.from_spare and w.rejoined and w.group_rank == lost.node_rank
        assert w.me.rank_base == lost.rank_base and w.me.host == "spare-host"
        assert ms[0].alive_nodes() == [0, 1] and ms[0].spares() == []
    finally:
        spare.stop()
        t.join(5)
        for m in ms:
            m.stop()


def test_spare_takes_a_signalled_nodes_rank_and_exits_when_the_run_is_done() -> None:
    kv = LocalKV()
    ms = _members([kv, kv], 2, static=False, last_call_timeout=0.3)
    spares = [member(kv, None, 2, 2, 1, f"s{i}", "m10", **T) for i in range(2)]
    out: list = [None, None]

    def run(i: int) -> None:
        try:
            out[i] = spares[i].join(timeout=30)
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 3
        while len(ms[0].spares()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        gone = ms[1].group_rank
        ms[1].leave(LEAVE_SIGNAL)  # preempted: its ranks need a new home
        deadline = time.monotonic() + 3
        while not any(isinstance(o, NodeWorld) for o in out) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert time.monotonic() - t0 < 1.5
        taker = next(i for i in range(2) if isinstance(out[i], NodeWorld))
        assert out[taker].group_rank == gone
        ms[0].stop()  # the run is over: "done"
        spares[taker].stop()
        threads[1 - taker].join(5)
        assert isinstance(out[1 - taker], RendezvousGracefulExit), out
    finally:
        for m in ms + spares:
            m.stop()
        for t in threads:
            t.join(5)


def test_cut_off_node_notices_alone_rejoins_fresh_and_its_stale_writes_are_refused(
    stores: Stores,
) -> None:
    relay = stores.relay()
    kvs = [stores.client(), stores.client(relay)]
    ms = _members(kvs, 2)
    ev = Events()
    ms[0].watch_nodes(*ev.hooks())
    old = ms[1]
    limit = old.liveness._silence_limit()
    try:
        time.sleep(0.3)
        t0 = time.monotonic()
        relay.cut()
        ev.wait(("dead", 1), limit + 2.0)
        assert old.lost.wait(limit + 1.0), "the cut-off node did not notice on its own"
        noticed = time.monotonic() - t0
        assert limit <= noticed + 0.3 and noticed <= limit + 1.0
        err = old.lost_error()
        assert err is not None and err.kind == STORE_UNREACHABLE
        time.sleep(max(0.0, 2 * limit - (time.monotonic() - t0)))
        relay.heal()
        old.stop(leave=False)
        new = old.renew()
        w = new.join(timeout=15)
        ms[1] = new
        assert w.rejoined and w.group_rank == 1 and w.me.incarnation == 2
        ev.wait(("join", 1), 3.0)
        with pytest.raises(FencedError, match="incarnation 1\\) is stale"):
            old.checked_set("ftrun/control/x", b"stale")
        with pytest.raises(FencedError):
            old.advance_generation(0, 1)
        assert kvs[0].try_get("ftrun/control/x") is None
        assert new.advance_generation(0, 1) and not new.advance_generation(0, 2)
        new.checked_set("ftrun/control/x", b"fresh")
        # a TCPStore SET has no reply: read it back on the writer's connection first (ordered
        # after the SET), then the other node sees it too
        assert kvs[1].try_get("ftrun/control/x") == b"fresh"
        assert kvs[0].try_get("ftrun/control/x") == b"fresh"
    finally:
        for m in ms:
            m.stop()


def test_a_stale_node_that_never_noticed_is_refused_at_its_next_heartbeat() -> None:
    from rendezvous.store.client import StoreClient
    from rendezvous.store.server import StoreServer

    server = StoreServer(host="127.0.0.1", port=0).start()
    relay = Relay("127.0.0.1", server.port)
    kvs = [StoreClient("127.0.0.1", p) for p in (server.port, relay.port, server.port)]
    a = member(kvs[0], 0, 2, 2, 1, "a", "m10", **T)
    # b believes the timeout is long: it will not notice the cut (a long pause looks the same)
    b = member(kvs[1], 1, 2, 2, 1, "b", "m10", keep_alive_interval=0.2, heartbeat_timeout=30)
    try:
        assert all(isinstance(w, NodeWorld) for w in _join_all([a, b]))
        ev = Events()
        a.watch_nodes(*ev.hooks())
        relay.cut()
        ev.wait(("dead", 1), 3.0)
        c = member(kvs[2], 1, 2, 2, 1, "c", "m10", **T)
        assert c.join(timeout=10).rejoined
        relay.heal()
        assert b.lost.wait(3.0) and b.lost_error().kind == SUPERSEDED
        # a hears of c's join through the event log, a moment after c.join() returns
        deadline = time.monotonic() + 5.0
        while a.alive_nodes() != [0, 1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.alive_nodes() == [0, 1]
        c.stop()
    finally:
        for m in (a, b):
            m.stop()
        relay.close()
        for kv in kvs:
            kv.close()
        server.stop()


def test_losing_the_embedded_store_host_is_reported_as_such() -> None:
    from rendezvous.store.client import StoreClient
    from rendezvous.store.server import StoreServer

    server = StoreServer(host="127.0.0.1", port=0).start()
    port = server.port
    kvs = [StoreClient("127.0.0.1", port, timeout=2) for _ in range(2)]
    ms = [
        member(
            kv, i, 2, 2, 1, f"10.0.0.{i + 1}", "m10", read_timeout=1.0, hosts_store=(i == 0), **T
        )
        for i, kv in enumerate(kvs)
    ]
    try:
        assert all(isinstance(w, NodeWorld) for w in _join_all(ms))
        assert not ms[1].can_elect
        with pytest.raises(RendezvousError, match="needs etcd"):
            ms[1].elect(lambda: None, lambda: None)
        server.stop()  # the store host's node is gone
        assert ms[1].lost.wait(T["heartbeat_timeout"] + 1.5)
        err = ms[1].lost_error()
        assert err.kind == STORE_UNREACHABLE and f"127.0.0.1:{port} (node 0)" in str(err)
        ms[1].stop(leave=False)
        t0 = time.monotonic()
        with pytest.raises(StoreHostLostError) as info:
            ms[1].renew().join(timeout=10)
        assert time.monotonic() - t0 < 1.0 + 1.5
        assert str(info.value).startswith(
            f"the store host (node 0, 127.0.0.1:{port}) is gone; with the embedded store the "
            "job cannot continue; use --rdzv-backend etcd to survive it"
        )
    finally:
        for m in ms:
            m.stop()
        for kv in kvs:
            kv.close()


def test_scale_up_restart_opens_a_new_round_that_includes_the_waiting_node(stores: Stores) -> None:
    kvs = [stores.client() for _ in range(3)]
    ms = [
        member(kv, None, 2, 3, 2, f"h{i}", "m10", last_call_timeout=0.3, scale_up="restart", **T)
        for i, kv in enumerate(kvs[:2])
    ]
    first = threading.Thread(target=ms[0].join)
    first.start()
    time.sleep(0.2)
    assert isinstance(ms[1].join(timeout=10), NodeWorld)
    first.join(10)
    assert sorted(m.group_rank for m in ms) == [0, 1]
    kvs[0].set(GENERATION_KEY, b"5")
    kvs[0].set("ftrun/plan/7", b"kept")
    kvs[0].set("worker/key", b"old world")
    rounds: list[int] = []
    for m in ms:
        m.watch_nodes(lambda g: None, on_round=rounds.append)
    late = member(
        kvs[2], None, 2, 3, 2, "late", "m10", last_call_timeout=0.3, scale_up="restart", **T
    )
    box: list = []
    t = threading.Thread(target=lambda: box.append(late.join(timeout=30)))
    t.start()
    new: list = [None, None]
    try:
        deadline = time.monotonic() + 3
        while not ms[0].spares() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [s.host for s in ms[0].spares()] == ["late"]
        assert ms[0].request_round() == 1 and ms[1].request_round() == 1  # one request wins
        deadline = time.monotonic() + 3
        while len(rounds) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rounds == [1, 1]
        movers = [
            threading.Thread(target=lambda i=i: new.__setitem__(i, ms[i].next_round(10)))
            for i in range(2)
        ]
        for th in movers:
            th.start()
        for th in movers + [t]:
            th.join(15)
        worlds = [m.world for m in new] + box
        assert all(isinstance(w, NodeWorld) for w in worlds), worlds
        assert [w.group_rank for w in worlds] == [0, 1, 2]  # survivors keep their ranks
        assert {w.round for w in worlds} == {1} and {w.group_world_size for w in worlds} == {3}
        assert [n.host for n in worlds[0].nodes] == ["h0", "h1", "late"]
        assert [n.rank_base for n in worlds[2].nodes] == [0, 2, 4]
        assert kvs[0].try_get(GENERATION_KEY) == b"5" and worlds[0].generation == 5
        assert kvs[0].try_get("ftrun/plan/7") == b"kept"
        assert kvs[0].try_get("worker/key") is None  # the previous world's workers' keys
    finally:
        for m in ms + new + [late]:
            if m is not None:
                m.stop()
        t.join(5)


def test_a_new_round_without_a_dead_node_renumbers_the_survivors_in_order(stores: Stores) -> None:
    """The world shrinks (launcher: a lost node not taken over): node 1 of 3 dies; the round
    the controller's agent requests expects the 2 survivors, which keep their order (node 2
    becomes node 1, rank base 2)."""
    kvs = [stores.client() for _ in range(3)]
    ms = [
        member(kv, None, 2, 3, 2, f"h{i}", "m11", last_call_timeout=2.0, **T)
        for i, kv in enumerate(kvs)
    ]
    new: list = [None, None]
    try:
        _join_all(ms)
        order = sorted(ms, key=lambda m: m.group_rank)
        dead_seen = threading.Event()
        for m in order:
            m.watch_nodes(lambda g: dead_seen.set() if g == 1 else None)
        order[1].stop(leave=False)  # node 1 crashes: no left marker, heartbeats stop
        assert dead_seen.wait(T["heartbeat_timeout"] + 3)
        kvs[0].set("worker/key", b"old world")
        survivors = [order[0], order[2]]
        deadline = time.monotonic() + 3
        while 1 in survivors[0].alive_nodes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert survivors[0].request_round() == 1
        movers = [
            threading.Thread(target=lambda i=i: new.__setitem__(i, survivors[i].next_round(10)))
            for i in range(2)
        ]
        for th in movers:
            th.start()
        for th in movers:
            th.join(15)
        worlds = [m.world for m in new]
        assert [w.group_rank for w in worlds] == [0, 1] and worlds[1].group_world_size == 2
        assert [n.host for n in worlds[0].nodes] == [survivors[0].host, survivors[1].host]
        assert [n.rank_base for n in worlds[1].nodes] == [0, 2] and worlds[0].world_size == 4
        assert kvs[0].try_get("worker/key") is None
    finally:
        for m in ms + new:
            if m is not None:
                m.stop()


def test_sigterm_ends_a_waiting_agent_at_once_and_a_joined_one_leaves(stores: Stores) -> None:
    endpoint = f"{stores.host}:{stores.port}"
    lonely = AgentProc(stores.backend, endpoint, "term1", 0, "2", name="lonely")
    try:
        lonely.expect("joining", 20)
        time.sleep(0.5)  # waiting for a second node
        sent = lonely.term()
        ev = lonely.expect("interrupted", 3)
        assert ev["t"] - sent < 1.0 and lonely.proc.wait(5) == 143
    finally:
        lonely.stop()
    a = AgentProc(stores.backend, endpoint, "term1", 0, "2", name="a", hb_timeout=1.0)
    b = AgentProc(stores.backend, endpoint, "term1", 1, "2", name="b", hb_timeout=1.0)
    try:
        a.expect("world", 20)
        b.expect("world", 20)
        time.sleep(0.3)
        sent = b.term()
        assert b.expect("left", 3)["t"] - sent < 1.0 and b.proc.wait(5) == 143
        with pytest.raises(AssertionError, match="no dead"):
            a.expect("dead", 2.0)  # a leave, not a death
    finally:
        for p in (a, b):
            p.stop()
