"""Children the agent did not start itself: the subreaper flag, a Popen-like handle, orphan reaping.

Owns: making the agent a child subreaper (`PR_SET_CHILD_SUBREAPER`), so a process forked by a
grandchild (the spare fork server's double fork) becomes the agent's own child once its parent
exits; `AdoptedChild`, the Popen subset the agent uses for such a child (pid, poll, wait with a
timeout, send_signal/terminate/kill through a pidfd, returncode with Popen's meaning: negative =
killed by that signal, stdin), so a forked spare can become a rank's worker exactly like a
Popen'd one; and `reap_orphans`, which reaps the other processes a subreaper inherits (a dead
worker's own children) without ever taking the exit status of a child some handle waits for.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import threading
import time
from typing import BinaryIO

PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


def set_subreaper(on: bool) -> bool:
    """Make this process a child subreaper (or stop being one); False when the OS refuses."""
    return _libc.prctl(PR_SET_CHILD_SUBREAPER, 1 if on else 0, 0, 0, 0) == 0


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, session id) of `pid`, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[3])
    except (OSError, IndexError, ValueError):
        return None


def children() -> list[int]:
    """This process's children (of every thread), zombies included."""
    pids: list[int] = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return pids
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/children", encoding="ascii") as f:
                pids += [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            pass
    return pids


def reap_orphans() -> list[tuple[int, int]]:
    """Reap the exited orphans this subreaper inherited; [(pid, exit code)].

    Only zombies whose session is neither their own (every process the agent starts with a handle
    is a session leader: workers, spares, the fork server) nor the agent's (anything it runs
    without a new session, e.g. `subprocess.run`) are reaped: what is left is a descendant of a
    worker or of the fork server whose parent died, which no handle waits for."""
    own_sid = os.getsid(0)
    reaped = []
    for pid in children():
        st = _stat(pid)
        if st is None or st[0] != "Z" or st[1] in (pid, own_sid):
            continue
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if got == pid:
            reaped.append((pid, os.waitstatus_to_exitcode(status)))
    return reaped


class AdoptedChild:
    """A Popen-like handle for a child of this process that it did not fork itself (a forked
    warm spare, reparented to the agent). Safe from several threads: one of them reaps it."""

    def __init__(self, pid: int, stdin: BinaryIO | None = None) -> None:
        self.pid = pid
        self.args = [f"<adopted pid {pid}>"]
        self.stdin = stdin
        self.stdout = None
        self.stderr = None
        self.returncode: int | None = None
        self._lock = threading.Lock()
        # our child: its pid cannot be reused until it is reaped; closed with the handle
        self._pidfd: int | None = os.pidfd_open(pid)

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    got, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere (not by design): Popen's answer
                    got, status = self.pid, 0
                if got == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            fd = self._pidfd
            if fd is None:
                time.sleep(0.001)
                continue
            # readable once it exited; the fd stays open while the handle lives (no reuse race)
            select.select([fd], [], [], 1.0 if left is None else min(left, 1.0))
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._lock:
            if self.returncode is not None or self._pidfd is None:
                return
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _close_pidfd(self) -> None:
        fd, self._pidfd = self._pidfd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self._close_pidfd()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
