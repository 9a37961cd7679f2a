"""CPU priority of a warm spare's processes: out of the way while warming up, back after.

Owns: `warm_priority` (this process at a warm-up niceness and, where the OS has it, SCHED_IDLE),
`run_priority` (every thread of a process back to the agent's priority), `may_return_to`
(whether a process of ours, made nicer, may return to a niceness) and `thread_ids`. Used on both
sides of a spare: by the agent's pool (`spare`: a spare warming up too long, a boosted
replacement) and inside the spare and the fork server (`spare_process`, `spare_server`).
"""

from __future__ import annotations

import os


def thread_ids(pid: int | None = None) -> list[int]:
    """The thread ids of process `pid` (default: this one; [0] when unreadable, [] for a
    process that is gone)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{'self' if pid is None else pid}/task")]
    except OSError:
        return [0] if pid is None else []


def warm_priority(warm: int) -> None:
    """Warm up out of the way: `warm` niceness and, where the OS has it, SCHED_IDLE (runs only
    when a CPU has nothing else to do, so a successor's import never slows the recovery or the
    training that used its predecessor)."""
    os.setpriority(os.PRIO_PROCESS, 0, warm)
    if hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass


def run_priority(base: int, pid: int | None = None) -> str | None:
    """Every thread of process `pid` (default: this one) back to the agent's priority
    (SCHED_OTHER, nice `base`); an error text or None."""
    err = None
    for tid in thread_ids(pid):
        try:
            if hasattr(os, "SCHED_OTHER") and os.sched_getscheduler(tid) != os.SCHED_OTHER:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, base)
        except OSError as exc:  # a thread may have ended meanwhile; remember real refusals
            if exc.errno != 3:  # ESRCH
                err = str(exc)
    return err


def may_return_to(nice: int) -> bool:
    """Whether a process of ours, made nicer, may lower its niceness back to `nice`."""
    if os.geteuid() == 0:
        return True
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    except (ImportError, AttributeError, OSError, ValueError):
        return False
    return soft == resource.RLIM_INFINITY or soft >= 20 - nice  # RLIMIT_NICE counts 20 - nice
