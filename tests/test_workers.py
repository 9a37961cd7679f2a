"""Worker handles: event-driven exit detection, death with the agent, group stops."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

from launcher.workers import Reaper, Worker, WorkerExit, spawn, stop_workers
from tests.helpers_launch import pid_alive


def start(w: Worker, code: str) -> None:
    spawn(w, [sys.executable, "-c", code], dict(os.environ), None, None, False, False, "", threading.Lock())


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
    start(w, "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ok', flush=True); time.sleep(60)")
    time.sleep(0.5)
    t0 = time.monotonic()
    stop_workers([w], signal.SIGTERM, grace=0.5)
    assert w.proc is not None and w.proc.returncode == -signal.SIGKILL
    assert time.monotonic() - t0 < 5


def test_worker_dies_with_its_agent(tmp_path) -> None:
    pidfile = tmp_path / "pid"
    agent = subprocess.Popen([sys.executable, "-c", f"""
import os, sys, threading, time
sys.path.insert(0, {os.getcwd()!r})
from launcher.workers import Worker, spawn
w = Worker(0, 0)
spawn(w, [sys.executable, '-c', 'import time; time.sleep(60)'], dict(os.environ), None, None, False, False, '', threading.Lock())
open({str(pidfile)!r}, 'w').write(str(w.pid))
time.sleep(60)
"""])
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
