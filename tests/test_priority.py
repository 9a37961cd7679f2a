"""priority: the threads of a process and the way back to the agent's priority."""

from __future__ import annotations

import os
import threading

from launcher.workers.priority import may_return_to, run_priority, thread_ids


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
