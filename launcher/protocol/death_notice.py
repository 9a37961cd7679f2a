"""Early notice of a worker's death: a robust mutex the worker holds in memory shared with its
agent.

Owns: both ends. The agent's `NoticeBoard` keeps one memfd of process-shared robust pthread
mutexes (two slots per local rank, used in turn by a rank's successive processes), arms a slot for
each new worker process (`arm` -> the worker's `FTRUN_DEATH_NOTICE`, "<path>:<offset>"), and, once
the worker says it holds it (its Hello carries the holding thread's id), watches it on a thread of
its own (`watch`). The worker's side is `hold`: it locks the slot on the calling thread (the
training thread, in `launcher.runtime.init`) and keeps it for the life of the process.

Why: a killed process is reported by its pidfd (or waitpid) only once the kernel has torn it down,
and tearing down a process that imported torch takes 10-15 ms on an idle machine and 20-55 ms
while the surviving ranks keep the CPUs busy (measured here: 220 MB of mapped libraries, the
state on top). The kernel releases a dying thread's robust mutexes first, before the address
space is freed: it marks the mutex's owner dead and wakes the waiter. The agent's watcher
thread is that waiter, so it learns of the death 0.1 ms (idle) to 3-13 ms (busy) after the kill.
It then confirms from `/proc/<pid>/task/<tid>/stat` that the thread is exiting (PF_EXITING) with a
non-zero exit status (a signal, or exit(n != 0): the process is dying; a clean exit, an exec or
the thread ending alone are left to the pidfd), and calls back with the status in Popen's terms
(negative = killed by that signal). The pidfd still reaps the process later.

Nothing is required: when the slot cannot be opened or locked (another pid namespace, no glibc
robust mutexes), the Hello carries no thread id and the exit is seen through the pidfd as before.
`FTRUN_DEATH_NOTICE=0` in ftrun's environment turns the notice off (read by the agent's
`launcher.config`, handed to `NoticeBoard` as `enabled`).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

SLOT_BYTES = 64  # >= sizeof(pthread_mutex_t) on every glibc ABI (40 on x86_64, 48 on aarch64)
PF_EXITING = 0x4  # task flag: the task has begun to exit (include/linux/sched.h)
POLL_S = 0.5  # a watcher re-checks whether it was cancelled this often
ENV = "FTRUN_DEATH_NOTICE"
FUTEX_TID_MASK = 0x3FFFFFFF  # a robust mutex's lock word: the owner's tid, plus two flag bits
SETTLE_S = 0.2  # the reaper waits at most this long for an awake watcher to report


def _load_pthread():
    """glibc's pthread entry points (libc itself since 2.34, libpthread before), or None."""
    for name in (None, "libpthread.so.0"):
        try:
            lib = ctypes.CDLL(name, use_errno=True)
            fns = [
                getattr(lib, f)
                for f in (
                    "pthread_mutexattr_init",
                    "pthread_mutexattr_setpshared",
                    "pthread_mutexattr_setrobust",
                    "pthread_mutex_init",
                    "pthread_mutex_lock",
                    "pthread_mutex_timedlock",
                    "pthread_mutex_unlock",
                )
            ]
        except (OSError, AttributeError):
            continue
        for f in fns:
            f.restype = ctypes.c_int
        return lib
    return None


_PT = _load_pthread()


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def supported() -> bool:
    return _PT is not None and hasattr(os, "memfd_create")


def _init_mutex(addr: int) -> bool:
    attr = ctypes.create_string_buffer(SLOT_BYTES)
    ok = (
        _PT.pthread_mutexattr_init(attr) == 0
        and _PT.pthread_mutexattr_setpshared(attr, 1) == 0  # PTHREAD_PROCESS_SHARED
        and _PT.pthread_mutexattr_setrobust(attr, 1) == 0
    )  # PTHREAD_MUTEX_ROBUST
    return ok and _PT.pthread_mutex_init(ctypes.c_void_p(addr), attr) == 0


def task_exit(pid: int, tid: int) -> tuple[bool, int] | None:
    """(PF_EXITING set, exit code as waitpid encodes it) of thread `tid` of `pid`; None if gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return bool(int(fields[6]) & PF_EXITING), int(fields[49])
    except (OSError, IndexError, ValueError):
        return None


def popen_code(status: int) -> int:
    """A waitpid status as Popen's returncode: -signal when killed by one, else the exit code."""
    sig = status & 0x7F
    return -sig if sig else (status >> 8) & 0xFF


# ---------------------------------------------------------------------------- the worker's side


@dataclass
class Held:
    """A slot this process holds (keep the object: it keeps the mapping alive)."""

    tid: int
    mapping: mmap.mmap


def hold(spec: str | None) -> Held | None:
    """Lock the agent's slot `spec` ("<path>:<offset>", from FTRUN_DEATH_NOTICE) on this thread
    for the life of the process; None (and nothing held) when there is none or it cannot be."""
    if not spec or _PT is None:
        return None
    path, _, off = spec.rpartition(":")
    try:
        offset = int(off)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        if offset < 0 or offset % SLOT_BYTES or offset + SLOT_BYTES > os.fstat(fd).st_size:
            return None
        m = mmap.mmap(fd, os.fstat(fd).st_size)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m)) + offset
    # a fresh slot is free: a timed lock that does not succeed at once means it is not ours
    if _PT.pthread_mutex_timedlock(ctypes.c_void_p(addr), ctypes.byref(_deadline(0.2))) != 0:
        return None
    return Held(threading.get_native_id(), m)


def _deadline(seconds: float) -> _Timespec:
    t = time.time() + seconds  # pthread_mutex_timedlock counts on CLOCK_REALTIME
    return _Timespec(int(t), int((t % 1) * 1e9))


# ---------------------------------------------------------------------------- the agent's side


def _watcher_name(pid: int) -> str:
    return f"ftrun-notice:{pid}"


class NoticeBoard:
    """The agent's slots and watchers. Owned by the agent: `stop()` ends every watcher (within
    `POLL_S`) and closes the memfd. `enabled` is False when this system has no robust mutexes
    or it was asked for off (`enabled=False`: `FTRUN_DEATH_NOTICE=0`); then `arm` returns None
    and nothing is watched."""

    def __init__(self, nproc: int, enabled: bool = True) -> None:
        self.enabled = enabled and supported()
        self._nslots = 2 * max(1, nproc)
        self._fd = -1
        self._map: mmap.mmap | None = None
        self._base = 0
        self.path = ""  # /proc/<agent pid>/fd/<memfd> once enabled
        self._lock = threading.Lock()
        self._watched: dict[int, threading.Thread] = {}  # slot -> watcher
        self._held: dict[int, tuple[int, int]] = {}  # watched pid -> (slot, holding tid)
        self._stop = threading.Event()
        if not self.enabled:
            return
        try:
            self._fd = os.memfd_create("ftrun-death-notice", os.MFD_CLOEXEC)
            os.ftruncate(self._fd, self._nslots * SLOT_BYTES)
            self._map = mmap.mmap(self._fd, self._nslots * SLOT_BYTES)
        except OSError:
            self.enabled = False
            self.stop()
            return
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.path = f"/proc/{os.getpid()}/fd/{self._fd}"

    def arm(self, local_rank: int, spawns: int) -> str | None:
        """A fresh mutex for the next process of `local_rank` (its `spawns` so far picks one of
        the rank's two slots, so the previous process's slot is never touched); the
        FTRUN_DEATH_NOTICE value, or None (no notice for this process)."""
        if not self.enabled or self._stop.is_set():
            return None
        slot = (2 * local_rank + spawns % 2) % self._nslots
        with self._lock:
            t = self._watched.get(slot)
            if t is not None and t.is_alive():
                return None  # a process two spawns back still watched: leave it its slot
            if not _init_mutex(self._base + slot * SLOT_BYTES):
                return None
        return f"{self.path}:{slot * SLOT_BYTES}"

    def watch(self, spec: str, pid: int, tid: int, on_death: Callable[[int], None]) -> bool:
        """Wait on `spec`'s slot, which thread `tid` of process `pid` holds, on a thread of its
        own; `on_death(code)` when that process dies (code as Popen's returncode). False when
        `spec` is not one of this board's slots."""
        path, _, off = spec.rpartition(":")
        if not self.enabled or path != self.path or not off.isdigit():
            return False
        slot = int(off) // SLOT_BYTES
        if not 0 <= slot < self._nslots or self._stop.is_set():
            return False
        t = threading.Thread(
            target=self._wait,
            args=(slot, pid, tid, on_death),
            name=_watcher_name(pid),
            daemon=True,
        )
        with self._lock:
            old = self._watched.get(slot)
            if old is not None and old.is_alive():
                return False
            self._watched[slot] = t
            self._held[pid] = (slot, tid)
        t.start()
        return True

    def settle(self, pid: int, timeout: float = SETTLE_S) -> None:
        """Let `pid`'s watcher report first: called by the reaper when `pid`'s pidfd says it has
        exited, before reporting that exit itself. The kernel released the dead thread's robust
        mutex before it tore the process down, so its watcher is awake and about to call back
        (on a loaded machine both threads wait for the GIL, and the reaper could win). Returns at
        once when there is no watcher, or when the mutex still names the dead thread (the
        kernel could not release it: the process unmapped its slot before exiting)."""
        with self._lock:
            slot, tid = self._held.pop(pid, (-1, 0))
            t = self._watched.get(slot)
        if t is None or not t.is_alive() or t.name != _watcher_name(pid) or self._map is None:
            return
        word = ctypes.c_uint32.from_address(self._base + slot * SLOT_BYTES).value
        if word & FUTEX_TID_MASK == tid:
            return
        t.join(timeout)

    def _wait(self, slot: int, pid: int, tid: int, on_death: Callable[[int], None]) -> None:
        addr = ctypes.c_void_p(self._base + slot * SLOT_BYTES)
        while not self._stop.is_set():
            rc = _PT.pthread_mutex_timedlock(addr, ctypes.byref(_deadline(POLL_S)))
            if rc == errno.ETIMEDOUT:
                continue
            if rc in (0, errno.EOWNERDEAD):
                # ours now: unlock at once, so it leaves this thread's robust list (unlocked
                # without pthread_mutex_consistent it is unusable, and `arm` re-initialises it)
                _PT.pthread_mutex_unlock(addr)
            if rc == errno.EOWNERDEAD:
                st = task_exit(pid, tid)
                if st is not None and st[0] and st[1] != 0:
                    on_death(popen_code(st[1]))
            return  # released, dying, or unusable: this process is the pidfd's from here

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            threads = list(self._watched.values())
            self._watched.clear()
            self._held.clear()
        for t in threads:
            t.join(POLL_S + 1.0)
        # a watcher still blocked would touch freed memory: keep the mapping then (process exit
        # frees it)
        if self._map is not None and not any(t.is_alive() for t in threads):
            try:
                self._map.close()
            except BufferError:  # a ctypes view still refers to it
                pass
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
