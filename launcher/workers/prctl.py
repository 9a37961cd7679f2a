"""The Linux process calls every child the agent starts needs, in one place.

Owns: libc's `prctl` (`LIBC`), `die_with_parent` (run in a child between fork and exec, or in a
forked spare once the agent is its parent: its own session, `PR_SET_PDEATHSIG(SIGKILL)` so it
dies with its agent, and an exit when the agent died before that took effect) and
`set_process_name` (the name `ps` shows). Used by the agent's side (`workers`, `spare`,
`fork_server`) and inside the spare fork server (`spare_server`); imports nothing of ours.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
LIBC = ctypes.CDLL(None, use_errno=True)


def die_with_parent(parent_pid: int, new_session: bool = True) -> None:
    """This process dies with `parent_pid` (SIGKILL); it exits at once when that parent is
    already gone. `new_session`: first start its own session (a child between fork and exec)."""
    if new_session:
        os.setsid()
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the agent died before prctl took effect
        os._exit(1)


def set_process_name(name: bytes) -> bytes:
    """Set this process's name (`ps`, /proc/PID/comm, at most 15 bytes); the previous one."""
    try:
        with open("/proc/self/comm", "rb") as f:
            old = f.read().strip()
    except OSError:
        old = b"python"
    LIBC.prctl(PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)
    return old
