"""launcher.protocol.death_notice: real worker processes hold a slot; the agent's watcher hears
of their death."""

from __future__ import annotations

import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

import pytest

from launcher.protocol import death_notice as dn
from launcher.workers.workers import Reaper, Worker

pytestmark = pytest.mark.skipif(not dn.supported(), reason="no glibc robust mutexes here")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the worker: hold the slot (in a thread of its own with --thread), say its tid, then obey stdin
HOLDER = r"""
import os, sys, threading
sys.path.insert(0, {root!r})
from launcher.protocol import death_notice as dn
mode = sys.argv[1]
box = {{}}
def take():
    box["held"] = dn.hold(os.environ.get("FTRUN_DEATH_NOTICE"))
if mode == "thread":
    t = threading.Thread(target=take); t.start(); t.join()
else:
    take()
print(box["held"].tid if box["held"] else 0, flush=True)
cmd = sys.stdin.readline().split()
if cmd and cmd[0] == "exit":
    os._exit(int(cmd[1]))
if cmd and cmd[0] == "exec":
    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)"])
threading.Event().wait(60)
"""


class Job:
    """A holder process under a board; `deaths` gets every code the watcher reports."""

    def __init__(
        self,
        board: dn.NoticeBoard,
        mode: str = "main",
        slot: tuple[int, int] = (0, 0),
        on_death: Callable[["Job", int], None] | None = None,
    ):
        self.spec = board.arm(*slot)
        assert self.spec
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER.format(root=ROOT), mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, FTRUN_DEATH_NOTICE=self.spec),
        )
        self.tid = int(self.proc.stdout.readline())
        self.deaths: "queue.Queue[tuple[int, float]]" = queue.Queue()
        self.watched = self.tid != 0 and board.watch(
            self.spec,
            self.proc.pid,
            self.tid,
            (lambda code: on_death(self, code))
            if on_death
            else (lambda code: self.deaths.put((code, time.monotonic()))),
        )

    def tell(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def board():
    b = dn.NoticeBoard(nproc=2)
    assert b.enabled
    yield b
    b.stop()


def test_sigkill_is_reported_with_popen_s_code(board):
    job = Job(board)
    try:
        assert job.watched and job.tid > 0
        pidfd = os.pidfd_open(job.proc.pid)
        os.kill(job.proc.pid, signal.SIGKILL)
        code, at = job.deaths.get(timeout=5)
        assert code == -signal.SIGKILL
        # the pidfd turns readable too (the reaper still reaps it)
        assert select.select([pidfd], [], [], 5)[0]
        os.close(pidfd)
    finally:
        job.close()


def test_an_exit_with_a_nonzero_code_is_reported(board):
    job = Job(board)
    try:
        job.tell("exit 3")
        assert job.deaths.get(timeout=5)[0] == 3
        assert job.proc.wait(5) == 3
    finally:
        job.close()


@pytest.mark.parametrize("how", ["exit 0", "thread", "exec"])
def test_no_notice_when_the_process_does_not_die_of_a_fault(board, how):
    """A clean exit, the holding thread ending alone, or an exec release the mutex too (the
    kernel marks its owner dead): none of them is reported; the pidfd sees what follows."""
    job = Job(board, mode="thread" if how == "thread" else "main")
    try:
        assert job.watched
        if how != "thread":
            job.tell(how)
        if how == "exit 0":
            assert job.proc.wait(5) == 0
        time.sleep(1.0)
        assert job.deaths.empty()
        if how != "exit 0":
            assert job.proc.poll() is None  # alive: the holder thread ended / it exec'd
    finally:
        job.close()
    assert job.deaths.empty()


def test_slots_are_reused_by_a_rank_s_next_processes(board):
    for spawns in range(3):  # the same rank's successive processes take its two slots in turn
        job = Job(board, slot=(1, spawns))
        try:
            assert job.watched
            os.kill(job.proc.pid, signal.SIGKILL)
            assert job.deaths.get(timeout=5)[0] == -9
        finally:
            job.close()


def test_a_held_or_bogus_slot_is_not_taken(board):
    job = Job(board)
    try:
        t0 = time.monotonic()
        assert dn.hold(job.spec) is None  # another process holds it: give up after 0.2 s
        assert time.monotonic() - t0 < 2
    finally:
        job.close()
    assert dn.hold(None) is None and dn.hold("") is None
    assert dn.hold("/nonexistent:0") is None
    assert dn.hold(f"{board.path}:{10**6}") is None  # beyond the board
    assert dn.hold(f"{board.path}:3") is None  # not a slot boundary
    assert not board.watch("/elsewhere:0", os.getpid(), 1, lambda c: None)


def test_switched_off_when_asked():
    """`enabled=False`: FTRUN_DEATH_NOTICE=0 (read by launcher.config, see test_config)."""
    b = dn.NoticeBoard(nproc=1, enabled=False)
    try:
        assert not b.enabled and b.arm(0, 0) is None
    finally:
        b.stop()


def test_stop_ends_the_watchers_promptly():
    b = dn.NoticeBoard(nproc=1)
    job = Job(b)
    try:
        assert job.watched
        t0 = time.monotonic()
        b.stop()
        assert time.monotonic() - t0 < dn.POLL_S + 1.0
        assert not [t for t in threading.enumerate() if t.name.startswith("ftrun-notice")]
        assert b.arm(0, 0) is None  # stopped: nothing more is armed
    finally:
        job.close()
    assert job.deaths.empty()


def test_popen_code():
    assert dn.popen_code(9) == -9
    assert dn.popen_code(0x80 | 11) == -11  # core dumped
    assert dn.popen_code(3 << 8) == 3
    assert dn.popen_code(0) == 0


def test_the_reaper_reports_an_announced_exit_once(board):
    """Reaper.announce (the watcher's callback in the agent) reports the exit at once; when the
    pidfd turns readable the process is only reaped."""
    events: "queue.Queue[object]" = queue.Queue()
    reaper = Reaper(events)
    job = Job(board)
    try:
        w = Worker(local_rank=0, rank=5)
        w.attach(job.proc)
        reaper.watch(w)
        assert (
            board.watch(job.spec, job.proc.pid, job.tid, lambda code: None) is False
        )  # one watcher per slot
        reaper.announce(w, job.proc, -9)
        first = events.get(timeout=5)
        assert (first.rank, first.code, first.early) == (5, -9, True)
        assert w.exit_code == -9 and not w.alive
        os.kill(job.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while job.proc.returncode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert job.proc.returncode == -9  # reaped by the reaper
        time.sleep(0.3)
        assert events.empty()  # and not reported twice
        reaper.announce(w, job.proc, -9)
        assert events.empty()
    finally:
        reaper.stop()
        job.close()


def test_the_reaper_lets_an_awake_watcher_report_first(board, monkeypatch):
    """A death the notice saw is reported as one even when the pidfd's reaper wakes first (a
    CI run: exit(3) of a forked rank reported through its pidfd, `early_notice: False`): the
    reaper waits for the awake watcher (`NoticeBoard.settle`). Here the watcher is made slow
    to read the dying thread's status, as the GIL makes it on a loaded machine."""
    slow_read = dn.task_exit

    def late(pid: int, tid: int):
        time.sleep(0.1)
        return slow_read(pid, tid)

    monkeypatch.setattr(dn, "task_exit", late)
    events: "queue.Queue[object]" = queue.Queue()
    reaper = Reaper(events, board.settle)
    w = Worker(local_rank=0, rank=2)
    job = Job(board, on_death=lambda j, code: reaper.announce(w, j.proc, code))
    try:
        w.attach(job.proc)
        reaper.watch(w)
        job.tell("exit 3")
        first = events.get(timeout=5)
        assert (first.rank, first.code, first.early) == (2, 3, True)
        time.sleep(0.3)
        assert events.empty()  # the reaper only reaped it
        assert job.proc.returncode == 3
    finally:
        reaper.stop()
        job.close()


def test_settle_does_not_wait_for_a_watcher_of_a_live_or_unknown_process(board):
    job = Job(board)
    try:
        t0 = time.monotonic()
        board.settle(job.proc.pid)  # alive: the mutex still names its thread
        board.settle(123456789)  # never watched
        assert time.monotonic() - t0 < 0.1
    finally:
        job.close()
