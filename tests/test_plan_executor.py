"""Plans carried out on one node: real worker processes, a real worker channel, an in-process
store."""

from __future__ import annotations

import json
import queue
import signal
import socket
import threading
import time

import pytest

from launcher.agent.agent_events import PlanEvent
from launcher.agent.errors import JobFailures
from launcher.agent.plan_executor import PlanExecutor
from launcher.agent.store_stack import AgentWorld
from launcher.cli.ftrun import parse
from launcher.config import build_config
from launcher.observe.logs import AgentLog, RunLogDir
from launcher.protocol import plan as P
from launcher.protocol.messages import Hello, encode
from launcher.workers.channel import ChannelMessage, ChannelServer
from launcher.workers.spawner import Spawner, WorkerWorld
from launcher.workers.workers import NodeWorkers, Reaper, stop_workers
from rendezvous.store.memory import LocalKV


@pytest.fixture()
def node(tmp_path, monkeypatch):
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(120)\n")
    cfg = build_config(
        parse(
            [
                "--nproc_per_node",
                "2",
                "--warm_spares",
                "0",
                "--log_dir",
                str(tmp_path / "logs"),
                str(script),
            ]
        ),
        env={},
    )
    log = AgentLog(0, None, quiet=True)
    events: queue.Queue = queue.Queue()
    kv = LocalKV()
    channel = ChannelServer(str(tmp_path / "a.sock"), events)
    reaper = Reaper(events)
    workers = NodeWorkers.create(0, 2)
    world = AgentWorld(group_rank=0, group_world_size=2, rank_base=0, world_size=4, is_leader=True)
    spawner = Spawner(
        cfg,
        WorkerWorld(0, 2, 4, "127.0.0.1", 1, channel.path),
        RunLogDir.create(str(tmp_path / "logs"), "t"),
        log,
        "host",
        reaper,
        on_spawn=lambda w: None,
    )
    ex = PlanExecutor(cfg, log, kv, world, workers, spawner, channel, JobFailures())
    spawner.spawn_all(workers.all(), 0)
    yield ex, kv, events
    stop_workers(workers.all(), signal.SIGKILL, 0.0)
    reaper.stop()
    channel.stop()


def test_recover_respawns_the_restarted_rank_and_defers_the_stop_of_an_unconnected_one(
    node,
) -> None:
    ex, kv, events = node
    w0, w1 = ex.workers.all()
    old_pid = w1.pid
    ex.workers.aware.add(1)
    plan = P.Plan(generation=1, strategy=P.RECOVER_IN_PLACE, failed_ranks=[1], restart_ranks=[1])
    assert ex.execute(plan) is None
    assert w1.pid != old_pid and w1.alive and w1.generation == 1 and 1 not in ex.workers.aware
    assert w0.alive and w0.generation == 0  # the survivor keeps its process
    c = socket.socket(socket.AF_UNIX)
    c.connect(ex.channel.path)
    try:
        c.sendall(encode(Hello(rank=0, generation=0)))
        ev = events.get(timeout=5)
        while not isinstance(ev, ChannelMessage):
            ev = events.get(timeout=5)
        ex.on_hello(0, 0)
        c.settimeout(5)
        stop = json.loads(c.recv(4096))
        assert stop == {
            "op": "stop",
            "generation": 1,
            "strategy": P.RECOVER_IN_PLACE,
            "failed_ranks": [1],
        }
        ex.on_hello(0, 0)  # delivered once
    finally:
        c.close()


def test_a_recovery_round_posts_the_nodes_statuses_as_one_record(node) -> None:
    ex, kv, _ = node
    plan = P.Plan(generation=1, strategy=P.RECOVER_IN_PLACE, failed_ranks=[1], restart_ranks=[1])
    assert ex.execute(plan) is None
    for r in (0, 1):  # what the ranks themselves write
        kv.set(P.status_key(1, r), P.RankStatus(r, 1, r == 1, 4, 5, shard="dp").to_json())
    rec = P.NodeStatuses.from_json(kv.get(P.node_statuses_key(1, 0), 5.0))
    assert rec.node == 0 and sorted(rec.ranks()) == [0, 1]
    ex.stop.set()  # the agent's halt ends the relay's thread
    ex.relay.stop(join=2.0)
    assert not ex.relay.running


def test_restart_all_waits_for_the_controllers_go_and_respawns_every_rank(node) -> None:
    ex, kv, events = node
    old = [w.pid for w in ex.workers.all()]
    ex.workers.aware.update({0, 1})
    kv.add(P.stopped_key(1), 1)  # the other node already stopped its workers

    def controller() -> None:
        assert kv.wait([P.all_stopped_key(1)], 10.0)
        kv.set(P.go_key(1), b"1")

    t = threading.Thread(target=controller)
    t.start()
    assert (
        ex.execute(P.Plan(generation=1, strategy=P.RESTART_ALL, restart_ranks=[0, 1, 2, 3])) is None
    )
    t.join(10)
    new = [w.pid for w in ex.workers.all()]
    assert all(w.alive and w.generation == 1 for w in ex.workers.all()) and not set(old) & set(new)
    assert not ex.workers.aware
    assert sorted(p for _, p in ex.failures.terminated) == sorted(old)  # bystanders, not failures
    assert kv.try_get(P.stopped_key(1)) == b"2"


def test_finish_waits_for_every_node_and_a_new_round_interrupts_it(node) -> None:
    ex, kv, events = node
    kv.add(P.done_key(0), 1)  # the other node finished first
    assert ex.finish(0, events) == 0
    assert kv.try_get(P.EXITED_KEY) == b"1"
    plan_ev = PlanEvent(P.Plan(generation=2, strategy=P.RECOVER_IN_PLACE))
    events.put(plan_ev)
    assert ex.finish(1, events) is plan_ev  # node 1 failed after we finished: join its round
    assert kv.try_get(P.done_key(1)) == b"1" and kv.try_get(P.EXITED_KEY) == b"1"


def test_exit_stops_everyone_and_records_them_as_terminated(node) -> None:
    ex, kv, events = node
    assert ex.execute(P.Plan(generation=1, strategy=P.EXIT, reason="budget spent")) == 1
    # the processes are gone when execute returns; the Reaper thread records their exit codes
    assert all(w.proc.poll() is not None for w in ex.workers.all())
    deadline = time.monotonic() + 5
    while ex.workers.alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not ex.workers.alive()
    assert sorted(r for r, _ in ex.failures.terminated) == [0, 1]


def test_a_restart_barrier_ends_at_once_when_the_node_loses_its_membership(node, tmp_path) -> None:
    """restart-all on the agent's loop, the store behind a cut link (its calls hang until
    read_timeout): the barrier's count is written off the loop, and the wait for the go ends
    within a slice of this node losing its membership, so the loop can self-fence."""
    from helpers_relay import Relay

    from launcher.agent.loop_store import LoopStore
    from rendezvous.store.client import StoreClient
    from rendezvous.store.server import StoreServer

    ex, _, _ = node
    lost = threading.Event()
    with StoreServer(host="127.0.0.1") as server, Relay("127.0.0.1", server.port) as relay:
        kv = StoreClient("127.0.0.1", relay.port, timeout=10.0)
        store = LoopStore(kv, ex.log)
        try:
            kv.try_get("warm")
            ex.kv, ex._store, ex._lost = kv, store, lost.is_set
            relay.cut()
            time.sleep(0.3)
            threading.Timer(1.0, lost.set).start()
            t0 = time.monotonic()
            plan = P.Plan(generation=1, strategy=P.RESTART_ALL, failed_ranks=[1])
            assert ex.execute(plan) is None
            took = time.monotonic() - t0
            assert took < 1.0 + 0.6, took  # not read_timeout (10 s)
            assert all(not w.alive for w in ex.workers.all())  # stopped, not respawned
            relay.heal()
            assert server.kv.wait([P.stopped_key(1)], 10.0)  # the count lands after all
        finally:
            store.stop()
            kv.close()


def test_a_live_shrink_stops_a_healthy_rank_of_the_lost_replica(node) -> None:
    """elastic-training: the failed ranks are whole data-parallel replicas (a lost rank's healthy
    TP/PP peers too, launcher.control.shrink_replicas): a peer still running is stopped (no
    fault: recorded as terminated) and leaves the world; the other rank keeps its process."""
    ex, kv, events = node
    w0, w1 = ex.workers.all()
    peer = w1.proc
    assert ex.execute(P.Plan(generation=1, strategy=P.ELASTIC, failed_ranks=[1])) is None
    assert peer.poll() == -signal.SIGKILL and 1 in ex.workers.left
    assert [r for r, _ in ex.failures.terminated] == [1]
    assert w0.alive and w0.generation == 0 and 0 not in ex.workers.left
