"""launcher/agent/hot_switch.py (`IncomingRanks`), with real processes (`sleep`) standing in for
ranks and a real worker channel: the controller's order starts one new process per local moved
rank beside the running one (the channel kept on the running one); the switch plan stops the
drained process and puts the new one in its place; another plan first, the controller's
abandonment or the new process's end stop the new processes, delete their statuses and leave
the ranks' processes as they were. The live job is tests/test_migrate.py's."""

from __future__ import annotations

import queue
import subprocess

import pytest

from launcher.agent.hot_switch import IncomingRanks
from launcher.observe.logs import AgentLog, read_event_file
from launcher.protocol import plan as P
from launcher.workers.channel import ChannelServer
from launcher.workers.workers import NodeWorkers, Worker, stop_workers
from rendezvous.store.memory import LocalKV


class SleepSpawner:
    """Starts `sleep 60` for a rank, as `Spawner.spawn` starts its process."""

    def __init__(self) -> None:
        self.started: list[Worker] = []

    def spawn(self, w: Worker, generation: int, replacement: bool) -> None:
        w.generation = generation
        w.attach(subprocess.Popen(["sleep", "60"]))  # no reaper here: `running` reads the process
        self.started.append(w)


def running(w: Worker) -> bool:
    return w.proc is not None and w.proc.poll() is None


@pytest.fixture
def node(tmp_path):
    kv, log = LocalKV(), AgentLog(0, str(tmp_path / "events.jsonl"), quiet=True)
    channel = ChannelServer(str(tmp_path / "c.sock"), queue.Queue())
    workers = NodeWorkers.create(0, 2)
    spawner = SleepSpawner()
    for w in workers.all():
        spawner.spawn(w, 0, replacement=False)
    incoming = IncomingRanks(log, kv, workers, spawner, channel, node=0)  # type: ignore[arg-type]
    yield kv, workers, spawner, incoming
    stop_workers(spawner.started, 9, 0.0)
    channel.stop()


def order(kv, seq: int = 1, generation: int = 1, ranks=(1, 5)) -> None:
    kv.set(P.SWITCH_KEY, P.SwitchOrder(seq=seq, generation=generation, ranks=list(ranks)).to_json())


def test_the_switch_plan_puts_the_new_process_in_the_ranks_place(node, tmp_path) -> None:
    kv, workers, spawner, incoming = node
    old = workers.by_rank(1)
    order(kv)
    incoming.on_order()
    new = incoming.incoming[1]
    assert list(incoming.incoming) == [1]  # rank 5 is another node's
    assert running(new) and new.pid != old.pid and new.generation == 1 and incoming.holds(new.pid)
    incoming.on_order()  # the same order again: nothing more
    assert len(spawner.started) == 3
    plan = P.Plan(generation=1, strategy=P.SWITCH, restart_ranks=[1, 5])
    incoming.take_over(plan)
    assert workers.by_rank(1) is new and not running(old) and old.stopping
    assert running(workers.by_rank(0)) and not incoming.holds(new.pid)
    [moved] = [
        e for e in read_event_file(str(tmp_path / "events.jsonl")) if e["event"] == "switch-moved"
    ]
    assert (moved["rank"], moved["pid"], moved["old_pid"]) == (1, new.pid, old.pid)


def test_another_plan_first_stops_the_new_process_and_deletes_its_status(node) -> None:
    kv, workers, _, incoming = node
    old = workers.by_rank(1)
    order(kv)
    incoming.on_order()
    new = incoming.incoming[1]
    kv.set(P.status_key(1, 1), b"{}")  # it posted its status
    incoming.take_over(P.Plan(generation=1, strategy=P.RECOVER_IN_PLACE, failed_ranks=[0]))
    assert not running(new) and incoming.incoming == {}
    assert kv.try_get(P.status_key(1, 1)) is None  # the round counts the running process only
    assert workers.by_rank(1) is old and running(old)


def test_a_new_process_that_ends_abandons_the_switch(node) -> None:
    kv, workers, _, incoming = node
    order(kv)
    incoming.on_order()
    new = incoming.incoming[1]
    assert incoming.on_exit(12345, 0) is False  # not one of them
    stop_workers([new], 9, 0.0)
    assert incoming.on_exit(new.pid, -9) is True
    ended = kv.try_get(P.switch_ended_key(1))
    assert ended is not None and b"ended with code -9 before the switch" in ended
    assert incoming.incoming == {} and running(workers.by_rank(1))


def test_the_controllers_abandonment_stops_the_new_processes(node) -> None:
    kv, workers, _, incoming = node
    order(kv)
    incoming.on_order()
    new = incoming.incoming[1]
    kv.set(P.switch_ended_key(1), b"ranks [3] did not halt within 5s")
    incoming.on_order()
    assert not running(new) and incoming.incoming == {} and running(workers.by_rank(1))
