"""Progress as the kernel sees it: process state, CPU time and I/O of a process tree, and the
silence of unmodified workers (real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from launcher.hang.proc_watch import SilenceWatch, descendants, proc_stat, proc_state, tree_progress

BUSY = "import time\nt=time.time()\nwhile time.time()-t<30: pass"
PARENT = (
    "import subprocess,sys,time\n"
    "c=subprocess.Popen([sys.executable,'-c','import time; time.sleep(30)'])\n"
    "print(c.pid,flush=True)\ntime.sleep(30)"
)


def start(code: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], **kw)


def test_state_of_a_sleeping_a_stopped_and_a_gone_process() -> None:
    p = start("import time; time.sleep(30)")
    try:
        time.sleep(0.3)
        assert proc_state(p.pid) == "S"
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(0.1)
        assert proc_state(p.pid) == "T"
        st = proc_stat(p.pid)
        assert st is not None and st[1] == os.getpid()
    finally:
        p.kill()
        p.wait()
    assert proc_state(p.pid) == "" and proc_stat(p.pid) is None and tree_progress(p.pid) is None
    assert proc_state(None) == ""


def test_tree_progress_counts_children_and_moves_only_with_work() -> None:
    p = start(PARENT, stdout=subprocess.PIPE, text=True)
    try:
        child = int(p.stdout.readline())
        assert set(descendants(p.pid)) == {p.pid, child}
        time.sleep(0.5)
        a = tree_progress(p.pid)
        time.sleep(0.5)
        assert tree_progress(p.pid) == a  # both asleep: no CPU, no I/O
    finally:
        p.kill()
        p.wait()
    busy = start(BUSY)
    try:
        a = tree_progress(busy.pid)
        time.sleep(0.3)
        b = tree_progress(busy.pid)
        assert a is not None and b is not None and b[0] > a[0]  # CPU time moves
    finally:
        busy.kill()
        busy.wait()


def test_silence_watch_measures_since_the_last_change() -> None:
    w = SilenceWatch(interval=0.0)
    w.note(1, 100, (5, 10), now=0.0)
    w.note(1, 100, (5, 10), now=4.0)
    assert w.silent_for(1, now=6.0) == 6.0
    w.note(1, 100, (6, 10), now=7.0)  # one clock tick in 3 s: an idle poller's wake-ups
    assert w.silent_for(1, now=8.0) == 8.0
    w.note(1, 100, (26, 10), now=7.5)  # 20 ticks in 0.5 s: more than 2 % of a CPU
    assert w.silent_for(1, now=8.0) == 0.5
    w.note(1, 100, (26, 10), now=600.0)  # a long silence...
    w.note(1, 100, (126, 10), now=601.0)  # ...gives no credit to a burst of real work
    assert w.silent_for(1, now=601.5) == 0.5
    w.note(1, 100, (26, 11), now=8.0)  # one byte of I/O
    assert w.silent_for(1, now=9.0) == 1.0
    w.note(1, 101, (26, 11), now=9.0)  # a new process of the rank starts a new clock
    assert w.silent_for(1, now=10.0) == 1.0
    w.forget(1)
    assert w.silent_for(1, now=50.0) == 0.0
    p = start("import time; time.sleep(30)")
    try:
        time.sleep(0.8)  # past its start-up
        w.sample({3: p.pid}, now=time.time())
        time.sleep(0.2)
        w.sample({3: p.pid}, now=time.time() + 5.0)
        assert w.silent_for(3, now=time.time() + 5.0) >= 4.5
        w.sample({}, now=time.time() + 10.0)  # no longer watched
        assert w.silent_for(3) == 0.0
    finally:
        p.kill()
        p.wait()
