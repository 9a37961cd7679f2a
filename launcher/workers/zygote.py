"""The spare fork server: one warm process per node that forks warm spares in milliseconds.

Owns: both ends of the fork server. `python -u -m launcher.workers.spare --fork-server FD` (`serve`) does
the warm imports once (torch, the runtime: 1.5-2 CPU-s) at the spares' warm-up priority, returns
to the agent's priority, reports ready with its thread count, and then, for every request on its
unix socket, forks a spare copy-on-write: an intermediate child forks the spare and exits at once,
so the spare is reparented to the agent (a child subreaper, `launcher.workers.adopted`) and becomes the
agent's own child, waited for and signalled like a Popen'd one. It forks only while it has exactly
one thread (no thread pool of torch's started: it never runs a tensor op) and answers an error
otherwise. The spare starts its own session, sets `PR_SET_PDEATHSIG(SIGKILL)` only once it sees
the agent as its parent (the death signal would fire at the reparenting), reads its assignment
line (the same JSON as `launcher.workers.spare`'s stdin) from a pipe the server made for it, whose write
end goes to the agent with the reply (`socket.send_fds`), and then runs the script exactly like a
Popen'd spare (`launcher.workers.spare.run_job`). EOF on that pipe means "not needed": it exits 0.
Before it waits for the assignment, a forked spare makes every page it shares with the server
its own (`own_pages`): otherwise the replacement's first pass through the interpreter's and
torch's state pays a copy-on-write fault per page it writes to (refcounts: nearly every page it
touches), ~15 ms of its start-up inside the recovery, measured here.
`ForkServer` is the agent's side (owned by `SparePool`): start, `poll_ready()` without blocking,
`fork()` with a timeout, `stop()`.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Callable

from launcher.runtime import heap
from launcher.workers.adopted import AdoptedChild, set_subreaper
from launcher.workers.workers import PR_SET_PDEATHSIG, _child_setup, _libc

PR_SET_NAME = 15
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault the range in for writing (breaks copy-on-write)
PAGE = os.sysconf("SC_PAGE_SIZE")
PAGEMAP_CHUNK = 1 << 16  # pages per /proc/self/pagemap read (512 KB of entries)
SERVER_NAME = b"ftrun-spare-srv"  # `ps` names: the server, and a forked spare until it is assigned
SPARE_NAME = b"ftrun-spare"
FORK_TIMEOUT_S = 2.0  # the server answers a fork request within this long, or is given up
REPARENT_TIMEOUT_S = 5.0  # a forked spare waits this long to see the agent as its parent


class _Forked(Exception):
    """Raised in a forked spare: unwinds the server's loop so the job runs at the top level
    (its exceptions, exit code and atexit handlers as in `python script`)."""

    def __init__(self, assignment_fd: int, agent: int, comm: bytes, heap_bytes: int = 0) -> None:
        super().__init__("forked spare")
        self.assignment_fd = assignment_fd
        self.agent = agent
        self.comm = comm  # the process name to take back when the job starts
        self.heap_bytes = (
            heap_bytes  # heap to fault in before the assignment (launcher.runtime.heap)
        )


def _name(name: bytes) -> bytes:
    """Set this process's name (`ps`, /proc/PID/comm); the previous one."""
    try:
        with open("/proc/self/comm", "rb") as f:
            old = f.read().strip()
    except OSError:
        old = b"python"
    _libc.prctl(PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)
    return old


# ------------------------------------------------------------------ the server process
def serve(sock_fd: int) -> None:
    """The fork server's life; raises `_Forked` in each forked spare."""
    from launcher.workers import spare

    agent = os.getppid()
    sock = socket.socket(fileno=sock_fd)
    comm = _name(SERVER_NAME)
    warm, base = (int(x) for x in os.environ.get("FTRUN_SPARE_NICE", "0,0").split(","))
    if warm != base:
        spare._warm_priority(warm)
    spare._warm_imports()
    if warm != base:  # warm now: forks must not wait for idle CPU time
        spare.run_priority(base)
    threads = len(spare._threads())
    try:
        sock.send(json.dumps({"ready": True, "threads": threads}).encode())
        if threads != 1:
            return  # the agent falls back to spares that import torch themselves
        while True:
            req = sock.recv(4096)
            if not req:
                return  # the agent closed its end: done
            try:
                heap_bytes = max(0, int(json.loads(req).get("heap_bytes", 0)))
            except (ValueError, AttributeError, TypeError):
                heap_bytes = 0
            if len(spare._threads()) != 1:
                sock.send(
                    json.dumps({"error": f"{len(spare._threads())} threads; not forking"}).encode()
                )
                continue
            try:
                pid, w = _fork_spare(sock, agent, comm, heap_bytes)
            except OSError as exc:
                sock.send(json.dumps({"error": f"fork failed: {exc}"}).encode())
                continue
            try:
                socket.send_fds(sock, [json.dumps({"pid": pid}).encode()], [w])
            finally:
                os.close(w)
    except (BrokenPipeError, ConnectionResetError):
        return  # the agent is gone or stopped us


def _fork_spare(
    sock: socket.socket, agent: int, comm: bytes, heap_bytes: int = 0
) -> tuple[int, int]:
    """Double-fork a spare; (its pid, the write end of its assignment pipe). In the spare this
    raises `_Forked`."""
    r, w = os.pipe()
    pr, pw = os.pipe()
    try:
        mid = os.fork()
    except OSError:
        for fd in (r, w, pr, pw):
            os.close(fd)
        raise
    if mid == 0:  # the intermediate: fork the spare, report its pid, exit at once
        try:
            pid = os.fork()
        except BaseException:  # noqa: BLE001
            os._exit(1)
        if pid == 0:
            for fd in (w, pr, pw):
                os.close(fd)
            sock.close()
            _name(SPARE_NAME)
            raise _Forked(r, agent, comm, heap_bytes)
        try:
            os.write(pw, pid.to_bytes(4, "little"))
        finally:
            os._exit(0)
    os.close(pw)
    os.close(r)
    try:
        data = b""
        while len(data) < 4:
            chunk = os.read(pr, 4 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(pr)
        os.waitpid(mid, 0)  # exits right after the write; the spare is the agent's child now
    if len(data) != 4:
        os.close(w)
        raise OSError("the intermediate child did not report the spare's pid")
    return int.from_bytes(data, "little"), w


def own_pages() -> tuple[int, str | None]:
    """Break copy-on-write on every page of this process's private writable mappings that is
    present (shared with the process it was forked from), and on no other page (populating
    untouched ones would only cost memory); (bytes made private, why not all could be, or
    None). Needs MADV_POPULATE_WRITE (Linux 5.14): without it nothing is done."""
    try:
        import numpy as np  # torch's own dependency; the fork server imported it with torch
    except ImportError:
        return 0, "numpy is not installed"
    lib = heap.libc()
    if lib is None:
        return 0, "not glibc on Linux"
    madvise = lib.madvise
    done, why = 0, None
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            maps = [ln.split() for ln in f]
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError as exc:
        return 0, f"cannot read /proc/self/maps or pagemap: {exc.strerror}"
    try:
        for parts in maps:
            perms = parts[1]
            if (
                perms[:2] != "rw"
                or perms[3] != "p"
                or (len(parts) > 5 and parts[5] == "[vsyscall]")
            ):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            for base in range(lo, hi, PAGEMAP_CHUNK * PAGE):  # bounded reads of a large mapping
                n = min(PAGEMAP_CHUNK, (hi - base) // PAGE)
                raw = os.pread(fd, n * 8, (base // PAGE) * 8)
                present = (np.frombuffer(raw, dtype=np.uint64) >> np.uint64(63)).astype(np.int8)
                edges = np.flatnonzero(np.diff(np.concatenate(([0], present, [0]))))
                for start, stop in zip(edges[::2].tolist(), edges[1::2].tolist()):
                    if (
                        madvise(base + start * PAGE, (stop - start) * PAGE, MADV_POPULATE_WRITE)
                        == 0
                    ):
                        done += (stop - start) * PAGE
                    elif why is None:
                        why = os.strerror(ctypes.get_errno())
    finally:
        os.close(fd)
    return done, why


def become_spare(forked: _Forked) -> None:
    """In a forked spare: own session, wait to be the agent's child, die with it, then read the
    assignment and run the job (returns only by raising or when the job returns)."""
    from launcher.workers import spare

    os.setsid()
    deadline = time.monotonic() + REPARENT_TIMEOUT_S
    while os.getppid() != forked.agent:
        if time.monotonic() > deadline:
            os._exit(1)
        time.sleep(0.0005)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != forked.agent:  # the agent died before prctl took effect
        os._exit(1)
    if "numpy.random" in sys.modules:  # a fresh process seeds numpy's global RNG from entropy
        sys.modules["numpy.random"].seed()
    own_pages()  # the pages it cannot own are copied on first write, as before
    prepared = heap.prepare(forked.heap_bytes)
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(forked.assignment_fd, 65536)
        if not chunk:
            break
        line += chunk
    os.close(forked.assignment_fd)
    if not line.strip():
        sys.exit(0)
    _name(forked.comm)  # a rank looks like any worker in `ps`
    job = json.loads(line)
    if prepared:
        job["env"][heap.ENV] = str(prepared)  # the runtime settles the heap after its repair
    spare.run_job(job)


def main(sock_fd: int) -> None:
    forked = None
    try:
        serve(sock_fd)
    except _Forked as exc:
        forked = exc
        exc.__traceback__ = None  # drop the server's frames
    if forked is None:
        sys.exit(0)
    # outside the except block: the job must not run "while handling" _Forked (sys.exc_info(),
    # and the context of its own exceptions, as in a fresh `python script`)
    become_spare(forked)


# ------------------------------------------------------------------ the agent's side
class ForkServer:
    """The agent's handle on its node's fork server. Not thread-safe: one owner (SparePool)."""

    def __init__(self, python: str, env: dict[str, str], nice: tuple[int, int]) -> None:
        if not set_subreaper(True):
            raise OSError("PR_SET_CHILD_SUBREAPER refused")
        parent = os.getpid()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [
                    python,
                    "-u",
                    "-m",
                    "launcher.workers.spare",
                    "--fork-server",
                    str(theirs.fileno()),
                ],
                env=dict(env, FTRUN_SPARE_NICE=f"{nice[0]},{nice[1]}"),
                stdin=subprocess.DEVNULL,
                stdout=None,
                stderr=None,
                pass_fds=[theirs.fileno()],
                close_fds=True,
                preexec_fn=lambda: _child_setup(parent),
            )
        except BaseException:
            ours.close()
            set_subreaper(False)
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.started = time.monotonic()
        self.ready = False
        self.threads = 0

    def poll_ready(self) -> bool:
        """Whether the server finished its imports (never blocks); raises OSError when it died
        or reported more than one thread."""
        if self.ready:
            return True
        self.sock.setblocking(False)
        try:
            msg = self.sock.recv(4096)
        except BlockingIOError:
            if self.proc.poll() is not None:
                raise OSError(f"the fork server exited with {self.proc.returncode}") from None
            return False
        finally:
            self.sock.setblocking(True)
        if not msg:
            raise OSError(f"the fork server closed its socket (exit {self.proc.poll()})")
        info = json.loads(msg)
        self.threads = int(info.get("threads", 0))
        if self.threads != 1:
            raise OSError(
                f"the fork server has {self.threads} threads after its imports; "
                "forking it is not safe"
            )
        self.ready = True
        return True

    def fork(self, timeout: float = FORK_TIMEOUT_S, heap_bytes: int = 0) -> AdoptedChild:
        """A new warm spare, the agent's own child, that faults in `heap_bytes` of heap while
        it waits (`launcher.runtime.heap`); raises OSError when the server cannot."""
        assert self.ready
        deadline = time.monotonic() + timeout  # one bound for the request and its answer
        self.sock.settimeout(timeout)
        try:
            self.sock.send(json.dumps({"fork": True, "heap_bytes": int(heap_bytes)}).encode())
            self.sock.settimeout(max(0.001, deadline - time.monotonic()))
            msg, fds, _, _ = socket.recv_fds(self.sock, 4096, 1)
        except (OSError, socket.timeout) as exc:
            raise OSError(f"no answer from the fork server ({exc or 'timeout'})") from exc
        finally:
            self.sock.settimeout(None)
        if not msg:
            for fd in fds:
                os.close(fd)
            raise OSError(f"the fork server closed its socket (exit {self.proc.poll()})")
        info = json.loads(msg)
        if "pid" not in info or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise OSError(info.get("error", f"bad answer {msg!r}"))
        try:
            child = AdoptedChild(int(info["pid"]), os.fdopen(fds[0], "wb"))
        except OSError:
            os.close(fds[0])
            raise
        return child

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, log: Callable[[str], None] | None = None, timeout: float = 5.0) -> None:
        """End the server at once: it holds nothing (every spare it forked is the agent's own
        child already, and no fork is under way outside `fork()`); waits `timeout` s for it."""
        try:
            self.sock.close()
        except OSError:
            pass
        self.proc.kill()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # D-state, or starved of CPU
            if log:
                log(
                    f"spare fork server pid {self.proc.pid} did not exit within {timeout:.1f} s "
                    "of SIGKILL; left behind"
                )
