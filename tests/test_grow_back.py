"""launcher.agent.grow_back: the dropped ranks' returning processes on one node, through the
plan executor: real worker processes (sleepers), an in-process store."""

from __future__ import annotations

import queue
import signal
import time

import pytest

from launcher.agent.errors import JobFailures
from launcher.agent.plan_executor import PlanExecutor
from launcher.agent.store_stack import AgentWorld
from launcher.cli.ftrun import parse
from launcher.config import build_config
from launcher.observe.logs import AgentLog, RunLogDir
from launcher.protocol import plan as P
from launcher.workers.channel import ChannelServer
from launcher.workers.spawner import Spawner, WorkerWorld
from launcher.workers.workers import NodeWorkers, Reaper, stop_workers
from rendezvous.store.memory import LocalKV


def _node(tmp_path, env: dict[str, str], spawn: bool = True):
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(120)\n")
    argv = ["--nproc_per_node", "2", "--warm_spares", "0", "--log_dir", str(tmp_path / "logs")]
    cfg = build_config(parse(argv + [str(script)]), env=env)
    log = AgentLog(0, None, quiet=True)
    events: queue.Queue = queue.Queue()
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
    kv = LocalKV()
    ex = PlanExecutor(cfg, log, kv, world, workers, spawner, channel, JobFailures())
    if spawn:  # else: a lost node's new agent, its ranks not started yet
        spawner.spawn_all(workers.all(), 0)
    return ex, kv, (workers, reaper, channel)


@pytest.fixture()
def node(tmp_path):
    ex, kv, parts = _node(tmp_path, {})
    yield ex, kv
    workers, reaper, channel = parts
    stop_workers(workers.all(), signal.SIGKILL, 0.0)
    reaper.stop()
    channel.stop()


def _shrink(ex, g: int = 1) -> int:
    """Rank 1 dies and the world shrinks without it; the pid it had."""
    w1 = ex.workers.by_rank(1)
    old = w1.pid
    stop_workers([w1], signal.SIGKILL, 0.0)
    w1.exit_code = -9
    plan = P.Plan(generation=g, strategy=P.ELASTIC, failed_ranks=[1])
    assert ex.execute(plan) is None
    return old


def test_a_dropped_rank_gets_a_returning_process_for_the_next_generation(node) -> None:
    ex, kv = node
    w0, w1 = ex.workers.all()
    survivor = w0.pid
    old = _shrink(ex)
    assert ex.workers.left == {1} and ex.returning.waiting == {1: 2}
    assert w1.alive and w1.pid != old and w1.generation == 2
    assert w0.pid == survivor  # nobody else restarts
    # a newer round before the grow: the returning process restarts for its next generation
    first = w1.pid
    assert ex.execute(P.Plan(generation=2, strategy=P.RETRY, failed_ranks=[0])) is None
    assert ex.returning.waiting == {1: 3} and w1.alive and w1.pid != first and w1.generation == 3
    assert w0.pid == survivor


def test_the_grow_takes_the_rank_back_when_it_says_it_recovered(node) -> None:
    ex, kv = node
    w0, w1 = ex.workers.all()
    _shrink(ex)
    back = w1.pid
    grow = P.Plan(generation=2, strategy=P.GROW, restart_ranks=[1])
    assert ex.execute(grow) is None
    assert w1.pid == back and w1.alive  # not respawned: the returning process joins the round
    assert ex.returning.waiting == {} and ex.returning.growing == {1}
    assert ex.workers.left == {1}  # until it resumed in the grown world
    ex.returning.recovered(1)
    assert ex.workers.left == set() and ex.returning.growing == set()


def test_a_returning_process_that_ends_before_the_grow_is_no_fault(node) -> None:
    ex, kv = node
    w1 = ex.workers.by_rank(1)
    _shrink(ex)
    kv.set(P.status_key(2, 1), b"{}")  # it had posted its status for the grow round
    pid = w1.pid
    w1.proc.kill()
    w1.proc.wait(5.0)
    assert ex.returning.on_exit(w1, pid, -9)
    assert ex.returning.waiting == {} and ex.workers.left == {1}  # the world stays shrunk
    deadline = time.monotonic() + 5.0
    while kv.try_get(P.status_key(2, 1)) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kv.try_get(P.status_key(2, 1)) is None  # the controller does not grow with it
    w0 = ex.workers.by_rank(0)
    assert not ex.returning.on_exit(w0, w0.pid, 1)  # a survivor's exit is a fault as ever


def test_a_returning_process_gone_just_before_the_grow_is_replaced_in_its_round(node) -> None:
    ex, kv = node
    w1 = ex.workers.by_rank(1)
    _shrink(ex)
    gone = w1.pid
    w1.proc.kill()
    w1.proc.wait(5.0)
    deadline = time.monotonic() + 5.0
    while w1.alive and time.monotonic() < deadline:  # the reaper saw the exit
        time.sleep(0.01)
    assert ex.returning.on_exit(w1, gone, -9)  # the controller had already seen it ready
    ex.execute(P.Plan(generation=2, strategy=P.GROW, restart_ranks=[1]))
    assert w1.alive and w1.pid != gone and w1.generation == 2  # joins the grow round itself
    assert ex.returning.growing == {1} and ex.returning.waiting == {}


def test_a_returning_rank_left_out_of_the_grow_round_ends_quietly(node) -> None:
    ex, kv = node
    w1 = ex.workers.by_rank(1)
    _shrink(ex)
    ex.execute(P.Plan(generation=2, strategy=P.GROW, restart_ranks=[1]))
    assert ex.returning.on_exit(w1, w1.pid, P.EXIT_FALLBACK)
    assert ex.workers.left == {1} and ex.returning.growing == set()


def test_restart_all_ends_the_wait(node) -> None:
    ex, kv = node
    _shrink(ex)
    ex.returning.after(P.Plan(generation=2, strategy=P.RESTART_ALL))
    assert ex.returning.waiting == {} and ex.returning.growing == set()


def test_elastic_grow_off_starts_no_returning_process(tmp_path) -> None:
    ex, kv, (workers, reaper, channel) = _node(tmp_path, {"FTRUN_ELASTIC_GROW": "0"})
    try:
        w1 = ex.workers.by_rank(1)
        _shrink(ex)
        assert not w1.alive and ex.returning.waiting == {} and ex.workers.left == {1}
    finally:
        stop_workers(workers.all(), signal.SIGKILL, 0.0)
        reaper.stop()
        channel.stop()


def test_a_lost_nodes_new_agent_starts_returning_processes_for_its_dropped_ranks(tmp_path):
    """launcher.agent.node_return: a live shrink dropped every rank of this node; its new
    agent starts a returning process for each, for the next generation, and the grow plan
    takes them back as on the node where they were dropped."""
    ex, kv, parts = _node(tmp_path, {}, spawn=False)
    try:
        ex.returning.rejoin([0, 1], 4)
        w0, w1 = ex.workers.all()
        assert ex.workers.left == {0, 1} and ex.returning.waiting == {0: 4, 1: 4}
        assert w0.alive and w1.alive and (w0.generation, w1.generation) == (4, 4)
        pids = (w0.pid, w1.pid)
        assert ex.execute(P.Plan(generation=4, strategy=P.GROW, restart_ranks=[0, 1])) is None
        assert (w0.pid, w1.pid) == pids and ex.returning.growing == {0, 1}
    finally:
        workers, reaper, channel = parts
        stop_workers(workers.all(), signal.SIGKILL, 0.0)
        reaper.stop()
        channel.stop()


def test_with_the_grow_off_a_new_agent_starts_nothing(tmp_path):
    ex, kv, parts = _node(tmp_path, {"FTRUN_ELASTIC_GROW": "0"}, spawn=False)
    try:
        ex.returning.rejoin([0, 1], 4)
        assert ex.workers.left == {0, 1} and ex.returning.waiting == {}
        assert not any(w.alive for w in ex.workers.all())
    finally:
        workers, reaper, channel = parts
        reaper.stop()
        channel.stop()
