"""The worker's launch environment.

Owns: parsing and validating the variables the agent (or plain torchrun) sets for a worker
into one immutable `RuntimeEnv`. Nothing else in the runtime reads `os.environ` for these. Also
when this process began running the user's code (`exec_time`: the time a warm spare was assigned
the job, `FTRUN_EXEC_TIME`, else this process's start from `/proc/self/stat`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Mapping


def _int(env: Mapping[str, str], name: str, default: int | None = None, minimum: int = 0) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ValueError(
                f"environment variable {name} is not set; launch with ftrun or torchrun"
            )
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{name}={value} must be > 0 seconds")
    return value


DDP_COMMS = ("reducer", "hook")


def process_start_time() -> float | None:
    """Wall-clock time this process started (the interpreter's start), from /proc; None when
    it cannot be read (10 ms resolution: clock ticks since boot, against CLOCK_BOOTTIME, not the
    whole seconds of /proc/stat's btime)."""
    try:
        with open("/proc/self/stat", encoding="ascii", errors="replace") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return round(time.time() - age, 3)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def exec_time(env: Mapping[str, str]) -> float | None:
    """When this process began running the user's code: a warm spare's assignment
    (FTRUN_EXEC_TIME, set by the spare), else the process's start."""
    try:
        return float(env.get("FTRUN_EXEC_TIME", ""))
    except ValueError:
        return process_start_time()


@dataclass(frozen=True)
class RuntimeEnv:
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    agent_socket: str | None  # None: plain torchrun, no recovery
    generation: int
    replacement: bool
    run_id: str
    node_rank: int
    log_dir: str | None
    fault_plan: str | None
    store_timeout: float
    collective_timeout: float = 300.0  # a runtime collective waits this long before it reports
    skip_init: bool = True  # FTRUN_SKIP_INIT: a replacement skips the random init it receives over
    # FTRUN_DDP_COMM: how rt.ddp all-reduces gradients: "reducer" (DDP's own C++ reducer on the
    # runtime's group, no Python per bucket) or "hook" (the runtime's Python comm hook)
    ddp_comm: str = "reducer"
    # FTRUN_DEATH_NOTICE: the agent's slot this process holds so that its death is seen at once
    # (launcher.protocol.death_notice); None: the agent sees the exit through its pidfd
    death_notice: str | None = None
    # FTRUN_STOP_POINTS: a pending stop ends a step's forward or backward at the next module call
    # or gradient of the registered models (launcher.runtime.stop_points)
    stop_points: bool = True
    # when this process began running the user's code (`exec_time`; a replacement's `exec` mark)
    exec_time: float | None = None

    @property
    def managed(self) -> bool:
        """True when an ftrun agent supervises this worker (recovery available)."""
        return self.agent_socket is not None

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> "RuntimeEnv":
        env = os.environ if env is None else env
        world = _int(env, "WORLD_SIZE", minimum=1)
        rank = _int(env, "RANK")
        if rank >= world:
            raise ValueError(f"RANK={rank} must be < WORLD_SIZE={world}")
        replacement = env.get("FTRUN_REPLACEMENT", "0")
        if replacement not in ("0", "1"):
            raise ValueError(f"FTRUN_REPLACEMENT={replacement!r}; allowed: '0' or '1'")
        skip_init = env.get("FTRUN_SKIP_INIT", "1")
        if skip_init not in ("0", "1"):
            raise ValueError(f"FTRUN_SKIP_INIT={skip_init!r}; allowed: '0' or '1'")
        stop_points = env.get("FTRUN_STOP_POINTS", "1")
        if stop_points not in ("0", "1"):
            raise ValueError(f"FTRUN_STOP_POINTS={stop_points!r}; allowed: '0' or '1'")
        ddp_comm = env.get("FTRUN_DDP_COMM", "reducer")
        if ddp_comm not in DDP_COMMS:
            raise ValueError(f"FTRUN_DDP_COMM={ddp_comm!r}; allowed: {', '.join(DDP_COMMS)}")
        addr = env.get("MASTER_ADDR")
        if not addr:
            raise ValueError(
                "environment variable MASTER_ADDR is not set; launch with ftrun or torchrun"
            )
        return cls(
            rank=rank,
            local_rank=_int(env, "LOCAL_RANK", default=0),
            world_size=world,
            master_addr=addr,
            master_port=_int(env, "MASTER_PORT", minimum=1),
            restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", default=0),
            agent_socket=env.get("FTRUN_AGENT_SOCKET") or None,
            generation=_int(env, "FTRUN_GENERATION", default=0),
            replacement=replacement == "1",
            run_id=env.get("FTRUN_RUN_ID", env.get("TORCHELASTIC_RUN_ID", "none")),
            node_rank=_int(env, "FTRUN_NODE_RANK", default=_int(env, "GROUP_RANK", default=0)),
            log_dir=env.get("FTRUN_LOG_DIR") or None,
            fault_plan=env.get("FTRUN_FAULT_PLAN") or None,
            store_timeout=_float(env, "FTRUN_STORE_TIMEOUT", 300.0),
            collective_timeout=_float(
                env, "FTRUN_COLLECTIVE_TIMEOUT", _float(env, "FTRUN_STORE_TIMEOUT", 300.0)
            ),
            skip_init=skip_init == "1",
            ddp_comm=ddp_comm,
            death_notice=env.get("FTRUN_DEATH_NOTICE") or None,
            stop_points=stop_points == "1",
            exec_time=exec_time(env) if replacement == "1" else None,
        )
