"""priority: the threads of a process and the way back to the agent's priority."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from launcher.workers.priority import (
    born_warm,
    may_return_to,
    run_priority,
    thread_ids,
    warm_priority,
)


def test_thread_ids_lists_this_process_and_nothing_for_a_gone_one() -> None:
    release = threading.Event()
    t = threading.Thread(target=release.wait, daemon=True)
    t.start()
    try:
        assert len(thread_ids()) >= 2 and t.native_id in thread_ids()
        assert thread_ids(os.getpid()) and set(thread_ids(os.getpid())) == set(thread_ids())
    finally:
        release.set()
        t.join()
    assert thread_ids(2**22 + 12345) == []  # no such process


def test_run_priority_at_the_current_niceness_changes_nothing() -> None:
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    assert run_priority(nice) is None
    assert os.getpriority(os.PRIO_PROCESS, 0) == nice
    assert may_return_to(nice)  # a process may always stay where it is


def test_warm_priority_moves_every_thread_of_another_process_and_a_gone_one_is_no_error() -> None:
    """The pool (or a spare's parent) moves a process down, never the process itself."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import threading, time\n"
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "time.sleep(60)",
        ]
    )
    try:
        deadline = time.monotonic() + 30
        while len(thread_ids(child.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        base = os.getpriority(os.PRIO_PROCESS, 0)
        warm = min(19, base + 10)
        warm_priority(warm, child.pid)
        tids = thread_ids(child.pid)
        assert len(tids) >= 2
        assert all(os.getpriority(os.PRIO_PROCESS, t) == warm for t in tids)
        if hasattr(os, "SCHED_IDLE"):
            assert all(os.sched_getscheduler(t) == os.SCHED_IDLE for t in tids)
    finally:
        child.kill()
        child.wait()
    warm_priority(19, 2**22 + 12345)  # no such process: nothing to do


def test_born_warm_starts_a_child_at_the_warm_up_priority() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    warm = min(19, base + 10)
    code = "import os; print(os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0))"
    for setting, expected_nice in ((warm, warm), (None, base)):
        out = subprocess.run(
            [sys.executable, "-c", code],
            preexec_fn=born_warm(os.getpid(), (warm, base), idle=setting is not None),
            capture_output=True,
            text=True,
            timeout=60,
        )
        nice, policy = (int(x) for x in out.stdout.split())
        assert nice == expected_nice
        if hasattr(os, "SCHED_IDLE"):
            assert (policy == os.SCHED_IDLE) == (setting is not None)
