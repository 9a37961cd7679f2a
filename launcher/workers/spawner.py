"""Starting this node's workers: torchrun's environment, per-rank logs, the warm spares.

Owns: the environment each worker gets (torchrun's exact variables plus `FTRUN_*` for the
runtime), starting a rank's process with its log files, tee and output filters, a process-level
replacement taken from a warm spare when it can be, and keeping `--warm-spares` of them (the used
one's successor starts at the next health check) once the job is known to use launcher.runtime.
Every new process is handed to the reaper and announced through `on_spawn` (the hang watch
restarts that rank's clock). `stop()` ends the spares.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable

from launcher.config import LaunchConfig
from launcher.observe.logs import AgentLog, RunLogDir, render_prefix
from launcher.protocol.death_notice import ENV as NOTICE_ENV
from launcher.protocol.death_notice import NoticeBoard
from launcher.workers.spare import SparePool
from launcher.workers.workers import Reaper, Worker, spawn


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

    def __post_init__(self) -> None:
        self.spares = None
        if self.cfg.warm_spares > 0 and not self.cfg.no_python:
            self.spares = SparePool(
                os.environ.get("PYTHON_EXEC", sys.executable),
                lambda m: self.log.info("spare", m),
                count=self.cfg.warm_spares,
                fork=self.cfg.spare_fork,
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
        return env

    def spawn(self, w: Worker, generation: int, replacement: bool) -> None:
        """Start rank `w`'s process for `generation` (a replacement may come from the spare)."""
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
        if replacement and self._from_spare(w, cmd, env, inherit=not (red or tee) and shown):
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
        self.log.info(
            "spawn",
            f"rank {w.rank} (local {w.local_rank}) started, pid {w.pid}"
            + (" as replacement" if replacement else ""),
            rank=w.rank,
            local_rank=w.local_rank,
            pid=w.pid,
            generation=generation,
            replacement=replacement,
        )

    def spawn_all(self, workers: list[Worker], generation: int) -> None:
        for w in workers:
            self.spawn(w, generation, replacement=False)

    def _started(self, w: Worker) -> None:
        """A rank got a new process: watch its exit, announce it."""
        self.reaper.watch(w)
        self.on_spawn(w)

    def _from_spare(self, w: Worker, cmd: list[str], env: dict[str, str], inherit: bool) -> bool:
        """Turn the warm spare into rank `w` (only for plain `python [-m] script` workers whose
        output goes to the console as is). False when no spare can be used."""
        cfg = self.cfg
        if self.spares is None or not inherit or cfg.no_python or cfg.run_path:
            return False
        argv = cmd[3:] if cfg.module else cmd[2:]  # drop python -u [-m]
        proc = self.spares.take(env, argv, cfg.module)
        if proc is None:
            return False
        w.attach(proc)
        self._started(w)
        self.log.info(
            "spawn",
            f"rank {w.rank} (local {w.local_rank}) started from the warm spare, "
            f"pid {w.pid}, as replacement",
            rank=w.rank,
            local_rank=w.local_rank,
            pid=w.pid,
            generation=w.generation,
            replacement=True,
            warm=True,
        )
        return True

    def keep_spare(self, template: Worker) -> None:
        """Keep `--warm-spares` spares on this node (call once the job is known to use the
        runtime; unmodified jobs pay nothing). `template`: any local rank; the spares get its
        environment."""
        if self.spares is not None:
            self.spares.ensure(self.env(template, replacement=True))

    def hold_spares(self, generation: int, ranks: set[int]) -> None:
        """A recovery round runs: no new spare until `ranks` recovered (see SparePool.hold)."""
        if self.spares is not None:
            self.spares.hold(generation, ranks)

    def rank_recovered(self, rank: int, generation: int, resume_step: int | None = None) -> None:
        if self.spares is not None:
            self.spares.recovered(rank, generation, resume_step)

    def rank_progressed(self, rank: int, committed_step: int, state_bytes: int = 0) -> None:
        if self.spares is not None:
            self.spares.progressed(rank, committed_step)
            if state_bytes:
                self.spares.state_size(state_bytes)

    def stop(self) -> None:
        if self.spares is not None:
            self.spares.stop()
