"""launcher/observe/observer.py: the agent's event sink. Heartbeat observations become steps per
second, `progress` records and `rank-resumed` (the first commit after a round); plus AgentLog's
sinks."""

from __future__ import annotations

import json

from launcher.observe.logs import AgentLog, read_event_file
from launcher.observe.observer import NodeObserver


def setup(tmp_path):
    path = tmp_path / "events.jsonl"
    log = AgentLog(0, str(path), quiet=True)
    obs = NodeObserver(log, str(tmp_path), max_restarts=3, port=None, progress_interval=1.0)
    log.add_sink(obs.on_event)
    return log, obs, path


def beat(log, t, rank, step, phase, committed, waiting=False):
    log.observe(
        "heartbeat",
        op="heartbeat",
        rank=rank,
        step=step,
        phase=phase,
        committed_step=committed,
        waiting=waiting,
        time=t,
    )


def names(path):
    return [e["event"] for e in read_event_file(str(path))]


def test_sinks_see_events_records_and_observations_but_only_events_are_written(tmp_path):
    log = AgentLog(0, str(tmp_path / "events.jsonl"), quiet=True)
    seen = []
    log.add_sink(lambda rec: seen.append(rec["event"]))
    log.info("spawn", "x", rank=0)
    log.record("progress", "p", ranks={})
    log.observe("heartbeat", rank=0)
    log.add_sink(lambda rec: 1 / 0)  # a broken sink never breaks logging
    log.info("exit", "y")
    log.close()
    assert seen == ["spawn", "progress", "heartbeat", "exit"]
    assert names(tmp_path / "events.jsonl") == ["spawn", "progress", "exit"]


def test_replacement_resumes_at_its_first_commit_not_at_its_restored_state(tmp_path):
    log, obs, path = setup(tmp_path)
    log.info("spawn", "s", rank=1, local_rank=1, pid=7, generation=2, replacement=True)
    beat(log, 10.0, 1, -1, "init", -1)
    beat(log, 10.5, 1, -1, "recovering", -1)
    beat(log, 11.0, 1, 4, "resumed", 4)  # restored: committed jumps, but no step was done
    log.info("rank-recovered", "r", rank=1, generation=2, resume_step=5)
    beat(log, 11.1, 1, 5, "forward", 4)
    assert "rank-resumed" not in names(path)
    beat(log, 11.3, 1, 5, "committed", 5)
    (resumed,) = [e for e in read_event_file(str(path)) if e["event"] == "rank-resumed"]
    assert resumed["rank"] == 1 and resumed["generation"] == 2 and resumed["step"] == 5
    beat(log, 11.5, 1, 6, "committed", 6)
    assert names(path).count("rank-resumed") == 1


def test_restarted_rank_resumes_after_a_step_of_its_own(tmp_path):
    log, obs, path = setup(tmp_path)
    log.info("spawn", "s", rank=0, local_rank=0, pid=7, generation=1, replacement=False)
    beat(log, 10.0, 0, -1, "init", -1)
    beat(log, 12.0, 0, 2, "step", 1)  # loaded the checkpoint of iteration 2: no step done yet
    assert "rank-resumed" not in names(path)
    beat(log, 12.4, 0, 2, "committed", 2)
    assert [e["step"] for e in read_event_file(str(path)) if e["event"] == "rank-resumed"] == [2]


def test_steps_per_second_and_progress_records(tmp_path):
    log, obs, path = setup(tmp_path)
    log.info("spawn", "s", rank=0, local_rank=0, pid=7, generation=0, replacement=False)
    for i in range(5):
        beat(log, 100.0 + i * 0.5, 0, i + 1, "committed", i)
    obs._record_progress(force=False)
    obs._record_progress(force=False)  # nothing changed: nothing written
    (p,) = [e for e in read_event_file(str(path)) if e["event"] == "progress"]
    assert p["ranks"]["0"]["committed_step"] == 4 and p["ranks"]["0"]["steps_per_s"] == 2.0
    obs._node = 0
    snap = obs.snapshot()
    assert json.loads(json.dumps(snap))["ranks"][0]["steps_per_s"] == 2.0
    assert snap["ranks"][0]["state"] == "training" and "job" not in snap


def test_attaching_again_in_a_new_world_keeps_one_publisher(tmp_path):
    """Bug: an agent entering a new world (a new rendezvous round, a rejoin after self-fencing)
    attached the observer again and started a second publishing thread each time."""
    import threading

    from rendezvous.store.memory import LocalKV

    log, obs, _ = setup(tmp_path)
    kv = LocalKV()
    try:
        obs.attach(kv, 2, False)
        first = obs._thread
        obs.attach(kv, 1, True)  # the new world: node 2 became node 1
        assert obs._thread is first and (obs._node, obs._leader) == (1, True)
        assert sum(t.name == "ftrun-observer" for t in threading.enumerate()) == 1
    finally:
        obs.stop()
        log.close()


def beat_in(log, t, rank, phase, generation):
    log.observe(
        "heartbeat",
        op="heartbeat",
        rank=rank,
        step=7,
        phase=phase,
        committed_step=6,
        time=t,
        generation=generation,
    )


def test_a_rank_entering_a_round_is_recorded_once_at_its_heartbeats_time(tmp_path):
    """A survivor's stop and a replacement's start-up are recorded as `rank-stopped` from the
    rank's heartbeat, whether or not the round ever ends with its `rank-recovered`."""
    log, obs, path = setup(tmp_path)
    log.info("spawn", "s", rank=0, local_rank=0, pid=7, generation=0, replacement=False)
    beat_in(log, 50.0, 0, "forward", 0)
    beat_in(log, 51.25, 0, "recovering", 1)
    beat_in(log, 51.5, 0, "recovering", 1)  # the same round: not again
    beat_in(log, 53.0, 0, "recovering", 2)  # the round was superseded: the next one
    log.info("spawn", "s", rank=1, local_rank=1, pid=8, generation=2, replacement=True)
    beat_in(log, 54.0, 1, "init", 2)
    beat_in(log, 54.5, 1, "recovering", 2)
    got = [
        (e["rank"], e["generation"], e["at"], e["message"])
        for e in read_event_file(str(path))
        if e["event"] == "rank-stopped"
    ]
    assert got == [
        (0, 1, 51.25, "rank 0 stopped training of generation 1 and posted its status"),
        (0, 2, 53.0, "rank 0 stopped training of generation 2 and posted its status"),
        (1, 2, 54.5, "rank 1 joined the round of generation 2 and posted its status"),
    ]


def test_the_restart_budget_is_read_around_plans_not_every_second() -> None:
    """bench_scale: every agent's observer read the controller's restart budget every second
    (one or two store requests per node per second) though it changes only with a round."""
    from launcher.observe import observer as O
    from launcher.protocol import plan as P
    from rendezvous.store.memory import LocalKV

    class Counting(LocalKV):
        reads = 0

        def present(self, keys):  # type: ignore[no-untyped-def]
            if P.RESTARTS_USED_KEY in keys:
                Counting.reads += 1
            return super().present(keys)

    kv = Counting()
    kv.set(P.RESTARTS_USED_KEY, b"2")
    obs = O.NodeObserver(AgentLog(0, None, quiet=True), "/tmp", 5, None, 5.0)
    obs._kv, obs._node = kv, 0
    obs._tick()
    assert Counting.reads == 1 and obs.snapshot()["restarts_used"] == 2
    for _ in range(5):
        obs._tick()
    assert Counting.reads == 1  # nothing happened: not read again (for RESTARTS_REFRESH s)
    kv.set(P.RESTARTS_USED_KEY, b"3")
    obs.on_event({"event": "plan-received", "generation": 1, "rank": None})
    obs._tick()
    assert Counting.reads == 2 and obs.snapshot()["restarts_used"] == 3
    obs._restarts_until = 0.0  # the plan's window over
    obs._restarts_read_at -= O.RESTARTS_REFRESH  # and the refresh due
    obs._tick()
    assert Counting.reads == 3
