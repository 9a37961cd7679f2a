"""SparePause: spares stopped while a round holds the pool, continued after it (real processes)."""

from __future__ import annotations

import subprocess
import sys
import time

from helpers_procs import proc_state, settles

from launcher.workers.spare_pause import SparePause


def _sleepers(n: int) -> list[subprocess.Popen]:
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    return [subprocess.Popen(sleep) for _ in range(n)]


def _end(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()  # SIGKILL ends a stopped process too
        p.wait(timeout=10)


def test_a_round_stops_the_preparing_ones_and_its_end_continues_them() -> None:
    procs = _sleepers(2)
    pause = SparePause()
    try:
        pause.hold_begins({p.pid for p in procs})
        assert all(settles(p.pid, stopped=True) for p in procs)
        pause.resume(procs[0].pid)  # taken for a rank: continued first
        assert settles(procs[0].pid, stopped=False) and proc_state(procs[1].pid) == "T"
        assert pause.paused == {procs[1].pid}
        pause.release()
        assert not pause.paused and settles(procs[1].pid, stopped=False)
    finally:
        _end(procs)


def test_a_cold_replacement_continues_every_paused_spare_and_pauses_no_more_this_round() -> None:
    procs = _sleepers(2)
    pause = SparePause()
    try:
        pause.hold_begins({procs[0].pid})
        assert settles(procs[0].pid, stopped=True)
        pause.hurry()  # they race the cold one: the first ready takes its rank
        assert settles(procs[0].pid, stopped=False) and not pause.paused
        pause.pause({procs[1].pid})  # forked later in the same round: left running
        time.sleep(0.1)
        assert proc_state(procs[1].pid) != "T" and not pause.paused
        pause.hold_begins({procs[1].pid})  # the next round pauses again
        assert settles(procs[1].pid, stopped=True) and pause.paused == {procs[1].pid}
    finally:
        _end(procs)


def test_a_process_gone_is_neither_paused_nor_an_error() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid is free
    pause = SparePause()
    pause.hold_begins({gone.pid})
    assert not pause.paused
    pause.resume(gone.pid)  # not paused: nothing to do
    pause.release()
