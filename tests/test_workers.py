"""Worker handles: event-driven exit detection, death with the agent, group stops."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

from launcher.workers.workers import Reaper, Worker, WorkerExit, spawn, stop_workers
from tests.helpers_launch import pid_alive


def start(w: Worker, code: str) -> None:
    spawn(
        w,
        [sys.executable, "-c", code],
        dict(os.environ),
        None,
        None,
        False,
        False,
        "",
        threading.Lock(),
    )


def test_exit_is_reported_at_once_with_code() -> None:
    q: queue.Queue = queue.Queue()
    r = Reaper(q)
    try:
        w = Worker(0, 5)
        start(w, "import time,os; time.sleep(0.3); os._exit(7)")
        r.watch(w)
        ev = q.get(timeout=10)
        assert isinstance(ev, WorkerExit) and ev.code == 7 and ev.rank == 5
        assert time.time() - ev.time < 0.05  # seen at once, not after a poll interval
        w2 = Worker(1, 6)
        start(w2, "import os,signal; os.kill(os.getpid(), signal.SIGKILL)")
        r.watch(w2)
        ev2 = q.get(timeout=10)
        assert ev2.code == -signal.SIGKILL and w2.exit_code == -9
    finally:
        r.stop()


def test_stop_workers_escalates_to_sigkill() -> None:
    w = Worker(0, 0)
    start(
        w,
        "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ok', flush=True); time.sleep(60)",
    )
    time.sleep(0.5)
    t0 = time.monotonic()
    stop_workers([w], signal.SIGTERM, grace=0.5)
    assert w.proc is not None and w.proc.returncode == -signal.SIGKILL
    assert time.monotonic() - t0 < 5


def test_worker_dies_with_its_agent(tmp_path) -> None:
    pidfile = tmp_path / "pid"
    agent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
import os, sys, threading, time
sys.path.insert(0, {os.getcwd()!r})
from launcher.workers.workers import Worker, spawn
w = Worker(0, 0)
spawn(
    w, [sys.executable, '-c', 'import time; time.sleep(60)'], dict(os.environ), None, None,
    False, False, '', threading.Lock(),
)
open({str(pidfile)!r}, 'w').write(str(w.pid))
time.sleep(60)
""",
        ]
    )
    deadline = time.monotonic() + 20
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pidfile.read_text())
    assert pid_alive(child)
    agent.kill()
    agent.wait()
    deadline = time.monotonic() + 1.0
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not pid_alive(child)


def _child_pid_of(kill_self: str, tmp_path) -> tuple[Worker, int, "queue.Queue"]:
    """Start a worker that leaves `sleep 60` behind in its own process group, then ends itself
    with `kill_self`; returns the worker, the sleeper's pid and the Reaper's queue."""
    pidfile = tmp_path / "child"
    q: queue.Queue = queue.Queue()
    w = Worker(0, 3)
    start(
        w,
        f"import os, signal, subprocess, sys\n"
        f"p = subprocess.Popen(['sleep', '60'])\n"
        f"open({str(pidfile)!r} + '.tmp', 'w').write(str(p.pid))\n"
        f"os.rename({str(pidfile)!r} + '.tmp', {str(pidfile)!r})\n{kill_self}\n",
    )
    deadline = time.monotonic() + 20
    while not pidfile.exists():
        assert time.monotonic() < deadline, "the worker never started its child"
        time.sleep(0.02)
    return w, int(pidfile.read_text()), q


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_what_a_dead_worker_left_in_its_group_is_killed_with_it(tmp_path) -> None:
    """A worker SIGKILLed (or exiting) leaves no orphan behind: its process group is swept the
    moment its exit is seen (torchrun kills the worker groups when it closes them)."""
    for kill_self in ("os.kill(os.getpid(), signal.SIGKILL)", "sys.exit(3)"):
        w, child, q = _child_pid_of(kill_self, tmp_path)
        r = Reaper(q)
        try:
            r.watch(w)
            ev = q.get(timeout=10)
            assert isinstance(ev, WorkerExit)
            assert _gone_within(child, 5), f"worker's child {child} outlived it ({kill_self})"
        finally:
            r.stop()
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
            (tmp_path / "child").unlink()


def test_a_signal_after_the_goodbye_ends_the_rank_as_done_an_exit_code_does_not() -> None:
    """`ended_after_goodbye`: a signal death after rt.finish()'s goodbye (a crash in torch's
    teardown) or a kill for hanging at exit counts as done; a non-zero exit code after the
    goodbye (the script's own error) and a signal without a goodbye do not."""
    from launcher.workers.workers import NodeWorkers

    ws = NodeWorkers.create(0, 4)
    a, b, c, d = ws.all()
    a.exit_code = 0
    b.said_bye, b.exit_code = True, -6  # SIGABRT in its teardown
    assert b.ended_after_goodbye and ws.all_succeeded() is False  # c and d still running
    c.said_bye, c.hung_at_exit, c.exit_code = True, True, -9
    d.exit_code = -6  # no goodbye: a fault
    assert c.ended_after_goodbye and not d.ended_after_goodbye and not ws.all_succeeded()
    d.said_bye, d.exit_code = True, 1  # the script's own error after its goodbye
    assert not d.ended_after_goodbye and not ws.all_succeeded()
    d.exit_code = -11
    assert d.ended_after_goodbye and ws.all_succeeded()
