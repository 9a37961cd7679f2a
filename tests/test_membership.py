"""Tests for rendezvous.membership: in-process agents on LocalKV, real agent processes
(SIGKILL) through a real etcd and through the embedded TCP store."""
from __future__ import annotations

import threading
import time

import pytest

from helpers_etcd import AgentProc, EtcdServer, etcd_server  # noqa: F401 - fixture
from rendezvous.keys import GENERATION_KEY
from rendezvous.kv import StoreTimeout
from rendezvous.membership import Membership, NodeWorld, RendezvousError
from rendezvous.memory import LocalKV

FAST = dict(heartbeat_interval=0.2, heartbeat_timeout=1.0)


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
    ms = [Membership(kv, r, 3, 3, lws, f"host{r}", "job", join_timeout=10, **FAST)
          for r, lws in ((2, 4), (0, 2), (1, 3))]
    worlds = _join_all(ms)
    try:
        assert all(isinstance(w, NodeWorld) for w in worlds), worlds
        for m, w in zip(ms, worlds):
            assert w.group_rank == m.node_rank and w.group_world_size == 3
            assert w.world_size == 9 and w.leader_node == 0 and w.generation == 0
            assert [(n.host, n.local_world_size, n.rank_base) for n in w.nodes] == \
                [("host0", 2, 0), ("host1", 3, 2), ("host2", 4, 5)]
            assert not w.rejoined
        assert ms[0].current_generation() == 0
        kv.set(GENERATION_KEY, b"3")
        assert {m.current_generation() for m in ms} == {3}
    finally:
        for m in ms:
            m.stop()


def test_dynamic_closes_after_last_call_and_rejects_extra_agent() -> None:
    kv = LocalKV()
    ms = [Membership(kv, None, 2, 3, 2, f"h{i}", "job", last_call_timeout=0.6, **FAST)
          for i in range(2)]
    t0 = time.monotonic()
    worlds = _join_all(ms)
    took = time.monotonic() - t0
    try:
        assert all(isinstance(w, NodeWorld) for w in worlds), worlds
        assert 0.55 <= took < 3.0
        assert sorted(w.group_rank for w in worlds) == [0, 1]
        assert {w.world_size for w in worlds} == {4} and {w.group_world_size for w in worlds} == {2}
        # the world is closed and every member is alive: a late agent waits as a hot spare
        late = Membership(kv, None, 2, 3, 2, "late", "job", spare_timeout=0.5, **FAST)
        with pytest.raises(RendezvousError, match="no node of run job was lost within "
                                                  "spare_timeout=0.5s"):
            late.join(timeout=5)
        assert ms[0].spares() == []  # its record went with it
    finally:
        for m in ms:
            m.stop()


def test_dynamic_closes_at_max_without_waiting_for_last_call() -> None:
    kv = LocalKV()
    ms = [Membership(kv, None, 1, 3, 1, f"h{i}", "job", last_call_timeout=30, **FAST)
          for i in range(3)]
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
    lonely = Membership(kv, 0, 2, 2, 1, "h0", "job", **FAST)
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout, match="1 of 2 nodes joined within 0.4s"):
        lonely.join(timeout=0.4)
    assert time.monotonic() - t0 < 2.0
    other = Membership(kv, 1, 2, 2, 1, "h1", "another-job", **FAST)
    with pytest.raises(RendezvousError, match="belongs to run 'job'"):
        other.join(timeout=1)
    for kwargs, msg in [(dict(node_rank=0, nnodes_min=1, nnodes_max=2), "fixed node count"),
                        (dict(node_rank=5, nnodes_min=2), "must be in 0..1"),
                        (dict(nnodes_min=3), "MIN <= MAX"),
                        (dict(heartbeat_timeout=0.1), "must exceed"),
                        (dict(run_id="a/b"), "without '/'")]:
        args = dict(kv=kv, node_rank=None, nnodes_min=1, nnodes_max=2, local_world_size=1,
                    host="h", run_id="job", heartbeat_interval=0.2, heartbeat_timeout=1.0)
        args.update(kwargs)
        with pytest.raises(ValueError, match=msg):
            Membership(**args)


# -- liveness, in-process (heartbeats on a plain KV) ---------------------------------------------


def test_heartbeat_death_replacement_and_leave_local() -> None:
    kv = LocalKV()
    ms = [Membership(kv, r, 3, 3, 1, f"h{r}", "job", **FAST) for r in range(3)]
    assert all(isinstance(w, NodeWorld) for w in _join_all(ms))
    events: list[tuple[int, str, int, float]] = []
    for m in ms:
        m.watch_nodes(lambda g, me=m.node_rank: events.append((me, "dead", g, time.monotonic())),
                      lambda g, me=m.node_rank: events.append((me, "join", g, time.monotonic())))
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
        repl = Membership(kv, 0, 3, 3, 1, "h0-new", "job", **FAST)
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
    server_mod = pytest.importorskip("rendezvous.server")
    server = server_mod.StoreServer(host="127.0.0.1", port=0).start()
    try:
        _kill_and_replace("tcp", f"127.0.0.1:{server.port}", ttl=1.5 + 0.5)
    finally:
        server.stop()


@pytest.mark.etcd
def test_etcd_dynamic_rendezvous_threads(etcd_server: EtcdServer) -> None:
    from rendezvous.etcd import EtcdKV

    kvs = [EtcdKV(etcd_server.endpoint, "/ftrun/dyn") for _ in range(3)]
    ms = [Membership(kv, None, 2, 4, 1, f"h{i}", "dyn", last_call_timeout=0.5, join_timeout=10,
                     heartbeat_interval=0.3, heartbeat_timeout=1.5) for i, kv in enumerate(kvs)]
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
        first = [Membership(kvs[i], i, 2, 2, 1, f"h{i}", "reused", join_timeout=10, **FAST)
                 for i in range(2)]
        assert all(isinstance(w, NodeWorld) for w in _join_all(first))
        kvs[0].set(GENERATION_KEY, b"4")
        kvs[0].set("worker/stale", b"old")
        for m in first:
            m.stop(leave=leave)
        time.sleep(wait_gone)  # crashed agents: until their leases/heartbeats run out
        second = [Membership(kvs[2 + i], i, 2, 2, 1, f"n{i}", "reused", join_timeout=10, **FAST)
                  for i in range(2)]
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
    from rendezvous.etcd import EtcdKV

    # leases of 1 s (heartbeat_timeout 1.0) run out within ~1.5 s of the "crash"
    _fresh_after_dead_run(lambda: EtcdKV(etcd_server.endpoint, "/ftrun/reused"), leave=False,
                          wait_gone=2.0)


@pytest.mark.etcd
def test_duplicate_node_rank_on_etcd_is_refused(etcd_server: EtcdServer) -> None:
    from rendezvous.etcd import EtcdKV

    kvs = [EtcdKV(etcd_server.endpoint, "/ftrun/dup") for _ in range(2)]
    first = Membership(kvs[0], 0, 2, 2, 1, "first", "dup", **FAST)
    second = Membership(kvs[1], 0, 2, 2, 1, "second", "dup", **FAST)
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
