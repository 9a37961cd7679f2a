"""The agent's hang guard for unmodified workers (real sleeping processes, a recorded silence):
a stopped rank is blamed even while others progress; with every rank silent the first to go
silent is blamed, weakly; a node where one rank still progresses is not hung; one hang per
generation; the progress records reach the store."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from launcher.agent.hang_guard import HangGuard
from launcher.config import LaunchConfig
from launcher.control.progress import read_progress
from launcher.hang.hang_watch import HangPolicy
from launcher.observe.logs import AgentLog, RunLogDir, read_events
from launcher.workers.workers import NodeWorkers
from rendezvous.store.memory import LocalKV


@pytest.fixture()
def guard(tmp_path):
    cfg = LaunchConfig(script="x.py", script_args=[], hang=HangPolicy(5.0))
    run_dir = RunLogDir.create(str(tmp_path), "job")
    log = AgentLog(0, run_dir.events_path, quiet=True)
    workers = NodeWorkers.create(0, 3)
    for w in workers.all():
        w.attach(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    g = HangGuard(cfg, log, run_dir, "h", lambda: workers)
    g.attach(LocalKV(), 0, 1)
    g.silence._last_sample = time.time() + 3600  # the test records the silence itself
    yield g, workers, run_dir
    for w in workers.all():
        w.proc.kill()
        w.proc.wait()
    log.close()


def silent(g: HangGuard, workers: NodeWorkers, ago: dict[int, float]) -> None:
    now = time.time()
    for w in workers.all():
        g.silence.note(w.rank, w.pid, (0, 0), now - ago.get(w.rank, 0.0))


def test_a_stopped_rank_is_blamed_even_while_others_progress(guard) -> None:
    g, workers, run_dir = guard
    w1 = workers.by_rank(1)
    w1.proc.send_signal(signal.SIGSTOP)
    time.sleep(0.1)
    silent(g, workers, {1: 8.0})
    g.check(generation=0, node=0)
    assert w1.proc.wait(10) < 0 and workers.by_rank(0).proc.poll() is None
    hang = g.take_killed(1)
    assert hang is not None and hang.state == "T" and not hang.weak and "SIGSTOP" in hang.basis
    ev = [
        e for e in read_events(str(run_dir.path + "/..")) if e["event"] in ("hang", "hang-stacks")
    ]
    assert [e["event"] for e in ev] == ["hang", "hang-stacks"] and ev[1]["how"] in (
        "faulthandler (SIGABRT)",
        "py-spy",
    )


def test_all_silent_blames_the_first_to_go_silent_weakly_and_once(guard) -> None:
    g, workers, _ = guard
    silent(g, workers, {0: 6.0, 1: 9.0, 2: 7.0})
    g.check(generation=0, node=0)
    hang = g.take_killed(1)
    assert hang is not None and hang.weak and "first of the silent ranks" in hang.basis
    assert workers.by_rank(1).proc.wait(10) < 0
    g.check(generation=0, node=0)  # the others are silent too, but one hang per generation
    assert g.take_killed(0) is None and g.take_killed(2) is None


def test_a_node_where_a_rank_progresses_is_not_hung_and_records_are_published(guard) -> None:
    g, workers, _ = guard
    silent(g, workers, {0: 9.0, 1: 9.0, 2: 1.0})
    g.check(generation=0, node=0)
    assert all(g.take_killed(r) is None for r in range(3))
    recs = {r.rank: r for r in read_progress(g._kv, 1)}
    assert sorted(recs) == [0, 1, 2] and not recs[0].aware and recs[0].idle_s >= 9.0
    assert recs[2].state in ("R", "S") and recs[2].pid == workers.by_rank(2).pid


def test_a_rank_silent_past_the_limit_after_its_goodbye_is_killed_as_hung_at_exit(guard) -> None:
    """Runtime-aware ranks that said goodbye (rt.finish()) are watched for silence too: one that
    stays silent past the limit hangs at exit (dumped, killed, counted as finished); one still
    busy after its goodbye (writing its results, say) is left alone."""
    g, workers, run_dir = guard
    workers.aware.update({0, 1, 2})
    for r in (0, 1):
        workers.by_rank(r).said_bye = True
    silent(g, workers, {0: 9.0, 1: 1.0, 2: 9.0})  # rank 2 has not said goodbye: its heartbeats rule
    g.check(generation=0, node=0)
    w0 = workers.by_rank(0)
    assert w0.proc.wait(10) < 0 and w0.hung_at_exit
    assert workers.by_rank(1).proc.poll() is None and not workers.by_rank(1).hung_at_exit
    assert workers.by_rank(2).proc.poll() is None
    assert g.take_killed(0) is None  # not a training hang: no fault for the controller
    g.check(generation=0, node=0)  # killed once: its exit is pending, no second dump
    assert sum(e["event"] == "exit-hang" for e in read_events(str(run_dir.path + "/.."))) == 1
    ev = [
        e
        for e in read_events(str(run_dir.path + "/.."))
        if e["event"] in ("exit-hang", "hang-stacks")
    ]
    assert [(e["event"], e["rank"]) for e in ev] == [("exit-hang", 0), ("hang-stacks", 0)]
    assert (
        "said goodbye (rt.finish()) but has not exited" in ev[0]["message"]
        and ev[0]["idle_s"] >= 9.0
    )
    w0.exit_code = w0.proc.returncode
    for w in (workers.by_rank(1), workers.by_rank(2)):
        w.proc.kill()
        w.exit_code = 0  # as if both had exited 0
    assert workers.all_succeeded()  # the rank killed at exit counts as finished
