"""Warm spares: a worker process that has already imported torch, waiting to replace a rank.

Owns: both ends of a spare. `python -m launcher.workers.spare` is the spare itself: it imports torch and
the runtime (the 1-3 s a cold replacement spends before it can do anything), then blocks on its
stdin for one assignment line (JSON: env, argv, cwd, module) and runs the training script in
this very process with `runpy` (`run_job`), exactly as `python -u script args` would. EOF on
stdin means "not needed": it exits 0. `python -m launcher.workers.spare --fork-server FD` is the node's
spare fork server instead (`launcher.workers.zygote`): it imports once and forks spares that behave the
same way. `SparePool` is the agent's side: it keeps `count` spares per node (`--warm-spares`,
default 2, so two faults in a row on one node both get a warm start), started only once the job
is known to use `launcher.runtime`, hands one out for a process-level replacement and starts its
successor as soon as the recovery round that used it is over. By default the spares are forked
from the fork server (started with the first fill; `FTRUN_SPARE_FORK=0` turns it off), so a
successor costs a fork (20-50 ms) instead of a second `import torch` (1.5-2 CPU-s); when the
server cannot be used the pool says why in one line and starts spares that import torch
themselves. The server, or such a spare, warms up 10 nice levels below the agent and under
SCHED_IDLE when it may come back afterwards (root, or RLIMIT_NICE allows it), so its
`import torch` yields the CPU to the recovery and training; a spare runs the script at the
agent's priority, and returns to it the moment it is assigned (its stdin is read on a thread
during the imports), also when it is taken before its imports finished. The pool moves a spare
(or the server) to the agent's priority itself after `idle_limit` (2 s) of warm-up, except while
a recovery round and the step it resumes at run: training that keeps every CPU busy leaves
SCHED_IDLE no time, and a spare that never finishes `import torch` makes the next fault start
cold. No spare is started or forked while a round holds the pool.
"""

from __future__ import annotations

import gc
import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable, Union

from launcher.workers.adopted import AdoptedChild, reap_orphans, set_subreaper
from launcher.workers.workers import _child_setup

if TYPE_CHECKING:
    from launcher.workers.zygote import ForkServer

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


class SparePool:
    """Up to `count` warm spares; owned by the agent (`stop()` at shutdown). The first fill waits
    `start_delay` seconds (out of the job's own start-up); a taken spare's successor starts at
    the next `ensure()`."""

    def __init__(
        self,
        python: str,
        log: Callable[[str], None],
        count: int = 2,
        start_delay: float = 5.0,
        idle_limit: float = WARM_UP_IDLE_S,
        fork: bool | None = None,
    ) -> None:
        if count < 0:
            raise ValueError(f"count {count} must be >= 0")
        if idle_limit < 0:
            raise ValueError(f"idle_limit {idle_limit} must be >= 0")
        self.idle_limit = idle_limit
        self.python = python
        self.log = log
        self.count = count
        self._procs: list[SpareProc] = []
        # spares forked from a warm fork server (launcher.workers.zygote); FTRUN_SPARE_FORK=0: off
        self.fork = os.environ.get("FTRUN_SPARE_FORK", "1") != "0" if fork is None else fork
        self._server: "ForkServer | None" = None
        # pid -> (start time, the agent's niceness to return to after idle_limit; None: done)
        self._born: dict[int, tuple[float, int | None]] = {}
        self._not_before = time.monotonic() + start_delay
        self._hold: tuple[int, set[int], float] | None = None  # (generation, ranks, until)
        self._resume: dict[int, int] = {}  # held rank -> the step it must commit to count as done
        self._boosted: dict[
            int, tuple[SpareProc, int]
        ] = {}  # rank -> (its process, nice to return to)
        # heap a forked spare faults in while it waits: the largest state a rank reported
        self.heap_bytes = 0

    def ready(self) -> int:
        """Spares alive now (warm or still warming up)."""
        self._procs = [p for p in self._procs if p.poll() is None]
        return len(self._procs)

    def hold(self, generation: int, ranks: set[int], timeout: float = REFILL_HOLD_S) -> None:
        """A recovery round of `generation` runs on this node: start no spare, and let none
        leave its idle warm-up priority, until `ranks` have all finished it and committed the
        step they resumed at (`recovered`, `progressed`) or `timeout` s passed, so no
        `import torch` runs beside the state transfer and the redone step on the node's CPUs."""
        self._hold = (generation, set(ranks), time.monotonic() + timeout) if ranks else None
        self._resume = {}

    def recovered(self, rank: int, generation: int, resume_step: int | None = None) -> None:
        """Rank `rank` finished the recovery round of `generation` (or a later one); with
        `resume_step`, it counts as done once it committed that step (`progressed`). A spare
        that replaced it returns to the agent's priority."""
        boosted = self._boosted.pop(rank, None)
        if boosted is not None and boosted[0].poll() is None:
            run_priority(boosted[1], boosted[0].pid)
        if self._hold is not None and generation >= self._hold[0] and rank in self._hold[1]:
            if resume_step is None:
                self._done(rank)
            else:
                self._resume[rank] = resume_step

    def state_size(self, nbytes: int) -> None:
        """A rank holds `nbytes` of state: spares forked from now on fault in that much heap
        (at least the largest size reported; `launcher.runtime.heap`)."""
        self.heap_bytes = max(self.heap_bytes, int(nbytes))

    def progressed(self, rank: int, committed_step: int) -> None:
        """Rank `rank` reports its last committed step."""
        if rank in self._resume and committed_step >= self._resume[rank]:
            self._done(rank)

    def _done(self, rank: int) -> None:
        self._resume.pop(rank, None)
        if self._hold is None:
            return
        self._hold[1].discard(rank)
        if not self._hold[1]:
            self._hold = None

    def held(self) -> bool:
        if self._hold is not None and time.monotonic() >= self._hold[2]:
            self._hold = None  # its ranks' later reports no longer count
            self._resume = {}
        return self._hold is not None

    def ensure(self, env: dict[str, str]) -> None:
        """Start spares until `count` are alive (once the start delay has passed, and not while
        a recovery round holds them back); spares warming up for `idle_limit` s go on at the
        agent's priority (not while held)."""
        if time.monotonic() < self._not_before or self.count == 0:
            return
        for pid, code in reap_orphans() if self._server is not None else []:
            self.log(f"reaped orphan pid {pid} (exit {code})")
        if self.fork and self._fork_spares(env):
            return
        if self.held():
            return
        while self.ready() < self.count:
            self._start(env)
        self._escalate()

    def _fork_spares(self, env: dict[str, str]) -> bool:
        """Spares from the fork server (started at the first fill; neither started nor forking
        while held): True when it serves or is still warming up, False when the pool must start
        spares itself (the server is off, gone or unsafe to fork; said in one line)."""
        from launcher.workers.zygote import ForkServer

        try:
            if self._server is None:
                if self.held():
                    return True
                base = os.getpriority(os.PRIO_PROCESS, 0)
                warm = min(19, base + WARM_UP_NICE) if may_return_to(base) else base
                self._server = ForkServer(self.python, env, (warm, base))
                self._born[self._server.proc.pid] = (
                    time.monotonic(),
                    base if warm != base else None,
                )
                self.log(
                    f"spare fork server started (pid {self._server.proc.pid}); spares are "
                    "forked from it once it has imported torch"
                )
            if not self._server.poll_ready():
                if not self.held():  # same escalation as a spare that imports torch itself
                    self._escalate_proc(self._server.proc.pid, self._server.proc)
                return True
            if (
                self.held()
            ):  # a fork costs 20-50 ms of CPU and page-table copies: not beside a round
                return True
            while self.ready() < self.count:
                t0 = time.monotonic()
                proc = self._server.fork(heap_bytes=self.heap_bytes)
                self._procs.append(proc)
                self.log(
                    f"warm spare started (pid {proc.pid}, forked in "
                    f"{(time.monotonic() - t0) * 1e3:.1f} ms; {len(self._procs)} of {self.count})"
                )
            return True
        except (OSError, ValueError) as exc:
            self.log(f"spare fork server unusable ({exc}); warm spares import torch themselves")
            self.fork = False
            self._stop_server()
            return False

    def _stop_server(self, timeout: float = STOP_S) -> None:
        server, self._server = self._server, None
        if server is not None:
            self._born.pop(server.proc.pid, None)
            server.stop(self.log, timeout)
            set_subreaper(False)
            reap_orphans()

    def _escalate(self) -> None:
        """On a node whose training keeps every CPU busy, SCHED_IDLE may never get time: a
        spare still importing torch at the next fault makes it start cold (0.8-2.5 s lost). So
        after `idle_limit` s a spare goes on at the agent's priority (an idle, warm one only
        sleeps there)."""
        for proc in self._procs:
            self._escalate_proc(proc.pid, proc)

    def _escalate_proc(self, pid: int, proc: SpareProc) -> None:
        now = time.monotonic()
        born, base = self._born.get(pid, (now, None))
        if base is not None and now - born >= self.idle_limit and proc.poll() is None:
            run_priority(base, pid)
            self._born[pid] = (born, None)

    def _start(self, env: dict[str, str]) -> None:
        parent = os.getpid()
        base = os.getpriority(os.PRIO_PROCESS, 0)
        warm = min(19, base + WARM_UP_NICE) if may_return_to(base) else base
        proc = subprocess.Popen(
            [self.python, "-u", "-m", "launcher.workers.spare"],
            env=dict(env, FTRUN_SPARE_NICE=f"{warm},{base}"),
            stdin=subprocess.PIPE,
            stdout=None,
            stderr=None,
            preexec_fn=lambda: _child_setup(parent),
            close_fds=True,
        )
        self._procs.append(proc)
        self._born[proc.pid] = (time.monotonic(), base if warm != base else None)
        self.log(f"warm spare started (pid {proc.pid}; {len(self._procs)} of {self.count})")

    def take(self, env: dict[str, str], argv: list[str], module: bool) -> SpareProc | None:
        """Hand the oldest live spare its assignment; None when no live spare is available. A
        spare that does not take the line within ASSIGN_TIMEOUT_S (its pipe full: stopped, or
        starved) is killed and the next one is tried, so the loop never blocks on a spare."""
        base = os.getpriority(os.PRIO_PROCESS, 0)
        boost = max(-20, base - REPAIR_BOOST_NICE)
        nice = boost if boost < base and may_return_to(boost) else None
        while self._procs:
            proc = self._procs.pop(0)
            self._born.pop(proc.pid, None)
            if proc.poll() is not None or proc.stdin is None:
                continue
            line = (
                json.dumps(
                    {"env": env, "argv": argv, "cwd": os.getcwd(), "module": module, "nice": nice}
                )
                + "\n"
            )
            err = _assign(proc, line.encode(), ASSIGN_TIMEOUT_S)
            if err is not None:
                self.log(f"warm spare pid {proc.pid} not used ({err}); killed")
                proc.kill()
                _wait(proc, self.log, STOP_S)
                continue
            if nice is not None and "RANK" in env:
                self._boosted[int(env["RANK"])] = (proc, base)
            return proc
        return None

    def stop(self) -> None:
        """Kill the idle spares and the fork server at once; all of them get STOP_S in total to
        exit (the ones still there then are named and left behind), so the pool's stop fits in
        the agent's shutdown bound (launcher.agent.agent.STOP_TOGETHER_S)."""
        procs, self._procs = self._procs, []
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
        self._born.clear()


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


def _warm_imports() -> None:
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.optim  # noqa: F401

    import launcher.runtime.runtime  # noqa: F401  (the runtime and what it imports)

    try:  # optimizers import torch._dynamo lazily on their first step: pay it now
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - optional warm-up only
        pass
    # what the imports built lives as long as the process: out of the collector's sight. A full
    # collection over it takes ~50 ms (torch's ~170k objects), and the first one came while the
    # replacement started its script, 20-25 ms into the recovery; in a forked spare it would also
    # copy every page those objects live on
    gc.collect()
    gc.freeze()


def _threads(pid: int | None = None) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{'self' if pid is None else pid}/task")]
    except OSError:
        return [0] if pid is None else []


def _warm_priority(warm: int) -> None:
    """Warm up out of the way: `warm` niceness and, where the OS has it, SCHED_IDLE (runs only
    when a CPU has nothing else to do, so a successor's import never slows the recovery or the
    training that used its predecessor)."""
    os.setpriority(os.PRIO_PROCESS, 0, warm)
    if hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass


def _run_priority(base: int) -> str | None:
    return run_priority(base)


def run_priority(base: int, pid: int | None = None) -> str | None:
    """Every thread of process `pid` (default: this one) back to the agent's priority
    (SCHED_OTHER, nice `base`); an error text or None."""
    err = None
    for tid in _threads(pid):
        try:
            if hasattr(os, "SCHED_OTHER") and os.sched_getscheduler(tid) != os.SCHED_OTHER:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, base)
        except OSError as exc:  # a thread may have ended meanwhile; remember real refusals
            if exc.errno != 3:  # ESRCH
                err = str(exc)
    return err


class _Assignment:
    """Reads the assignment line on a thread while the imports run: a spare taken while still
    warming up returns to the agent's priority at once instead of finishing `import torch` at
    the warm-up priority."""

    def __init__(self, warm: int, base: int) -> None:
        self.line = ""
        self.error: str | None = None
        self._done = threading.Event()
        self._warm, self._base = warm, base
        threading.Thread(target=self._read, name="ftrun-spare-stdin", daemon=True).start()

    def _read(self) -> None:
        try:
            self.line = sys.stdin.readline()
            if self.line.strip() and self._warm != self._base:
                self.error = _run_priority(_job_nice(self.line, self._base))
        finally:
            self._done.set()

    def wait(self) -> str:
        self._done.wait()
        return self.line


def main() -> None:
    if sys.argv[1:2] == ["--fork-server"]:  # the node's fork server (launcher.workers.zygote)
        from launcher.workers import zygote

        zygote.main(int(sys.argv[2]))
        return
    warm, base = (int(x) for x in os.environ.get("FTRUN_SPARE_NICE", "0,0").split(","))
    if warm != base:
        _warm_priority(warm)
    assignment = _Assignment(warm, base)
    _warm_imports()
    line = assignment.wait()
    if not line.strip():
        sys.exit(0)
    if warm != base:
        # threads the imports started after the assignment arrived inherited the warm-up priority
        err = _run_priority(_job_nice(line, base)) or assignment.error
        if err:
            print(
                f"[ftrun spare] could not return to nice {base} ({err}); some threads run at "
                f"nice {warm}",
                file=sys.stderr,
                flush=True,
            )
    run_job(json.loads(line))


def _job_nice(line: str, base: int) -> int:
    """The niceness an assignment line asks for (a boosted replacement), else `base`."""
    try:
        nice = json.loads(line).get("nice")
    except (ValueError, AttributeError):
        return base
    return base if nice is None else int(nice)


def run_job(job: dict) -> None:
    """Run the assigned script in this process as `python -u [-m] script args` would (at the
    assignment's `nice` when it has one: the agent returns it to its own after the repair)."""
    if job.get("nice") is not None:
        run_priority(int(job["nice"]))
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    argv = list(job["argv"])
    sys.argv = argv
    import runpy

    if job.get("module"):
        sys.path[0] = job["cwd"]
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
