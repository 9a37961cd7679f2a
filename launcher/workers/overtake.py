"""A cold replacement overtaken by a warm spare that became ready first.

Owns: `ColdStart`, a process-level replacement started as a fresh process because no warm spare
was ready (its worker, process, environment and script arguments, when it started), and the
two process calls the spawner's `overtake` needs to take the rank from it safely: `freeze`
(SIGSTOP to its process group, then the wait until every thread of it is stopped, so it cannot
connect to the agent or the store while the agent decides) and `thaw` (SIGCONT). A cold
replacement is overtaken only before it has connected to the agent's worker channel (its
hello): until then it has touched neither the store nor the round, so a spare can take its
place in the same round without a second plan.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

from launcher.workers.workers import Worker

FREEZE_S = 0.5  # every thread of a frozen process is stopped within this long (else: thawed)
STOPPED_STATES = ("T", "t")  # /proc/PID/task/TID/stat: stopped by a signal, or traced


@dataclass
class ColdStart:
    """A replacement that started cold while spares were being kept (a spare may overtake it)."""

    worker: Worker
    proc: subprocess.Popen
    env: dict[str, str]
    argv: list[str]  # the script and its arguments (`python -u [-m]` dropped)
    started: float = field(default_factory=time.monotonic)

    @property
    def current(self) -> bool:
        """It is still its rank's live process."""
        return self.worker.proc is self.proc and self.proc.poll() is None


def _signal_group(pid: int, sig: int) -> bool:
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def all_stopped(pid: int) -> bool:
    """Every thread of `pid` is stopped (False when it is gone or a thread still runs)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii", errors="replace") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # a thread that just ended
        if state not in STOPPED_STATES:
            return False
    return bool(tids)


def freeze(pid: int, timeout: float = FREEZE_S) -> bool:
    """SIGSTOP the process group of `pid` (a worker is its session's leader); True once every
    thread of `pid` is stopped within `timeout` s (else the caller thaws it)."""
    if not _signal_group(pid, signal.SIGSTOP):
        return False
    deadline = time.monotonic() + timeout
    while not all_stopped(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def thaw(pid: int) -> None:
    """SIGCONT the process group of `pid`."""
    _signal_group(pid, signal.SIGCONT)


def kill_frozen(pid: int) -> None:
    """SIGKILL the (frozen) process group of `pid`: a stopped process dies of it at once; the
    reaper reaps it (its exit is an older process's of the rank: nothing to report)."""
    _signal_group(pid, signal.SIGKILL)
