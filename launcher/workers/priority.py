"""CPU priority of a warm spare's processes: out of the way while warming up, back after.

Owns: `warm_priority` (a process at a warm-up niceness and, where the OS has it, SCHED_IDLE),
`born_warm` (a pool process that starts that way), `run_priority` (every thread of a process
back to the agent's priority), `may_return_to` (whether a process of ours, made nicer, may
return to a niceness) and `thread_ids`. Used on both sides of a spare: by the agent's pool
(`spare`: a spare warming up too long, a boosted replacement; `fork_server`) and inside the
spare and the fork server (`spare_process`, `spare_server`). Only a process's parent (or the
pool) moves it down to the warm-up priority, never the process itself, so the pool's move back
up is never undone.
"""

from __future__ import annotations

import os
from typing import Callable

from launcher.workers.prctl import die_with_parent


def thread_ids(pid: int | None = None) -> list[int]:
    """The thread ids of process `pid` (default: this one; [0] when unreadable, [] for a
    process that is gone)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{'self' if pid is None else pid}/task")]
    except OSError:
        return [0] if pid is None else []


def warm_priority(warm: int, pid: int | None = None) -> None:
    """Warm up out of the way: every thread of process `pid` (default: this thread) at `warm`
    niceness and, where the OS has it, SCHED_IDLE (runs only when a CPU has nothing else to do,
    so a successor's import never slows the recovery or the training that used its
    predecessor). A spare's parent sets it before the pool learns the spare's pid (`born_warm`,
    the fork server's intermediate child): a spare that demoted itself could do so after the pool
    had escalated it (`run_priority`), and stayed at idle priority for good."""
    for tid in [0] if pid is None else thread_ids(pid):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, warm)
        except ProcessLookupError:
            continue  # that thread (or the process) has ended meanwhile
        if hasattr(os, "SCHED_IDLE"):
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except OSError:
                pass


def born_warm(parent: int, nice: tuple[int, int], idle: bool = True) -> Callable[[], None]:
    """A `preexec_fn` for a pool process: it dies with `parent` and, when `idle` and its
    `nice` = (warm-up niceness, the agent's) differ, starts at the warm-up priority (before the
    pool knows its pid, so the pool's escalation is the last word)."""
    warm, base = nice

    def setup() -> None:
        die_with_parent(parent)
        if idle and warm != base:
            warm_priority(warm)

    return setup


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
