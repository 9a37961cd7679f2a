"""Inside the spare fork server: one warm process per node that forks warm spares in milliseconds.

Owns: the fork server's process. `python -u -m launcher.workers.spare_server FD --nice
WARM,BASE` (`serve`) does the warm imports once (`launcher.workers.spare_process.warm_imports`:
torch, the runtime: 1.5-2 CPU-s; then the job's modules of `--imports FILE`) at the priority it
was born at (the spares' warm-up one, set by `ForkServer` before it ran; the agent's when the
job's ranks are to be forked from it and wait for it), returns to the agent's priority, reports
ready with its thread count, and then, for every request on its unix socket, either imports more
of the job's modules (`{"imports": FILE}`: what the ranks imported by their first step, at the
warm-up priority; a module that fails is skipped and named in the answer, `failed`) or forks a
spare copy-on-write: an intermediate child forks the spare and exits at once, so the spare is
reparented to the agent (a child subreaper, `launcher.workers.adopted`) and becomes the agent's
own child, waited for and signalled like a Popen'd one. It forks only while it has exactly one
thread (no thread pool of torch's started: it never runs a tensor op) and answers an error
otherwise. The spare starts its own session, sets `PR_SET_PDEATHSIG(SIGKILL)` only once it sees
the agent as its parent (the death signal would fire at the reparenting), reads its assignment
line (the same JSON as a Popen'd spare's stdin) from a pipe the server made for it, whose write
end goes to the agent with the reply (`socket.send_fds`, with the read end of a pipe on which
the spare writes one byte once it is prepared: the pool's `spare-ready`), and then runs the
script exactly like a Popen'd spare (`launcher.workers.spare_process.run_job`). EOF on that pipe
means "not needed": it exits 0. Before it waits for the assignment (unless forked for a
replacement that waits: `prepare` false), a forked spare makes every page it shares with the
server its own, at the warm-up priority (the server's `--nice` WARM: idle CPU time; the agent's
pool escalates it after its idle limit, as a warm-up) (`own_pages`): otherwise the replacement's
first pass through the interpreter's and torch's state pays a copy-on-write fault per page it
writes to (refcounts: nearly every page it touches), ~15 ms of its start-up inside the recovery,
measured here. A spare whose assignment arrives meanwhile stops there (and faults no heap in):
the round would wait for the rest. The agent's handle on this process is
`launcher.workers.fork_server.ForkServer`.

A fork shares what a fresh process would make its own at start: so the server holds numpy's
OpenBLAS at one thread (`hold_blas_threads`: its pool's threads would make it unsafe to fork),
and each forked spare, once assigned, gets the pool a fresh process with the job's environment
has (`blas_threads`) and seeds torch's and numpy's global generators afresh (`fresh_seeds`).
The node's ranks themselves are forked from this server too (`launcher.workers.spawner`:
`FTRUN_WORKER_START`): a fork for a rank is a spare forked for a replacement that waits
(`prepare` false), assigned at once.

The heap a forked spare faults in for its replacement is the runtime's
(`launcher.runtime.heap`: `prepare` here, `settle` in the replacement's runtime). This process
has imported the runtime in its warm-up already; it reaches that module by name
(`HEAP_MODULE`, `importlib`), as it does its warm imports, so that nothing the agent imports
names the runtime (`launcher.workers` may not import `launcher.runtime`: the agent stays free
of torch). The command line names the module `launcher.workers.spare_server`, so a forked spare
(which keeps it) is found as a `launcher.workers.spare*` process, as a Popen'd one.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import select
import socket
import sys
import time
from types import ModuleType
from typing import Callable

from launcher.workers.prctl import die_with_parent, set_process_name
from launcher.workers.priority import run_priority, thread_ids, warm_priority
from launcher.workers.spare_process import (
    IMPORTS_FLAG,
    NICE_FLAG,
    flag_value,
    import_listed,
    parse_nice,
    run_job,
    warm_imports,
)

HEAP_MODULE = "launcher.runtime.heap"  # the runtime's heap helpers, imported by name here
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault the range in for writing (breaks copy-on-write)
PAGE = os.sysconf("SC_PAGE_SIZE")
PAGEMAP_CHUNK = 1 << 16  # pages per /proc/self/pagemap read (512 KB of entries)
POPULATE_CHUNK = 256  # pages made private per madvise (1 MB: ~0.3 ms), the assignment checked
# `ps` names: the server, and a forked spare until it dies with the agent (its death signal set:
# `launcher.workers.spare_pause` stops no process before, which would outlive a killed agent)
SERVER_NAME = b"ftrun-spare-srv"
SPARE_NAME = b"ftrun-spare"  # a forked spare from then on until it is assigned
REPARENT_TIMEOUT_S = 5.0  # a forked spare waits this long to see the agent as its parent
# what OpenBLAS reads for its thread count, in its order; its cap; its setters' names (numpy's
# scipy-openblas bundle, an older openblas64_ bundle, a plain OpenBLAS)
BLAS_THREAD_ENV = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
OPENBLAS_MAX_THREADS = 64
OPENBLAS_SETTERS = (
    "scipy_openblas_set_num_threads64_",
    "openblas_set_num_threads64_",
    "openblas_set_num_threads",
)
REQUEST_BYTES = 1 << 16  # a request from the agent is at most this long
FAILED_NAMED = 8  # an answer names at most this many modules that failed to import


class _Forked(Exception):
    """Raised in a forked spare: unwinds the server's loop so the job runs at the top level
    (its exceptions, exit code and atexit handlers as in `python script`)."""

    def __init__(
        self,
        assignment_fd: int,
        agent: int,
        comm: bytes,
        heap_bytes: int = 0,
        ready_fd: int = -1,
        prepare: bool = True,
        nice: tuple[int, int] = (0, 0),
    ) -> None:
        super().__init__("forked spare")
        self.assignment_fd = assignment_fd
        self.ready_fd = ready_fd  # one byte written here once prepared (-1: none)
        self.prepare = prepare  # own its pages and fault its heap in (idle time) first
        self.agent = agent
        self.comm = comm  # the process name to take back when the job starts
        self.heap_bytes = (
            heap_bytes  # heap to fault in before the assignment (launcher.runtime.heap)
        )
        self.nice = nice  # (warm-up niceness, the agent's): the preparation runs at the first


def _heap() -> ModuleType:
    """`launcher.runtime.heap` (imported by the warm-up already; see the module docstring)."""
    return importlib.import_module(HEAP_MODULE)


# ------------------------------------------------------------------ the server process
def serve(sock_fd: int, nice: tuple[int, int] = (0, 0), imports: str | None = None) -> None:
    """The fork server's life (`nice`: its warm-up niceness and the agent's; `imports`: the
    job's modules to import after the warm imports, an `--imports` file; the start-up runs at
    the priority it was born at, the later imports at the warm-up one); raises `_Forked` in
    each forked spare."""
    agent = os.getppid()
    sock = socket.socket(fileno=sock_fd)
    comm = set_process_name(SERVER_NAME)
    warm, base = nice
    hold_blas_threads()
    warm_imports()
    failed = import_listed(imports) if imports else []
    if warm != base:  # warm now: forks must not wait for idle CPU time (a no-op if born urgent)
        run_priority(base)
    threads = len(thread_ids())
    try:
        sock.send(json.dumps({"ready": True, "threads": threads, **_failures(failed)}).encode())
        if threads != 1:
            return  # the agent falls back to spares that import torch themselves
        while True:
            req = sock.recv(REQUEST_BYTES)
            if not req:
                return  # the agent closed its end: done
            if not _answer(sock, req, agent, comm, nice):
                return
    except (BrokenPipeError, ConnectionResetError):
        return  # the agent is gone or stopped us


def _failures(failed: list[tuple[str, str]]) -> dict:
    """The modules that failed, for an answer of bounded size (the first few, and how many)."""
    return {"failed": failed[:FAILED_NAMED], "failed_count": len(failed)}


def _answer(
    sock: socket.socket, req: bytes, agent: int, comm: bytes, nice: tuple[int, int]
) -> bool:
    """Answer one request: import the job's modules (`{"imports": FILE}`, at the warm-up
    priority) or fork a spare; False once this server must not fork any more."""
    try:
        body = json.loads(req)
        heap_bytes = max(0, int(body.get("heap_bytes", 0)))
        imports, prepare = body.get("imports"), bool(body.get("prepare", True))
    except (ValueError, AttributeError, TypeError):
        heap_bytes, imports, prepare = 0, None, True
    if isinstance(imports, str):  # the agent moved this server to the warm-up priority
        warm, base = nice
        before = len(sys.modules)
        failed = import_listed(imports)
        if warm != base:
            run_priority(base)
        threads, new = len(thread_ids()), len(sys.modules) - before
        answer = {"imported": True, "new": new, "threads": threads, **_failures(failed)}
        sock.send(json.dumps(answer).encode())
        return threads == 1
    if len(thread_ids()) != 1:
        sock.send(json.dumps({"error": f"{len(thread_ids())} threads; not forking"}).encode())
        return True
    try:
        pid, w, ready = _fork_spare(sock, agent, comm, heap_bytes, prepare, nice)
    except OSError as exc:
        sock.send(json.dumps({"error": f"fork failed: {exc}"}).encode())
        return True
    try:
        socket.send_fds(sock, [json.dumps({"pid": pid}).encode()], [w, ready])
    finally:
        os.close(w)
        os.close(ready)
    return True


def _fork_spare(
    sock: socket.socket,
    agent: int,
    comm: bytes,
    heap_bytes: int = 0,
    prepare: bool = True,
    nice: tuple[int, int] = (0, 0),
) -> tuple[int, int, int]:
    """Double-fork a spare; (its pid, the write end of its assignment pipe, the read end of its
    ready pipe). In the spare this raises `_Forked`."""
    r, w = os.pipe()
    pr, pw = os.pipe()
    yr, yw = os.pipe()
    try:
        mid = os.fork()
    except OSError:
        for fd in (r, w, pr, pw, yr, yw):
            os.close(fd)
        raise
    if mid == 0:  # the intermediate: fork the spare, report its pid, exit at once
        try:
            pid = os.fork()
        except BaseException:  # noqa: BLE001
            os._exit(1)
        if pid == 0:  # the spare: born at the warm-up priority when it prepares
            for fd in (w, pr, pw, yr):
                os.close(fd)
            sock.close()
            raise _Forked(r, agent, comm, heap_bytes, yw, prepare, nice)
        try:
            if prepare and nice[0] != nice[1]:
                # before anyone knows its pid: the pool's escalation is the last word
                try:
                    warm_priority(nice[0], pid)
                except OSError:
                    pass  # it warms up at the server's priority: the pid must be reported
            os.write(pw, pid.to_bytes(4, "little"))
        finally:
            os._exit(0)
    os.close(pw)
    os.close(r)
    os.close(yw)
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
        os.close(yr)
        raise OSError("the intermediate child did not report the spare's pid")
    return int.from_bytes(data, "little"), w, yr


def own_pages(until: Callable[[], bool] | None = None) -> tuple[int, str | None]:
    """Break copy-on-write on every page of this process's private writable mappings that is
    present (shared with the process it was forked from), and on no other page (populating
    untouched ones would only cost memory); (bytes made private, why not all could be, or
    None). Needs MADV_POPULATE_WRITE (Linux 5.14): without it nothing is done. Stops early
    once `until()` is true (checked per bounded read and per POPULATE_CHUNK pages made
    private: the spare was assigned meanwhile)."""
    try:
        import numpy as np  # torch's own dependency; the fork server imported it with torch
    except ImportError:
        return 0, "numpy is not installed"
    lib = _heap().libc()
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
                if until is not None and until():
                    return done, "assigned before every page was its own"
                n = min(PAGEMAP_CHUNK, (hi - base) // PAGE)
                raw = os.pread(fd, n * 8, (base // PAGE) * 8)
                present = (np.frombuffer(raw, dtype=np.uint64) >> np.uint64(63)).astype(np.int8)
                edges = np.flatnonzero(np.diff(np.concatenate(([0], present, [0]))))
                for first, stop in zip(edges[::2].tolist(), edges[1::2].tolist()):
                    # a run of present pages in bounded slices, so an assignment stops it within
                    # ~1 ms (a 256 MB run took 0.1 s: the replacement's `respawn` at step 1)
                    for start in range(first, stop, POPULATE_CHUNK):
                        if until is not None and until():
                            return done, "assigned before every page was its own"
                        n = min(POPULATE_CHUNK, stop - start)
                        if madvise(base + start * PAGE, n * PAGE, MADV_POPULATE_WRITE) == 0:
                            done += n * PAGE
                        elif why is None:
                            why = os.strerror(ctypes.get_errno())
    finally:
        os.close(fd)
    return done, why


def hold_blas_threads() -> None:
    """In the server, before its imports: numpy's OpenBLAS starts no thread pool (it would start
    one of min(OMP_NUM_THREADS or the CPUs, the CPUs) threads at import, and a server with a
    second thread cannot fork). Only the server's own environment: a spare's job has its own,
    and `blas_threads` gives it a fresh process's pool."""
    os.environ["OPENBLAS_NUM_THREADS"] = "1"


def blas_threads_for(env: dict[str, str], cpus: int) -> int:
    """The OpenBLAS thread count a fresh process with `env` starts with on `cpus` CPUs (its
    rule: the first positive one of OPENBLAS_NUM_THREADS, GOTO_NUM_THREADS, OMP_NUM_THREADS,
    else every CPU; at most the CPUs, at most OPENBLAS_MAX_THREADS)."""
    for name in BLAS_THREAD_ENV:
        try:
            n = int(env.get(name, "").strip() or 0)
        except ValueError:
            continue
        if n > 0:
            return max(1, min(n, cpus, OPENBLAS_MAX_THREADS))
    return max(1, min(cpus, OPENBLAS_MAX_THREADS))


def blas_threads(env: dict[str, str]) -> int | None:
    """In a forked spare, once assigned: numpy's OpenBLAS (held at one thread in the server,
    `hold_blas_threads`) gets the pool a fresh process with the job's `env` has; the count set,
    None when no OpenBLAS is loaded (or its setter is not found)."""
    setter = _openblas_setter()
    if setter is None:
        return None
    n = blas_threads_for(env, len(os.sched_getaffinity(0)))
    setter(n)
    return n


def _openblas_setter():  # -> ctypes function | None
    """OpenBLAS's `set_num_threads` of a library this process has loaded (numpy's bundle)."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            paths = {ln.split()[-1] for ln in f if "openblas" in ln.lower() and "/" in ln}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)  # loaded already: the same handle
        except OSError:
            continue
        for name in OPENBLAS_SETTERS:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.argtypes, fn.restype = [ctypes.c_int], None
                return fn
    return None


def fresh_seeds() -> None:
    """Seed the global generators a fresh process seeds from entropy at import, which a fork
    would otherwise share with the server and every other spare: numpy's and torch's CPU
    generator (`torch.initial_seed()` differs from process to process; torch's CUDA ones are
    left alone: they are seeded when CUDA starts, in the spare). Python's `random` reseeds
    itself after a fork."""
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    torch = sys.modules.get("torch")
    generator = getattr(torch, "default_generator", None) if torch is not None else None
    if generator is not None:
        generator.seed()


def assigned(fd: int) -> bool:
    """Whether the spare's assignment pipe `fd` has something to read (its line, or EOF)."""
    try:
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):
        return True


def become_spare(forked: _Forked) -> None:
    """In a forked spare: own session, wait to be the agent's child, die with it, then read the
    assignment and run the job (returns only by raising or when the job returns)."""
    os.setsid()
    deadline = time.monotonic() + REPARENT_TIMEOUT_S
    while os.getppid() != forked.agent:
        if time.monotonic() > deadline:
            os._exit(1)
        time.sleep(0.0005)
    die_with_parent(forked.agent, new_session=False)
    set_process_name(SPARE_NAME)  # only now: the pool stops only spares that die with it
    fresh_seeds()
    heap, prepared = _heap(), 0
    # idle-time work: a spare forked for a replacement waiting now skips it (its job copies
    # the pages it writes, as a cold process would)
    # a spare taken while it prepares stops preparing: the round waits for it (0.1-0.4 s of
    # preparation on a busy node); what it did not own is copied on first write, as before
    # the preparation (hundreds of MB of page copies and heap faults) at the warm-up priority,
    # as an import is: it ran at the agent's beside the ranks' steps (the first step after a
    # round at step 1 took 0.93 s where a step takes 0.56; the pool escalates it after
    # `idle_limit`, not during a round); back at the agent's priority before the assignment
    warm, base = forked.nice
    if forked.prepare:  # at `warm` since its birth (`_fork_spare`), unless escalated
        own_pages(lambda: assigned(forked.assignment_fd))
        if not assigned(forked.assignment_fd):
            prepared = heap.prepare(forked.heap_bytes)
        if warm != base:
            run_priority(base)
    if forked.ready_fd >= 0:
        try:
            os.write(forked.ready_fd, b"r")  # the pool's `spare-ready`
            os.close(forked.ready_fd)
        except OSError:
            pass
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(forked.assignment_fd, 65536)
        if not chunk:
            break
        line += chunk
    os.close(forked.assignment_fd)
    if not line.strip():
        sys.exit(0)
    set_process_name(forked.comm)  # a rank looks like any worker in `ps`
    job = json.loads(line)
    blas_threads(job["env"])
    if prepared:
        job["env"][heap.ENV] = str(prepared)  # the runtime settles the heap after its repair
    run_job(job)


def main(argv: list[str]) -> None:
    """`FD [--nice WARM,BASE] [--imports FILE]`: serve on socket FD; in each forked
    spare, run its job."""
    nice = parse_nice(argv[argv.index(NICE_FLAG) + 1]) if NICE_FLAG in argv else (0, 0)
    forked = None
    try:
        serve(int(argv[0]), nice, flag_value(argv, IMPORTS_FLAG))
    except _Forked as exc:
        forked = exc
        exc.__traceback__ = None  # drop the server's frames
    if forked is None:
        sys.exit(0)
    # outside the except block: the job must not run "while handling" _Forked (sys.exc_info(),
    # and the context of its own exceptions, as in a fresh `python script`)
    become_spare(forked)


if __name__ == "__main__":
    main(sys.argv[1:])
