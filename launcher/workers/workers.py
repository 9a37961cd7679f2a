"""Worker processes of one node: one handle per rank, event-driven exit detection, clean stops.

Owns: spawning a worker (`python -u script args`) in its own session with
`PR_SET_PDEATHSIG(SIGKILL)` so it dies with its agent, its output plumbing (inherit, redirect to
files, or tee through an `OutputPump`), stopping it (signal to the whole process group, grace,
SIGKILL), and `Reaper`: one thread that learns of every exit the moment it happens through
pidfds, kills what the exited worker left in its process group (`sweep_group`) and reports
`WorkerExit` events on a queue, and `NodeWorkers`, the node's table of ranks
(one `Worker` per local rank, kept across respawns, and which of them use launcher.runtime).
Single ranks can be stopped and respawned without touching the others.
"""

from __future__ import annotations

import os
import queue
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from launcher.observe.logs import OutputPump
from launcher.workers.adopted import AdoptedChild
from launcher.workers.prctl import die_with_parent


@dataclass
class WorkerExit:
    """A worker process ended. `code` follows Popen: negative = killed by that signal."""

    local_rank: int
    rank: int
    pid: int
    code: int
    time: float
    generation: int
    early: bool = False  # seen through its death notice, before the kernel tore it down


def signal_name(code: int) -> str | None:
    if code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"SIG{-code}"


@dataclass
class Worker:
    """One rank's current process (a rank keeps its Worker object across respawns)."""

    local_rank: int
    rank: int
    generation: int = 0
    proc: subprocess.Popen | AdoptedChild | None = None  # AdoptedChild: a forked warm spare
    pumps: list[OutputPump] = field(default_factory=list)
    error_file: str = ""
    started: float = 0.0
    exit_code: int | None = None
    exited_at: float = 0.0
    stopping: bool = False  # the agent is stopping it: its exit is not a failure
    spawns: int = 0
    said_bye: bool = False  # its runtime said goodbye (rt.finish()): done with the job
    hung_at_exit: bool = False  # killed by ftrun: silent past the hang limit after its goodbye
    notice: str = ""  # its process's FTRUN_DEATH_NOTICE slot ("" without one)

    def attach(self, proc: subprocess.Popen | AdoptedChild) -> None:
        """Make `proc` this rank's current process (a fresh spawn or a warm spare)."""
        self.proc = proc
        self.exit_code = None
        self.stopping = False
        self.said_bye = False
        self.hung_at_exit = False
        self.started = time.time()
        self.spawns += 1
        self.pumps = []

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.exit_code is None

    @property
    def ended_after_goodbye(self) -> bool:
        """Its process ended with a signal after its runtime said goodbye (`rt.finish()`, which
        is called last): killed by ftrun for hanging at exit, or a crash in the interpreter's
        teardown (torch 2.13's gloo teardown sometimes aborts: "terminate called without an
        active exception"). Its work for the job was done."""
        return self.exit_code is not None and (
            self.hung_at_exit or (self.said_bye and self.exit_code < 0)
        )

    @property
    def finished(self) -> bool:
        """Its current process is done with the job: said goodbye, or exited 0 unasked."""
        return (
            self.proc is not None and not self.stopping and (self.said_bye or self.exit_code == 0)
        )


@dataclass
class NodeWorkers:
    """This node's ranks: one Worker per local rank, and the ranks that use launcher.runtime
    (they said hello on the worker channel since their last (re)spawn)."""

    by_local: dict[int, Worker]
    aware: set[int] = field(default_factory=set)
    # ranks a live shrink (elastic-training) took out of the world: done with the job
    left: set[int] = field(default_factory=set)

    @classmethod
    def create(cls, rank_base: int, nproc: int) -> "NodeWorkers":
        return cls({lr: Worker(local_rank=lr, rank=rank_base + lr) for lr in range(nproc)})

    def all(self) -> list[Worker]:
        return list(self.by_local.values())

    def alive(self) -> list[Worker]:
        return [w for w in self.by_local.values() if w.alive]

    def by_rank(self, rank: int) -> Worker | None:
        return next((w for w in self.by_local.values() if w.rank == rank), None)

    def of_ranks(self, ranks: list[int]) -> list[Worker]:
        return [w for w in self.by_local.values() if w.rank in ranks]

    def finished(self) -> list[int]:
        """The ranks whose current process is done with the job (`Worker.finished`)."""
        return sorted(w.rank for w in self.by_local.values() if w.finished)

    def all_succeeded(self) -> bool:
        """Every rank's process has exited 0, or ended at exit after its goodbye: killed by
        ftrun for hanging there (see `HangGuard`) or died of a signal in its teardown
        (`Worker.ended_after_goodbye`); either way its work for the job was done."""
        return all(
            w.exit_code == 0 or w.ended_after_goodbye or w.rank in self.left
            for w in self.by_local.values()
        )


def spawn(
    worker: Worker,
    cmd: list[str],
    env: dict[str, str],
    stdout_path: str | None,
    stderr_path: str | None,
    tee_out: bool,
    tee_err: bool,
    prefix: str,
    console_lock: threading.Lock,
    filters: tuple[list[str], list[str]] = ([], []),
    filtered: tuple[str | None, str | None] = (None, None),
) -> None:
    """Start `cmd` for `worker`. Output: inherited when neither a file nor tee is asked for."""

    def target(path: str | None, tee: bool) -> int | None:
        if tee:
            return subprocess.PIPE
        if path:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        return None

    out_t, err_t = target(stdout_path, tee_out), target(stderr_path, tee_err)
    parent = os.getpid()
    try:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=out_t,
            stderr=err_t,
            stdin=subprocess.DEVNULL,
            preexec_fn=lambda: die_with_parent(parent),
            close_fds=True,
        )
    finally:
        for t in (out_t, err_t):
            if isinstance(t, int) and t >= 0:
                os.close(t)
    worker.attach(proc)
    tees = (
        (tee_out, proc.stdout, stdout_path, sys.stdout),
        (tee_err, proc.stderr, stderr_path, sys.stderr),
    )
    for i, (tee, pipe, path, console) in enumerate(tees):  # stdout, then stderr
        if tee:
            assert pipe is not None
            worker.pumps.append(
                OutputPump(
                    pipe, path, console, prefix, filters[i], filtered[i], console_lock=console_lock
                )
            )


def send_signal(worker: Worker, sig: int) -> None:
    """Signal the worker's whole process group (its session), ignoring already-gone ones."""
    if worker.proc is None:
        return
    try:
        os.killpg(worker.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            worker.proc.send_signal(sig)
        except (ProcessLookupError, OSError):
            pass


def sweep_group(pid: int) -> None:
    """SIGKILL whatever a worker that has exited (`pid`, a session leader) left in its process
    group: its children and their children, unless they started sessions of their own (torchrun
    kills the same group when it closes a worker). Call it before the worker is reaped."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Reaper:
    """Reports worker exits as they happen (pidfd readiness), on `events` as WorkerExit.

    Owned by the agent: `stop()` ends the thread. `watch(worker)` after each spawn. `settle(pid)`
    (the death-notice board's) is called before an exit seen by its pidfd is reported, so that a
    death notice already on its way is reported as one (`announce`)."""

    def __init__(
        self, events: "queue.Queue[object]", settle: Callable[[int], None] | None = None
    ) -> None:
        self.events = events
        self._settle = settle
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._pending: "queue.Queue[Worker]" = queue.Queue()
        self._announced: set[int] = set()  # pids whose exit `announce` reported already
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftrun-reaper", daemon=True)
        self._thread.start()

    def watch(self, worker: Worker) -> None:
        self._pending.put(worker)
        os.write(self._wake_w, b"x")

    def _register(self, worker: Worker) -> None:
        proc = worker.proc
        assert proc is not None
        try:
            fd = os.pidfd_open(proc.pid)
        except ProcessLookupError:
            self._reap(worker, proc, None)
            return
        self._sel.register(fd, selectors.EVENT_READ, (worker, proc))

    def announce(self, worker: Worker, proc: subprocess.Popen | AdoptedChild, code: int) -> None:
        """`proc` is dying with `code` (its death notice, `launcher.protocol.death_notice`):
        report its exit now, on any thread; when its pidfd turns readable it is only reaped."""
        with self._lock:
            if proc.pid in self._announced or proc.returncode is not None:
                return
            self._announced.add(proc.pid)
        sweep_group(proc.pid)  # not reaped yet: its pid (= its group's id) cannot be reused
        self._report(worker, proc, code, early=True)

    def _reap(self, worker: Worker, proc: subprocess.Popen | AdoptedChild, fd: int | None) -> None:
        if fd is not None:
            self._sel.unregister(fd)
            os.close(fd)
        if proc.returncode is None:  # still a zombie: its pid (= its group's id) cannot be reused
            if self._settle is not None:
                self._settle(proc.pid)
            sweep_group(proc.pid)
        code = proc.wait()
        with self._lock:
            if proc.pid in self._announced:
                self._announced.discard(proc.pid)
                return
        self._report(worker, proc, code, early=False)

    def _report(
        self, worker: Worker, proc: subprocess.Popen | AdoptedChild, code: int, early: bool
    ) -> None:
        now = time.time()
        if worker.proc is proc:
            worker.exit_code = code
            worker.exited_at = now
        self.events.put(
            WorkerExit(
                worker.local_rank, worker.rank, proc.pid, code, now, worker.generation, early
            )
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=1.0):
                if key.data is None:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    while True:
                        try:
                            self._register(self._pending.get_nowait())
                        except queue.Empty:
                            break
                else:
                    worker, proc = key.data
                    self._reap(worker, proc, key.fd)

    def stop(self) -> None:
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join(5.0)
        for key in list(self._sel.get_map().values()):
            if key.data is not None:
                os.close(key.fd)
        self._sel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


def stop_workers(workers: list[Worker], sig: int, grace: float) -> None:
    """Signal every live worker's process group, wait up to `grace` s, then SIGKILL the rest.

    Exits are still reported by the Reaper; this only waits for them to happen."""
    live = [w for w in workers if w.alive]
    for w in live:
        w.stopping = True
        send_signal(w, sig)
    deadline = time.monotonic() + grace
    for w in live:
        assert w.proc is not None
        try:
            w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            send_signal(w, signal.SIGKILL)
    for w in live:
        assert w.proc is not None
        try:
            w.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - D-state: abandon with a note
            pass
        for p in w.pumps:
            p.stop(2.0)
