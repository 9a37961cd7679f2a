"""Warm spares, the agent's side: the pool of processes that have already imported torch.

Owns: `SparePool`, the agent's pool of warm spares (the processes themselves run
`launcher.workers.spare_process`). It keeps `count` spares per node (`--warm-spares`, default
2, so two faults in a row on one node both get a warm start), started at the first `ensure()`
(the spawner calls it with the workers when the job is known to use `launcher.runtime`:
`launcher.workers.spawner`), hands one out for a process-level replacement (`take`: its
assignment line, JSON: env, argv, cwd, module, nice; a ready spare before one still importing,
and with none idle a spare forked on the spot from a ready fork server) and starts its
successor as soon as the recovery round that used it is over. It records `spare-ready` when
the number of spares ready to take a rank grows (seconds since the job's workers started and
since the pool started; `ready_count`, `first_ready_s`), and it extends the spares' imports
with the job's own modules (`extend_imports`: the fork server imports them, then the idle
spares forked before are replaced). By default (`LaunchConfig.spare_fork`, FTRUN_SPARE_FORK)
the spares are forked from the node's fork server (`launcher.workers.fork_server`, started with
the first fill), so a successor costs a fork (20-50 ms, asked for at one health check and
collected at a later one: the agent's loop never waits for it) instead of a second `import
torch` (1.5-2 CPU-s), and prepares (owns its pages, faults its heap in) at the warm-up
priority; when the server cannot be used the pool says why in one line and starts spares
that import torch themselves (`python -m launcher.workers.spare_process`). The server, or such
a spare, warms up 10 nice levels below the agent and under SCHED_IDLE when it may come back
afterwards (root, or RLIMIT_NICE allows it), so its `import torch` yields the CPU to the
recovery and training; the pool hands it both priorities in its command line. A spare runs the
script at the agent's priority, and returns to it the moment it is assigned, also when it is
taken before its imports finished. The pool moves a spare (or the server) to the agent's
priority itself after `idle_limit` (2 s) of warm-up, except while a recovery round and the step
it resumes at run, and while the job's ranks start (`starting`: until each committed its first
step, the pool's imports take only idle CPU time: SCHED_IDLE, which on a node without idle
CPUs still cost the ranks' first step ~1.8 s, measured; see the user guide):
training that keeps every CPU busy leaves SCHED_IDLE no time, and a spare that never finishes
`import torch` makes the next fault start cold. No spare is started or forked while a round
holds the pool (but for the one `take` forks for the round itself), and the ones still
preparing are stopped until it ends (`launcher.workers.spare_pause`).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from typing import Callable, Union

from launcher.workers.adopted import AdoptedChild, reap_orphans, set_subreaper
from launcher.workers.fork_server import FORK_TIMEOUT_S, ForkServer
from launcher.workers.priority import born_warm, may_return_to, run_priority
from launcher.workers.round_hold import RoundHold
from launcher.workers.spare_pause import SparePause
from launcher.workers.spare_process import IMPORTS_FLAG, READY_FLAG, nice_args
from launcher.workers.spare_vintage import SpareVintage
from launcher.workers.warm_up import WarmUps

SpareProc = Union[subprocess.Popen, AdoptedChild]


WARM_UP_NICE = 10  # the spare's niceness while it imports torch (only if it can return to 0)
# a taken spare runs this many nice levels above the agent until its rank has recovered (only
# where the agent may lower niceness: root, or RLIMIT_NICE): every other rank waits for it
REPAIR_BOOST_NICE = 10
WARM_UP_IDLE_S = (
    2.0  # after this long warming up, a spare goes on at the agent's priority (not while held)
)
REFILL_HOLD_S = 10.0  # a recovery round holds back new spares at most this long
ASSIGN_TIMEOUT_S = 2.0  # a spare takes its assignment line within this long, or is killed
STOP_S = 5.0  # stop(): the spares and the fork server all exit within this long after SIGKILL
SPARE_MODULE = "launcher.workers.spare_process"  # what a spare that imports torch itself runs
Record = Callable[..., None]  # AgentLog.info's shape: (event, message, **fields)


class SparePool:
    """Up to `count` warm spares; owned by the agent (`stop()` at shutdown). The first fill waits
    `start_delay` seconds (out of the job's own start-up); a taken spare's successor starts at
    the next `ensure()`."""

    def __init__(
        self,
        python: str,
        log: Callable[[str], None],
        count: int = 2,
        start_delay: float = 0.0,
        idle_limit: float = WARM_UP_IDLE_S,
        fork: bool = True,
        record: Record | None = None,
    ) -> None:
        if count < 0:
            raise ValueError(f"count {count} must be >= 0")
        self.warm_ups = WarmUps(idle_limit)  # raises ValueError for a negative limit
        self.python = python
        self.log = log
        self.count = count
        self._procs: list[SpareProc] = []
        # spares forked from a warm fork server (launcher.workers.fork_server; False: each
        # spare imports torch itself; LaunchConfig.spare_fork)
        self.fork = fork
        self._server: ForkServer | None = None
        self._not_before = time.monotonic() + start_delay
        self.round_hold = RoundHold()  # a recovery round holds new spares back
        self.pause = SparePause()  # and stops the ones still preparing (`hold`)
        self._boosted: dict[int, tuple[SpareProc, int]] = {}  # rank -> (process, nice after)
        self.heap_bytes = 0  # heap a forked spare faults in: the largest state a rank reported
        self.record = record  # `spare-ready` events (None: no events)
        self.readiness = Readiness()
        self._starting: set[int] = set()  # ranks yet to commit their first step (`starting`)
        self.imports: str | None = None  # the `--imports` file of the job's modules
        self._imports_sent = False  # the fork server was asked to import the file's modules
        self.vintage = SpareVintage()  # idle spares out of date: forked again
        self._answers_seen = 0  # the fork server's answers whose failed imports were said

    def ready(self) -> int:
        """Spares alive now (warm or still warming up)."""
        self._procs = [p for p in self._procs if p.poll() is None]
        self.vintage.keep_only({p.pid for p in self._procs})
        self.pause.keep_only({p.pid for p in self._procs})  # no signal to a pid reused since
        return len(self._procs)

    def ready_count(self) -> int:
        """Spares alive and ready to take a rank now (their imports done)."""
        return len(self._ready_pids())

    def _ready_pids(self) -> set[int]:
        return self.readiness.poll() & {p.pid for p in self._procs if p.poll() is None}

    def starting(self, ranks: set[int], job_start: float) -> None:
        """The job's ranks `ranks` started at `job_start` (monotonic): the pool's imports take
        only idle CPU time (no escalation) until each committed its first step."""
        self._starting = set(ranks)
        self.readiness.job_start = job_start

    def extend_imports(self, path: str) -> None:
        """The `--imports` file at `path` lists more of the job's modules: spares started from
        now on import them, and the fork server imports them at the next `ensure()` (then the
        idle spares it forked before are replaced)."""
        self.imports = path
        self._imports_sent = False

    def available(self) -> bool:
        """Whether `take(fork_now=True)` would hand out a ready spare now (an idle one whose
        imports are done, or one forked on the spot from a ready fork server)."""
        if self.ready_count():
            return True
        return self._server_ready()

    def hurry(self) -> None:
        """A replacement is starting cold: the fork server (or a spare) still importing goes on
        at the agent's priority now, round or not (the round waits for that import anyway, and
        a spare ready first overtakes it); the spares a round paused go on too."""
        self.pause.hurry()
        self.warm_ups.hurry(self._procs + ([self._server.proc] if self._server else []))

    def _server_ready(self) -> bool:
        try:
            return self._server is not None and self._server.poll_ready()
        except OSError:
            return False

    def hold(self, generation: int, ranks: set[int], timeout: float = REFILL_HOLD_S) -> None:
        """A recovery round of `generation` runs here with `ranks`: no spare starts or leaves its
        warm-up priority, and the ones still preparing stop (`spare_pause`), until they finished
        it and committed the step they resumed at or `timeout` s passed (`round_hold`)."""
        self.round_hold.hold(generation, ranks, timeout)
        preparing = {p.pid for p in self._procs} - self.readiness.poll()
        if self.held() and (paused := self.pause.hold_begins(preparing)):
            self.log(f"spare(s) still preparing paused for the round: pids {paused}")

    def recovered(self, rank: int, generation: int, resume_step: int | None = None) -> None:
        """Rank `rank` finished the recovery round of `generation` (or a later one; see
        `RoundHold.recovered`). A spare that replaced it returns to the agent's priority."""
        boosted = self._boosted.pop(rank, None)
        if boosted is not None and boosted[0].poll() is None:
            run_priority(boosted[1], boosted[0].pid)
        self.round_hold.recovered(rank, generation, resume_step)

    def heap_needed(self, nbytes: int) -> None:
        """A rank needed `nbytes` of heap in its first step (its state, model, gradient buckets,
        a framework's buffers): spares forked from now on fault in that much heap (the largest
        size reported; `launcher.runtime.heap`), idle ones with too little are forked again."""
        if int(nbytes) > self.heap_bytes:
            self.heap_bytes = int(nbytes)
            self.vintage.heap_needed({p.pid for p in self._procs}, self.heap_bytes)

    def progressed(self, rank: int, committed_step: int) -> None:
        """Rank `rank` reports its last committed step."""
        if committed_step >= 0:
            self._starting.discard(rank)
        self.round_hold.progressed(rank, committed_step)

    def held(self) -> bool:
        return self.round_hold.held()

    def ensure(self, env: dict[str, str]) -> None:
        """Start spares until `count` are alive (once the start delay has passed, and not while
        a recovery round holds them back); spares warming up for `idle_limit` s go on at the
        agent's priority (not while held, nor while the ranks start)."""
        if time.monotonic() < self._not_before or self.count == 0:
            return
        if self.pause.paused and not self.held():
            self.log(f"paused spare(s) go on, the round is over: pids {self.pause.release()}")
        if self.held() and (late := self.pause.pause_waiting(self.readiness.poll())):
            self.log(f"spare(s) still preparing paused for the round: pids {late}")
        for pid, code in reap_orphans() if self._server is not None else []:
            self.log(f"reaped orphan pid {pid} (exit {code})")
        if not (self.fork and self._fork_spares(env)) and not self.held():
            while self.ready() < self.count:
                self._start(env)
            self._escalate(self._procs)
        self._note_ready()

    def _note_ready(self) -> None:
        """Record `spare-ready` when more spares are ready to take a rank than before."""
        ready = self._ready_pids()
        older = len(ready & self.vintage.old())  # serve until as many fresh ones are ready
        fields = self.readiness.grew(len(ready) - older, older)
        if fields is not None and self.record is not None:
            line = _ready_line(len(ready) - older, older, self.count, fields)
            self.record(
                "spare-ready", line, ready=len(ready), older=older, count=self.count, **fields
            )

    def _fork_spares(self, env: dict[str, str]) -> bool:
        """Spares from the fork server (started at the first fill; neither started nor forking
        while held): True when it serves or is still warming up, False when the pool must start
        spares itself (the server is off, gone or unsafe to fork; said in one line)."""
        try:
            if self._server is None:
                if self.held():
                    return True
                self._start_server(env)
            assert self._server is not None
            if not self._server.poll_ready():
                if not self.held():  # same escalation as a spare that imports torch itself
                    self._escalate([self._server.proc])
                return True
            self._say_failed_imports()
            self._collect_fork(0.0)  # the spare asked for at an earlier check, if forked by now
            # a fork costs 20-50 ms of CPU and page-table copies: not beside a round
            if self.held():
                return True
            self._escalate(self._procs)  # a spare preparing, at the warm-up priority, as an import
            self._retire_stale()
            # stale ones serve meanwhile; one fork asked for per check, its answer read at a later
            # one: the agent's loop never waits for a fork (a worker's exit used to wait with it)
            if self._server.pending is not None:
                return True
            old = self.vintage.old()
            fresh = self.ready() - sum(p.pid in old for p in self._procs)
            # spares first (one without the job's modules beats none), unless `count` ready
            # ones serve: then a fork before the server's imports would be out of date at once
            first = fresh >= self.count or len(self._ready_pids()) >= self.count
            if not (first and self._extend_server()) and fresh < self.count:
                self._server.request_fork(self.heap_bytes)
            return True
        except (OSError, ValueError) as exc:
            self.log(f"spare fork server unusable ({exc}); warm spares import torch themselves")
            self.fork = False
            self._stop_server()
            return False

    def _start_server(self, env: dict[str, str], urgent: bool = False) -> None:
        """`urgent`: the job's ranks wait for it (`serve_ranks`): at the agent's priority."""
        base = os.getpriority(os.PRIO_PROCESS, 0)
        warm = min(19, base + WARM_UP_NICE) if may_return_to(base) else base
        self._server = ForkServer(self.python, env, (warm, base), self.imports, urgent)
        self._imports_sent = True  # its start-up imports the file as it is now
        idle = warm != base and not urgent
        self.warm_ups.add(self._server.proc.pid, base if idle else None)
        self.readiness.pool_started()
        self.log(_server_line(self._server.proc.pid, urgent, bool(self.imports)))

    def serve_ranks(self, env: dict[str, str], timeout: float) -> str | None:
        """Have the fork server ready to fork the job's ranks (`fork_rank`) within `timeout` s:
        started now at the agent's priority (the ranks wait for its imports), or hurried. None
        once it is ready, else why not (the ranks start cold; a server that failed is given up
        and the spares import torch themselves, as in `ensure`)."""
        if not self.fork:
            return "the spare fork server is off"
        try:
            if self._server is None:
                self._start_server(env, urgent=True)
            self.hurry()  # one started at the first hello may still warm up, or import more
            assert self._server is not None
            if not self._server.wait_ready(timeout):
                return f"the spare fork server was not ready within {timeout:g} s"
            self._say_failed_imports()
            return None
        except (OSError, ValueError) as exc:
            self.fork = False
            self._stop_server()
            return f"the spare fork server is unusable ({exc}); warm spares import torch themselves"

    def fork_rank(self, env: dict[str, str], argv: list[str], module: bool) -> SpareProc | None:
        """One of the job's ranks started from the ready fork server (`serve_ranks`; see
        `fork_and_assign`), `env` exactly (no `exec` mark: a first start), at the agent's
        priority; None when the server cannot (said in one line: that rank starts cold)."""
        if not self._server_ready():
            return None
        assert self._server is not None
        try:
            self._collect_fork(FORK_TIMEOUT_S)  # a spare asked for before is answered first
        except (OSError, ValueError) as exc:
            self.log(f"spare fork server could not fork a spare ({exc})")
        return fork_and_assign(self._server, assignment(env, argv, module, None, False), self.log)

    def _collect_fork(self, timeout: float) -> SpareProc | None:
        """The spare of the server's outstanding fork request, added to the pool, once
        answered within `timeout` s (0: never blocks); raises OSError as `collect_fork`."""
        server = self._server
        if server is None or server.pending is None:
            return None
        asked, heap_bytes = server.pending, server.pending_heap
        got = server.collect_fork(timeout)
        if got is None:
            return None
        self._add_forked(got[0], got[1], asked, heap_bytes)
        return got[0]

    def _add_forked(self, proc: SpareProc, ready_fd: int, asked: float, heap_bytes: int) -> None:
        """A forked spare prepares at the warm-up priority (`spare_server.become_spare`) and is
        escalated as a warm-up after `idle_limit` (`_escalate`)."""
        self._procs.append(proc)
        paused = self.held() and self.pause.pause({proc.pid})  # `take` continues it
        self.vintage.forked(proc.pid, heap_bytes)
        self.readiness.watch(proc.pid, ready_fd)
        base = os.getpriority(os.PRIO_PROCESS, 0)
        idle = may_return_to(base) and base < 19  # as the server's warm-up niceness
        self.warm_ups.add(proc.pid, base if idle else None)
        line = _forked_line(proc.pid, asked, heap_bytes, len(self._procs), self.count)
        self.log(line + ("; paused until the round ends" if paused else ""))

    def _extend_server(self) -> bool:
        """Ask the ready server to import the job's modules listed since it started: True when
        it is busy with them now (the idle spares forked before are replaced once it is done:
        they serve until then)."""
        server = self._server
        if server is None or self.imports is None or self._imports_sent:
            return False
        server.extend(self.imports)
        self._imports_sent = True
        self.vintage.imports_added({p.pid for p in self._procs})
        base = os.getpriority(os.PRIO_PROCESS, 0)
        if may_return_to(base) and base + WARM_UP_NICE <= 19:  # escalated as in its warm-up
            self.warm_ups.add(server.proc.pid, base)
        self.log(f"spare fork server imports the job's modules ({self.imports})")
        return True

    def _say_failed_imports(self) -> None:
        server = self._server
        if server is not None and server.answers != self._answers_seen:
            self._answers_seen = server.answers
            if server.failed_count:
                self.log(failed_imports_line(server.failed_count, server.failed))

    def _retire_stale(self) -> None:
        """Out-of-date idle spares make way for fresh forks once as many fresh ones are ready."""
        if self._server is None or not self._server.new_modules:
            self.vintage.no_new_modules()
        alive = [p.pid for p in self._procs]
        old = self.vintage.retire(alive, self.readiness.poll(), self.count)
        if old:
            stale = [p for p in self._procs if p.pid in old]
            self._procs = [p for p in self._procs if p.pid not in old]
            _kill_idle(stale, self.warm_ups, self.log)

    def _stop_server(self, timeout: float = STOP_S) -> None:
        server, self._server = self._server, None
        if server is not None:
            self.warm_ups.pop(server.proc.pid)
            server.stop(self.log, timeout)
            set_subreaper(False)
            reap_orphans()

    def _escalate(self, procs: list) -> None:
        """After `idle_limit` s of warm-up a process goes on at the agent's priority (not while
        the ranks start: their own start-up first; `launcher.workers.warm_up`)."""
        if not self._starting:
            self.warm_ups.escalate(procs)

    def _start(self, env: dict[str, str]) -> None:
        base = os.getpriority(os.PRIO_PROCESS, 0)
        warm = min(19, base + WARM_UP_NICE) if may_return_to(base) else base
        proc, ready_r = start_importing_spare(self.python, env, (warm, base), self.imports)
        self._procs.append(proc)
        self.readiness.watch(proc.pid, ready_r)
        self.readiness.pool_started()
        self.warm_ups.add(proc.pid, base if warm != base else None)
        self.log(f"warm spare started (pid {proc.pid}; {len(self._procs)} of {self.count})")

    def take(
        self, env: dict[str, str], argv: list[str], module: bool, fork_now: bool = False
    ) -> SpareProc | None:
        """Hand a live spare its assignment (a ready one first, the oldest first; one still
        warming up stops that once assigned; with none idle and `fork_now`, one forked now from
        a ready fork server, also while a round holds the pool: the round needs it); None when
        no spare is available. A spare that does not take the line within ASSIGN_TIMEOUT_S (its
        pipe full: stopped, or starved) is killed and the next one is tried, so the loop never
        blocks on a spare."""
        base = os.getpriority(os.PRIO_PROCESS, 0)
        boost = max(-20, base - REPAIR_BOOST_NICE)
        nice = boost if boost < base and may_return_to(boost) else None
        line = assignment(env, argv, module, nice)
        warm = self.readiness.poll()  # stable sort: the oldest ready fresh one first
        old = self.vintage.old()
        self._procs.sort(key=lambda p: (p.pid not in warm, p.pid in old))
        forked = False  # at most one spare forked on the spot per take
        while True:
            if self._procs:
                proc: SpareProc | None = self._procs.pop(0)
            elif fork_now and not forked and self.count and self._server_ready():
                proc, forked = self._fork_on_demand(), True
            else:
                return None
            if proc is None:
                return None
            born = self.warm_ups.pop(proc.pid)
            self.readiness.forget(proc.pid)
            self.vintage.forget(proc.pid)
            self.pause.resume(proc.pid)
            if proc.poll() is not None or proc.stdin is None:
                continue
            if born is not None and proc.pid not in warm:
                run_priority(born, proc.pid)  # still at idle priority: it must read its line now
            err = _assign(proc, line, ASSIGN_TIMEOUT_S)
            if err is not None:
                self.log(f"warm spare pid {proc.pid} not used ({err}); killed")
                proc.kill()
                _wait(proc, self.log, STOP_S)
                continue
            if nice is not None and "RANK" in env:
                self._boosted[int(env["RANK"])] = (proc, base)
            self._note_ready()  # one fewer ready: its successor's readiness is news again
            return proc

    def _fork_on_demand(self) -> SpareProc | None:
        """A spare forked for a replacement that found none idle (no heap faulted in first: the
        replacement's state arrives into fresh pages, as a cold one's would); one asked for
        at a health check and not yet answered is that spare (its answer is the nearer)."""
        try:
            proc = self._collect_fork(FORK_TIMEOUT_S)  # asked for before: answered first
            if proc is None:
                assert self._server is not None
                t0 = time.monotonic()
                proc, ready_fd = self._server.fork(prepare=False)
                self._add_forked(proc, ready_fd, t0, 0)
        except (OSError, ValueError) as exc:
            self.log(f"spare fork server could not fork a spare now ({exc})")
            return None
        self._procs.remove(proc)
        return proc

    def stop(self) -> None:
        """Kill the idle spares and the fork server at once; all of them get STOP_S in total to
        exit (the ones still there then are named and left behind), so the pool's stop fits in
        the agent's shutdown bound (launcher.agent.agent.STOP_TOGETHER_S)."""
        procs, self._procs = self._procs, []
        self.pause.keep_only(set())  # all killed below
        for proc in procs:
            proc.kill()  # idle: nothing to lose
        if self._server is not None:
            self._server.proc.kill()
        deadline = time.monotonic() + STOP_S
        for proc in procs:
            _wait(proc, self.log, max(0.0, deadline - time.monotonic()))
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        self._stop_server(max(0.0, deadline - time.monotonic()))
        self.warm_ups.clear()
        self.readiness.close()


class Readiness:
    """Which spares are ready to take a rank (each writes one byte to its ready pipe: a forked
    one once it owns its pages and faulted its heap in, one that imports torch itself once its
    imports are done), and when the ready count first grew, for `spare-ready`. Owned by one
    `SparePool`."""

    def __init__(self) -> None:
        self.job_start: float | None = None  # monotonic: the job's workers started
        self.pool_start: float | None = None  # monotonic: the pool started its first process
        self.first_ready_s: float | None = None  # since the job (else the pool) started
        self._warm: set[int] = set()
        self._fds: dict[int, int] = {}  # pid -> read end of its ready pipe
        self._shown = (0, 0)  # (fresh, older) spares ready as last seen

    def pool_started(self) -> None:
        if self.pool_start is None:
            self.pool_start = time.monotonic()

    def watch(self, pid: int, fd: int) -> None:
        os.set_blocking(fd, False)
        self._fds[pid] = fd

    def forget(self, pid: int) -> None:
        self._warm.discard(pid)
        fd = self._fds.pop(pid, None)
        if fd is not None:
            os.close(fd)

    def poll(self) -> set[int]:
        """The pids ready now (reads the ready pipes without blocking)."""
        for pid, fd in list(self._fds.items()):
            try:
                got = os.read(fd, 1)
            except BlockingIOError:
                continue
            except OSError:
                got = b""
            if got:
                self._warm.add(pid)
            self._fds.pop(pid)
            os.close(fd)
        return set(self._warm)

    def grew(self, fresh: int, older: int = 0) -> dict | None:
        """The fields of a `spare-ready` record when more fresh spares are ready than the last
        record said, or as many and more spares in all (older ones serving until fresh ones
        are ready); else None. A count that fell (a spare taken, the older ones retired) is
        remembered, so the next growth is said again."""
        news = fresh > self._shown[0] or (
            fresh == self._shown[0] and fresh + older > sum(self._shown)
        )
        self._shown = (fresh, older)
        if not news:
            return None
        now = time.monotonic()
        since_pool = now - (self.pool_start or now)
        since_job = now - (self.job_start if self.job_start is not None else self.pool_start or now)
        if self.first_ready_s is None:
            self.first_ready_s = round(since_job, 3)
        return {"since_job_s": round(since_job, 3), "since_pool_s": round(since_pool, 3)}

    def close(self) -> None:
        for pid in list(self._fds):
            self.forget(pid)
        self._warm.clear()


def _server_line(pid: int, urgent: bool, job_modules: bool) -> str:
    """The line of the fork server's start (`urgent`: the job's ranks are forked from it)."""
    return (
        f"spare fork server started (pid {pid}"
        + ("; at the agent's priority: the job's ranks are forked from it" if urgent else "")
        + "); spares are forked from it once it has imported torch"
        + (" and the job's modules" if job_modules else "")
    )


def _forked_line(pid: int, asked: float, heap_bytes: int, alive: int, count: int) -> str:
    """The line of a spare forked for the pool (`asked`: monotonic time of the request)."""
    return (
        f"warm spare started (pid {pid}, forked in "
        f"{(time.monotonic() - asked) * 1e3:.1f} ms since it was asked for; "
        + (f"prepares {heap_bytes / 1e6:.1f} MB of heap; " if heap_bytes else "")
        + f"{alive} of {count})"
    )


def _ready_line(fresh: int, older: int, count: int, fields: dict) -> str:
    """The `spare-ready` line: fresh spares of `count`, the older ones serving until then."""
    return (
        f"{fresh} of {count} warm spare(s) ready"
        + (f" (and {older} older one(s) serving until then)" if older else "")
        + f", {fields['since_job_s']:.2f} s after the workers started "
        f"({fields['since_pool_s']:.2f} s after the pool started)"
    )


def fork_and_assign(
    server: ForkServer, line: bytes, log: Callable[[str], None]
) -> SpareProc | None:
    """A process forked now from the ready `server`, without a spare's idle-time preparation
    (it runs at once), given its assignment `line`; None when that fails (said in one line)."""
    try:
        proc, ready_fd = server.fork(prepare=False)
    except (OSError, ValueError) as exc:
        log(f"spare fork server could not fork a rank's process ({exc})")
        return None
    os.close(ready_fd)  # no spare-ready: it is a rank already
    err = _assign(proc, line, ASSIGN_TIMEOUT_S)
    if err is None:
        return proc
    log(f"forked process pid {proc.pid} not used for a rank ({err}); killed")
    proc.kill()
    _wait(proc, log, STOP_S)
    return None


def assignment(
    env: dict[str, str], argv: list[str], module: bool, nice: int | None, exec_mark: bool = True
) -> bytes:
    """A spare's assignment line (`launcher.workers.spare_process.run_job` reads it): the rank's
    environment, argv, working directory, module mode, niceness to run at (None: as it is) and
    whether to mark the time it began (`FTRUN_EXEC_TIME`: a replacement's `exec` mark)."""
    job = {"env": env, "argv": argv, "cwd": os.getcwd(), "module": module, "nice": nice}
    if not exec_mark:
        job["exec_mark"] = False
    return (json.dumps(job) + "\n").encode()


def start_importing_spare(
    python: str, env: dict[str, str], nice: tuple[int, int], imports: str | None
) -> tuple[subprocess.Popen, int]:
    """A spare that imports torch itself (`python -u -m SPARE_MODULE`, warming up at `nice`'s
    WARM, then BASE), dying with this process; (its process, the read end of its ready pipe)."""
    parent = os.getpid()
    ready_r, ready_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [
                python,
                "-u",
                "-m",
                SPARE_MODULE,
                *nice_args(*nice),
                *([IMPORTS_FLAG, imports] if imports else []),
                READY_FLAG,
                str(ready_w),
            ],
            env=env,
            stdin=subprocess.PIPE,
            stdout=None,
            stderr=None,
            pass_fds=[ready_w],
            preexec_fn=born_warm(parent, nice),
            close_fds=True,
        )
    except BaseException:
        os.close(ready_r)
        raise
    finally:
        os.close(ready_w)
    return proc, ready_r


def failed_imports_line(count: int, failed: list[list[str]]) -> str:
    """One line naming the job's modules the fork server could not import (skipped)."""
    named = "; ".join(f"{n} ({why})" for n, why in failed[:5])
    return (
        f"spare fork server: {count} of the job's modules not imported (skipped; a "
        f"replacement imports them itself): {named}"
    )


def _kill_idle(procs: list[SpareProc], warm_ups: WarmUps, log: Callable[[str], None]) -> None:
    """Kill idle spares (nothing to lose) and wait for each."""
    for proc in procs:
        warm_ups.pop(proc.pid)
        proc.kill()
        _wait(proc, log, STOP_S)


def _wait(proc: SpareProc, log: Callable[[str], None], timeout: float) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:  # D-state after SIGKILL, or starved of CPU
        log(
            f"warm spare pid {proc.pid} did not exit within {timeout:.1f} s of SIGKILL; left behind"
        )


def _assign(proc: SpareProc, data: bytes, timeout: float) -> str | None:
    """Write a spare's assignment line and close its stdin within `timeout` s; None, or why not.
    A pipe holds 64 KiB: a longer line (a large environment) needs the spare to read it."""
    f = proc.stdin
    assert f is not None
    try:
        f.flush()
        fd = f.fileno()
        os.set_blocking(fd, False)
        deadline = time.monotonic() + timeout
        view = memoryview(data)
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                return (
                    f"it took {len(data) - len(view)} of the {len(data)} bytes of its "
                    f"assignment in {timeout:g} s"
                )
            if not select.select([], [fd], [], left)[1]:
                continue
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                continue
        return None
    except OSError as exc:
        return str(exc) or type(exc).__name__
    finally:
        try:
            f.close()
        except OSError:
            pass
