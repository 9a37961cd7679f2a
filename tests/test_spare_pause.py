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


def test_a_forked_spare_is_stopped_only_once_it_dies_with_the_agent(tmp_path) -> None:
    """CI (test_no_process_outlives_the_agent[paused], 1 of 8 runs beside two CPU burners): a
    spare forked during a round was stopped before it set its death signal, and outlived the
    SIGKILLed agent, stopped for good. It keeps the fork server's name until it dies with the
    agent; until then it waits, and a later check of the round stops it."""
    go = tmp_path / "go"
    unbound = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, time\n"
            "from launcher.workers.prctl import set_process_name\n"
            "from launcher.workers.spare_server import SERVER_NAME, SPARE_NAME\n"
            "set_process_name(SERVER_NAME)\n"  # as forked: the server's name
            "print('forked', flush=True)\n"
            "while not os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
            "set_process_name(SPARE_NAME)\n"  # as after its death signal is set
            "time.sleep(60)\n",
            str(go),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    pause = SparePause()
    try:
        assert unbound.stdout is not None and unbound.stdout.readline().strip() == "forked"
        assert pause.hold_begins({unbound.pid}) == [] and pause.waiting == {unbound.pid}
        assert pause.pause_waiting(set()) == []  # still without its death signal
        time.sleep(0.1)
        assert proc_state(unbound.pid) != "T" and not pause.paused
        go.touch()
        deadline = time.monotonic() + 10
        while not pause.pause_waiting(set()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert settles(unbound.pid, stopped=True) and pause.paused == {unbound.pid}
        assert not pause.waiting
        pause.release()
        assert settles(unbound.pid, stopped=False)
    finally:
        _end([unbound])
