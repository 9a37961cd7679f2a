"""Starting this node's workers: torchrun's environment, per-rank logs, the warm spares.

Owns: the environment each worker gets (torchrun's exact variables plus `FTRUN_*` for the
runtime), starting a rank's process with its log files, tee and output filters, a process-level
replacement taken from a warm spare when it can be, the node's ranks forked from its fork
server (`spawn_all`: `FTRUN_WORKER_START`, `launcher.workers.job_imports.starts_forked`; the
server started first at the agent's priority and waited for, one `import torch` per node
instead of one per rank, then a cold start when it cannot be had), and keeping
`--warm-spares` of them (the used one's successor starts at the next health check) once the job
is known to use launcher.runtime:
with the workers (`spawn_all`) when `FTRUN_SPARE_START` says so (auto: the script's source names
the runtime, `launcher.workers.job_imports.names_runtime`), else from the first rank's hello (the
agent's health check). A replacement that had to start cold is overtaken by a spare that becomes
ready before the cold one said hello (`overtake`: the spare takes the rank in the same round,
the cold process is frozen, then killed). The modules the ranks report are handed to the spares
(`learn_imports`, `launcher.workers.job_imports.JobImports`). Every new process is handed to the
reaper and announced through `on_spawn` (the hang watch restarts that rank's clock). `stop()`
ends the spares.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from subprocess import Popen
from typing import Callable

from launcher.config import LaunchConfig
from launcher.observe.logs import AgentLog, RunLogDir, render_prefix
from launcher.protocol.death_notice import ENV as NOTICE_ENV
from launcher.protocol.death_notice import NoticeBoard
from launcher.workers.job_imports import (
    JobImports,
    names_runtime,
    names_torch,
    node_cpus,
    script_imports,
    starts_forked,
    starts_with_workers,
)
from launcher.workers.overtake import ColdStart, freeze, kill_frozen, thaw
from launcher.workers.spare import SparePool
from launcher.workers.spare_process import EXEC_TIME_ENV
from launcher.workers.workers import Reaper, Worker, spawn

SPARE_IMPORTS_FILE = "spare_imports.json"  # in the run's log directory: what the spares import
# the node's ranks wait this long for the fork server's imports, then start cold (one import of
# torch and the runtime: 1.5-2.5 CPU-s, more on a loaded node)
SERVER_READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class WorkerWorld:
    """What every worker of this node is told about the job."""

    group_rank: int
    group_world_size: int
    world_size: int
    master_addr: str  # the store workers use (the node's proxy, or the store itself)
    master_port: int
    agent_socket: str  # the worker channel


@dataclass
class Spawner:
    cfg: LaunchConfig
    world: WorkerWorld
    run_dir: RunLogDir
    log: AgentLog
    host: str
    reaper: Reaper
    on_spawn: Callable[[Worker], None]
    console_lock: threading.Lock = field(default_factory=threading.Lock)
    notices: NoticeBoard | None = None  # the agent's death-notice slots (None: pidfds only)
    spares: SparePool | None = field(init=False)
    # the pool is kept before any hello: FTRUN_SPARE_START (set by `spawn_all`)
    pool_wanted: bool = field(init=False, default=False)
    imports: JobImports | None = field(init=False, default=None)
    cold: dict[int, ColdStart] = field(init=False, default_factory=dict)  # local rank -> cold

    def __post_init__(self) -> None:
        self.spares = None
        cfg = self.cfg
        if cfg.warm_spares > 0 and not cfg.no_python:
            self.spares = SparePool(
                os.environ.get("PYTHON_EXEC", sys.executable),
                lambda m: self.log.info("spare", m),
                count=cfg.warm_spares,
                fork=cfg.spare_fork,
                record=self.log.info,
            )
            here = os.path.dirname(os.path.abspath(cfg.script)) if not cfg.module else os.getcwd()
            leading = script_imports(cfg.script, cfg.module, os.getcwd()) if cfg.spare_learn else []
            self.imports = JobImports(
                os.path.join(self.run_dir.path, SPARE_IMPORTS_FILE),
                cfg.spare_imports + leading,
                [here],
                cfg.spare_learn,
            )
            if self.imports.file is not None:
                self.spares.extend_imports(self.imports.file)
            if leading:
                self.log.info(
                    "spare-imports",
                    f"the script's leading imports ({', '.join(leading[:6])}"
                    + (f" and {len(leading) - 6} more" if len(leading) > 6 else "")
                    + "): the node's fork server imports them before it forks ranks and spares",
                    new=len(leading),
                    modules=len(self.imports.modules),
                    at="script",
                )

    def env(self, w: Worker, replacement: bool) -> dict[str, str]:
        cfg, world = self.cfg, self.world
        env = dict(os.environ)
        env.update(
            {
                "RANK": str(w.rank),
                "LOCAL_RANK": "0" if cfg.virtual_local_rank else str(w.local_rank),
                "WORLD_SIZE": str(world.world_size),
                "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node),
                "GROUP_RANK": str(world.group_rank),
                "GROUP_WORLD_SIZE": str(world.group_world_size),
                "ROLE_NAME": cfg.role,
                "ROLE_RANK": str(w.rank),
                "ROLE_WORLD_SIZE": str(world.world_size),
                "MASTER_ADDR": world.master_addr,
                "MASTER_PORT": str(world.master_port),
                "TORCHELASTIC_RESTART_COUNT": str(w.generation),
                "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts),
                "TORCHELASTIC_RUN_ID": cfg.rdzv_id,
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get(
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"
                ),
                "TORCHELASTIC_ERROR_FILE": w.error_file,
                "TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(
                    signal.Signals(s).name for s in cfg.signals_to_handle
                ),
                "FTRUN_AGENT_SOCKET": world.agent_socket,
                "FTRUN_GENERATION": str(w.generation),
                "FTRUN_REPLACEMENT": "1" if replacement else "0",
                "FTRUN_RUN_ID": cfg.rdzv_id,
                "FTRUN_NODE_RANK": str(world.group_rank),
                "FTRUN_LOG_DIR": self.run_dir.path,
                "FTRUN_MONITOR_INTERVAL": str(cfg.monitor_interval),
            }
        )
        if cfg.virtual_local_rank and "CUDA_VISIBLE_DEVICES" not in os.environ:
            env["CUDA_VISIBLE_DEVICES"] = str(w.local_rank)
        if "OMP_NUM_THREADS" not in os.environ and cfg.nproc_per_node > 1:
            env["OMP_NUM_THREADS"] = "1"
        # a hung unmodified worker dumps every thread's stack on SIGABRT (launcher.hang.stacks)
        env.setdefault("PYTHONFAULTHANDLER", "1")
        # torch's CPU allocator backs tensors of >= 2 MB with transparent huge pages: a killed
        # rank holding 1 GB of state is torn down by the kernel in ~11 ms instead of ~45 ms
        # (the survivors learn of the death that much sooner), and a replacement's fresh
        # tensors take 512x fewer page faults while its state streams in
        env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
        env.pop(EXEC_TIME_ENV, None)  # a warm spare's own (its `exec` mark); a cold one has none
        return env

    def spawn(self, w: Worker, generation: int, replacement: bool, forked: bool = False) -> None:
        """Start rank `w`'s process for `generation` (a replacement may come from the spare;
        with `forked`, a first start from the node's ready fork server: `spawn_all`)."""
        cfg = self.cfg
        w.generation = generation
        d = self.run_dir.rank_dir(generation, w.local_rank)
        w.error_file = os.path.join(d, "error.json")
        red, tee = cfg.redirects.get(w.local_rank, 0), cfg.tee.get(w.local_rank, 0)
        shown = cfg.local_ranks_filter is None or w.local_rank in cfg.local_ranks_filter
        out_file = os.path.join(d, "stdout.log") if (red | tee) & 1 else None
        err_file = os.path.join(d, "stderr.log") if (red | tee) & 2 else None
        prefix = render_prefix(
            cfg.log_line_prefix_template, cfg.role, w.local_rank, w.rank, self.host
        )
        cmd = cfg.worker_command(w.local_rank)
        if not shown:  # --local-ranks-filter: this rank's output stays off the console
            out_file, err_file = out_file or os.devnull, err_file or os.devnull
        attempt = self.run_dir.attempt_dir(generation)
        env = self.env(w, replacement)
        env.pop(NOTICE_ENV, None)
        w.notice = (self.notices.arm(w.local_rank, w.spawns) if self.notices else None) or ""
        if w.notice:
            env[NOTICE_ENV] = w.notice
        inherit = not (red or tee) and shown
        if (replacement or forked) and self._from_spare(w, cmd, env, inherit, replacement):
            return
        spawn(
            w,
            cmd,
            env,
            out_file,
            err_file,
            tee_out=bool(tee & 1) and shown,
            tee_err=bool(tee & 2) and shown,
            prefix=prefix,
            console_lock=self.console_lock,
            filters=(cfg.duplicate_stdout_filters, cfg.duplicate_stderr_filters),
            filtered=(
                os.path.join(attempt, "filtered_stdout.log"),
                os.path.join(attempt, "filtered_stderr.log"),
            ),
        )
        self._started(w)
        if replacement and inherit and self._spare_usable() and isinstance(w.proc, Popen):
            self.cold[w.local_rank] = ColdStart(w, w.proc, env, self._script_argv(cmd))
        self._said_spawn(
            w,
            f"rank {w.rank} (local {w.local_rank}) started, pid {w.pid}"
            + (" as replacement" if replacement else ""),
            replacement,
        )

    def spawn_all(self, workers: list[Worker], generation: int) -> None:
        """Start every rank: forked from the node's fork server when `FTRUN_WORKER_START` says
        so (`_fork_start`), else each its own `python -u script`; then the spare pool, when the
        job is known to use the runtime (its imports take idle CPU time only until the ranks
        committed their first step)."""
        if self.spares is not None and workers:
            self.spares.starting({w.rank for w in workers}, time.monotonic())
        forked = bool(workers) and self._fork_start(workers)
        for w in workers:
            self.spawn(w, generation, replacement=False, forked=forked)
        if self.spares is None or not workers:
            return
        cfg = self.cfg
        named = cfg.spare_start == "auto" and names_runtime(cfg.script, cfg.module, os.getcwd())
        if starts_with_workers(cfg.spare_start, named, node_cpus(), len(workers), forked):
            self.pool_wanted = True
            self.keep_spare(workers[0])

    def _fork_start(self, workers: list[Worker]) -> bool:
        """Whether this node's ranks start forked from its fork server (`starts_forked`); if
        so, the server is ready: started at the agent's priority and waited for (at most
        SERVER_READY_TIMEOUT_S). One that cannot be had is said in one line: a cold start."""
        cfg = self.cfg
        if cfg.worker_start == "exec":
            return False
        blocker = self._fork_blocker(workers)
        named = cfg.worker_start == "auto" and names_torch(cfg.script, cfg.module, os.getcwd())
        if not starts_forked(cfg.worker_start, blocker is None, named) or self.spares is None:
            if blocker is not None and cfg.worker_start == "fork":
                self.log.info("worker-start", f"FTRUN_WORKER_START=fork: cold start ({blocker})")
            return False
        t0 = time.monotonic()
        why = self.spares.serve_ranks(
            self.env(workers[0], replacement=True), SERVER_READY_TIMEOUT_S
        )
        took = round(time.monotonic() - t0, 3)
        if why is not None:
            self.log.warning(
                "worker-start", f"the node's ranks start cold: {why}", forked=False, wait_s=took
            )
            return False
        self.log.info(
            "worker-start",
            f"the node's {len(workers)} rank(s) start from its fork server (ready after "
            f"{took:.2f} s): one import of torch for the node",
            forked=True,
            wait_s=took,
        )
        return True

    def _fork_blocker(self, workers: list[Worker]) -> str | None:
        """What keeps the ranks from being forked from the fork server (None: nothing): only
        plain `python [-m] script` workers whose output is inherited can be."""
        cfg = self.cfg
        if self.spares is None:
            return "no warm spares on this node: --warm-spares 0 or --no-python"
        if not self._spare_usable():
            return "--run-path"
        if not self.spares.fork:
            return "the spare fork server is off (FTRUN_SPARE_FORK=0, or it failed)"
        for w in workers:
            shown = cfg.local_ranks_filter is None or w.local_rank in cfg.local_ranks_filter
            if cfg.redirects.get(w.local_rank, 0) or cfg.tee.get(w.local_rank, 0) or not shown:
                return "--redirects, --tee or --local-ranks-filter: output not inherited"
        return None

    def _spare_usable(self) -> bool:
        """A replacement of this job may come from a spare (plain `python [-m] script`)."""
        cfg = self.cfg
        return self.spares is not None and not cfg.no_python and not cfg.run_path

    def _script_argv(self, cmd: list[str]) -> list[str]:
        return cmd[3:] if self.cfg.module else cmd[2:]  # drop python -u [-m]

    def _started(self, w: Worker) -> None:
        """A rank got a new process: watch its exit, announce it."""
        self.reaper.watch(w)
        self.on_spawn(w)

    def _from_spare(
        self, w: Worker, cmd: list[str], env: dict[str, str], inherit: bool, replacement: bool
    ) -> bool:
        """Turn a warm spare into rank `w`'s replacement, or (not `replacement`) fork its first
        process from the ready fork server (only for plain `python [-m] script` workers whose
        output goes to the console as is). False when no spare can be used: a cold start."""
        if self.spares is None or not inherit or not self._spare_usable():
            return False
        argv, module = self._script_argv(cmd), self.cfg.module
        if not replacement:
            proc = self.spares.fork_rank(env, argv, module)
        else:
            proc = self.spares.take(env, argv, module, fork_now=True)
        if proc is None:
            return False
        w.attach(proc)
        self._started(w)
        if not replacement:
            self._said_spawn(
                w,
                f"rank {w.rank} (local {w.local_rank}) started from the node's fork server, "
                f"pid {w.pid}",
                replacement=False,
                forked=True,
            )
        else:
            self._said_warm(
                w,
                f"rank {w.rank} (local {w.local_rank}) started from the warm spare, "
                f"pid {w.pid}, as replacement",
            )
        return True

    def keep_spare(self, template: Worker) -> None:
        """Keep `--warm-spares` spares on this node (call once the job is known to use the
        runtime; unmodified jobs pay nothing). `template`: any local rank; the spares get its
        environment."""
        if self.spares is not None:
            self.spares.ensure(self.env(template, replacement=True))

    def overtake(self, connected: Callable[[Worker, int], bool]) -> None:
        """A spare that is ready now takes the rank of a replacement still starting cold, before
        that one connected to the agent (`connected(worker, pid)`: it said hello, or its
        connection to the worker channel is open or pending). The cold process is frozen while
        this is checked, killed once the spare has its assignment (its exit is an older
        process's: no fault), or thawed when anything stands in the way. Same round, same plan:
        the spare joins the generation the cold one was started for."""
        for local, cold in list(self.cold.items()):
            w, pid = cold.worker, cold.proc.pid
            if not cold.current or connected(w, pid):
                del self.cold[local]  # it exited, was replaced, or reached the agent: it stays
                continue
            if self.spares is None:
                continue
            if not self.spares.available():
                self.spares.hurry()  # its import races the cold one's
                continue
            if not freeze(pid) or connected(w, pid):
                thaw(pid)  # a thread in the kernel, or it connected meanwhile: the next check
                continue
            env = dict(cold.env)
            env.pop(NOTICE_ENV, None)
            notice = (self.notices.arm(w.local_rank, w.spawns) if self.notices else None) or ""
            if notice:
                env[NOTICE_ENV] = notice
            proc = self.spares.take(env, cold.argv, self.cfg.module, fork_now=True)
            if proc is None:
                thaw(pid)
                continue
            del self.cold[local]
            w.notice = notice
            w.attach(proc)
            kill_frozen(pid)
            self._started(w)
            self._said_overtaken(w, cold)

    def _said_overtaken(self, w: Worker, cold: ColdStart) -> None:
        started = time.monotonic() - cold.started
        self._said_warm(
            w,
            f"rank {w.rank} (local {w.local_rank}): a warm spare became ready first and takes "
            f"the rank (pid {w.pid}); the cold replacement pid {cold.proc.pid}, started "
            f"{started:.2f} s ago and not yet connected, is stopped",
            overtook=cold.proc.pid,
            cold_s=round(started, 3),
        )

    def _said_warm(self, w: Worker, message: str, **extra: object) -> None:
        """The `spawn` line of a replacement a warm spare became."""
        self._said_spawn(w, message, replacement=True, warm=True, **extra)

    def _said_spawn(self, w: Worker, message: str, replacement: bool, **extra: object) -> None:
        """The `spawn` line of rank `w`'s new process (cold, forked or a warm spare)."""
        self.log.info(
            "spawn",
            message,
            rank=w.rank,
            local_rank=w.local_rank,
            pid=w.pid,
            generation=w.generation,
            replacement=replacement,
            **extra,
        )

    def learn_imports(self, rank: int, modules: list[str], at: str = "first-step") -> None:
        """Rank `rank` had `modules` loaded by its start (`at` "start": when it joined the job)
        or by its first step ("first-step"): the spares import them too."""
        if self.spares is None or self.imports is None:
            return
        new = self.imports.add(rank, modules)
        if new and self.imports.file is not None:
            self.spares.extend_imports(self.imports.file)
            when = "its start" if at == "start" else "its first step"
            self.log.info(
                "spare-imports",
                f"rank {rank} had {new} more module(s) loaded by {when} "
                f"({len(self.imports.modules)} in all, {self.imports.file}): the spares import "
                "them before they are forked",
                rank=rank,
                new=new,
                modules=len(self.imports.modules),
                at=at,
            )

    def hold_spares(self, generation: int, ranks: set[int]) -> None:
        """A recovery round runs: no new spare until `ranks` recovered (see SparePool.hold)."""
        if self.spares is not None:
            self.spares.hold(generation, ranks)

    def rank_recovered(self, rank: int, generation: int, resume_step: int | None = None) -> None:
        if self.spares is not None:
            self.spares.recovered(rank, generation, resume_step)

    def rank_progressed(self, rank: int, committed_step: int, heap_bytes: int = 0) -> None:
        """Rank `rank` committed `committed_step`; `heap_bytes`: the heap it needed by its first
        commit (its state at least), which spares forked from now on prepare."""
        if self.spares is not None:
            self.spares.progressed(rank, committed_step)
            if heap_bytes:
                self.spares.heap_needed(heap_bytes)

    def stop(self) -> None:
        if self.spares is not None:
            self.spares.stop()
