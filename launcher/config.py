"""Validated launch configuration: the one object the CLI hands to the agent.

Owns: `LaunchConfig` and `build_config()`, which turns raw CLI values (torchrun's flags plus
ftrun's own) and the FTRUN_* environment variables into resolved, checked settings, raising
`ConfigError` with one line naming the flag or variable, the value and what is allowed. It is the
one place the agent's side reads its settings from the environment (the workers' runtime reads
its own, `launcher.runtime.env`). `build_config` runs one named step per concern (what to run,
topology, supervision, strategy, worker logs, observation, rendezvous, store, proxy); endpoint
strings are parsed by `rendezvous.store.endpoints`. Nothing here starts processes or opens
sockets, except probing whether a local port is free.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
import signal
import socket
import sys
import uuid
from dataclasses import dataclass, field

from launcher.control.repair_planning import AUTO_STRIPES, MAX_STRIPES
from launcher.hang.hang_watch import (
    DEFAULT_FIRST_STEP,
    DEFAULT_FLOOR,
    DEFAULT_MULTIPLIER,
    DEFAULT_STOP_ANSWER,
    DEFAULT_UNMODIFIED,
    HangPolicy,
)
from launcher.protocol import death_notice, plan
from rendezvous.nodes.hosting import wants_to_host
from rendezvous.nodes.settings import RendezvousSettings
from rendezvous.store import auth
from rendezvous.store.endpoints import (
    ETCD_DEFAULT_PORT,
    EndpointError,
    parse_endpoint,
    parse_endpoints,
)
from rendezvous.store.loop_priority import DEFAULT_NICE, loop_nice

EMBEDDED_BACKENDS = {"static", "c10d", "parallel", "embedded"}
ETCD_BACKENDS = {"etcd", "etcd-v3", "etcd-v2"}
# torchrun's dynamic backends: node ranks come from the rendezvous (arrival order), --node-rank
# is ignored (with a warning when it is not 0, as torchrun does).
DYNAMIC_BACKENDS = {"c10d", "parallel"} | ETCD_BACKENDS
DEFAULT_C10D_PORT = 29400
DEFAULT_MASTER_PORT = 29500
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
DEFAULT_RECOVER_STRATEGY = "retry,recover-in-place,restart-all,exit"

# Environment variables of Ascend's fault-tolerance stack (seed 003) and what they mean for us.
SEED_ENV_VARS = (
    "HIGH_AVAILABILITY",
    "PROCESS_RECOVER",
    "ELASTIC_PROCESS_RECOVER_ENABLE",
    "ENABLE_RESTART_FAULT_PROCESS",
)


class ConfigError(ValueError):
    """A flag or environment value is invalid; str() is the one-line message for the user."""


@dataclass
class LaunchConfig:
    # what to run
    script: str
    script_args: list[str]
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    # topology
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    node_rank: int | None = 0  # None: assigned by dynamic rendezvous
    role: str = "default"
    # rendezvous / store
    rdzv_backend: str = "static"  # as the user wrote it
    store_backend: str = "embedded"  # "embedded" or "etcd"
    rdzv_endpoint: str = ""
    rdzv_id: str = "none"
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    store_host: str = "127.0.0.1"  # embedded: where the leader hosts the store
    store_port: int = 0  # 0: pick a free port (single-node mode)
    is_store_host: bool = True
    master_addr_for_workers: str = "localhost"
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    local_addr: str | None = None
    standalone: bool = False
    proxy: bool = False
    token_file: str | None = None
    # the job token itself (FTRUN_JOB_TOKEN or token_file), checked; never logged (`public`)
    job_token: str | None = field(default=None, repr=False)
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    rdzv_settings: RendezvousSettings = field(default_factory=RendezvousSettings)
    # s a lost node's ranks wait for a spare/replacement (node_replace_timeout or Ascend's
    # wait_reschedule_timeout: the same wait, see parse_replacement_wait)
    node_replace_timeout: float = 600.0
    # supervision
    max_restarts: int = 0
    monitor_interval: float = 0.1
    # --hang-timeout (`hang.timeout`: None = auto, 0 = off, else seconds) + FTRUN_HANG_* knobs
    hang: HangPolicy = field(default_factory=HangPolicy)
    death_notice: bool = True  # FTRUN_DEATH_NOTICE=0: exits seen through pidfds only
    fault_window: float = 2.0  # FTRUN_FAULT_WINDOW: s the controller holds possible consequences
    store_nice: int = DEFAULT_NICE  # FTRUN_STORE_NICE: the hosted store's loop thread priority
    store_accel: bool = True  # FTRUN_STORE_ACCEL=0: the store's and proxy's Python paths only
    warm_spares: int = 2  # --warm-spares / FTRUN_WARM_SPARES: pre-started replacements per node
    transfer_stripes: int = (
        0  # FTRUN_TRANSFER_STRIPES: senders per replacement; 0 = auto (one per node)
    )
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    signals_to_handle: list[int] = field(default_factory=list)
    recover_strategy: list[str] = field(default_factory=list)
    elastic_training: bool = False  # elastic-training was asked for (flag or HIGH_AVAILABILITY)
    # after a live shrink, start the dropped ranks' returning processes: the world grows back
    # (--rdzv-conf elastic_grow / FTRUN_ELASTIC_GROW; launcher.agent.grow_back)
    elastic_grow: bool = True
    # a device plugin's sub-health file for this node: a hot switch of its suspect ranks
    # (--rdzv-conf subhealth_file / FTRUN_SUBHEALTH_FILE; launcher.agent.subhealth)
    subhealth_file: str = ""
    # logs
    log_dir: str | None = None
    redirects: dict[int, int] = field(default_factory=dict)  # local_rank -> 0..3
    tee: dict[int, int] = field(default_factory=dict)
    local_ranks_filter: set[int] | None = None
    log_line_prefix_template: str | None = None
    duplicate_stdout_filters: list[str] = field(default_factory=list)
    duplicate_stderr_filters: list[str] = field(default_factory=list)
    # observation (launcher.observe)
    metrics_port: int | None = None  # --rdzv-conf metrics_port / FTRUN_METRICS_PORT; None = off
    progress_interval: float = 5.0  # FTRUN_PROGRESS_INTERVAL: s between `progress` records
    # accepted for parity
    start_method: str = "spawn"
    event_log_handler: str = "null"
    logs_specs: str | None = None
    numa_binding: str | None = None
    virtual_local_rank: bool = False
    enable_tiered_store: bool = False
    notes: list[str] = field(default_factory=list)  # one-line remarks logged at start
    # spare pool and agent phases (FTRUN_SPARE_FORK, FTRUN_PHASE_TIMEOUT)
    spare_fork: bool = True  # FTRUN_SPARE_FORK: warm spares forked from one fork server per node
    # FTRUN_SPARE_START: when the spare pool starts: "auto" (with the workers when the script
    # names launcher.runtime and the node has more CPUs than local ranks, else at the first
    # rank's hello), "workers", "hello"
    spare_start: str = "auto"
    # FTRUN_WORKER_START: how the node's ranks start: "auto" (forked from the node's fork server
    # when the script's source names torch), "fork" (whenever the fork server can be used),
    # "exec" (each its own `python -u script`)
    worker_start: str = "auto"
    # FTRUN_SPARE_IMPORTS: modules the spares import besides torch and those the ranks report
    spare_imports: list[str] = field(default_factory=list)
    # FTRUN_SPARE_LEARN: spares import the modules the ranks had loaded by their first step
    spare_learn: bool = True
    phase_timeout: float = 120.0  # FTRUN_PHASE_TIMEOUT: s each recovery phase may take

    @property
    def static_ranks(self) -> bool:
        return self.node_rank is not None

    @property
    def dynamic(self) -> bool:
        """torchrun's dynamic rendezvous (c10d, etcd, etcd-v2, parallel): ranks by arrival."""
        return self.rdzv_backend in DYNAMIC_BACKENDS

    def worker_command(self, local_rank: int) -> list[str]:
        """The argv of one worker: `python -u [-m] script args`, ${local_rank} substituted."""
        args = [a.replace("${local_rank}", str(local_rank)) for a in self.script_args]
        python = os.environ.get("PYTHON_EXEC", sys.executable)
        if self.run_path:  # torchrun runs the file with runpy (it takes precedence)
            return [
                python,
                "-u",
                "-c",
                "import runpy, sys; sys.argv = sys.argv[1:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')",
                self.script,
                *args,
            ]
        if self.no_python:
            return [self.script, *args]
        if self.module:
            return [python, "-u", "-m", self.script, *args]
        return [python, "-u", self.script, *args]

    def public(self) -> dict:
        """Every field as plain data for the logs and the event file, the job token left out."""
        out = dataclasses.asdict(self)
        out.pop("job_token", None)
        return out

    def describe(self) -> str:
        cmd = " ".join(shlex.quote(c) for c in self.worker_command(0))
        return (
            f"nnodes={self.min_nodes}:{self.max_nodes} nproc_per_node={self.nproc_per_node} "
            f"node_rank={self.node_rank} backend={self.rdzv_backend}->{self.store_backend} "
            f"max_restarts={self.max_restarts} monitor_interval={self.monitor_interval} "
            f"recover_strategy={','.join(self.recover_strategy)} cmd={cmd}"
        )


def parse_nnodes(value: str) -> tuple[int, int]:
    parts = str(value).split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--nnodes: {value!r} is not N or MIN:MAX (integers)") from None
    if not 0 < lo <= hi:
        raise ConfigError(f"--nnodes: {value!r} must satisfy 0 < MIN <= MAX")
    return lo, hi


def _accelerator_count(kind: str) -> int:
    """Number of accelerators of `kind` (gpu/xpu/npu/auto); imports torch only when asked."""
    import torch

    if kind in ("gpu", "auto") and torch.cuda.is_available():
        return torch.cuda.device_count()
    if kind in ("xpu", "auto") and hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.xpu.device_count()
    if kind in ("npu", "auto"):
        try:
            import torch_npu  # noqa: F401  (optional dependency)
        except ImportError:
            return 0
        return torch.npu.device_count()  # type: ignore[attr-defined]
    return 0


def resolve_nproc(value: str) -> int:
    v = str(value).strip()
    if v == "cpu":
        return os.cpu_count() or 1
    if v in ("gpu", "auto", "xpu", "npu"):
        n = _accelerator_count(v)
        if n > 0:
            return n
        if v == "auto":
            return os.cpu_count() or 1
        raise ConfigError(f"--nproc-per-node: {v!r} requested but no {v} device is available")
    try:
        n = int(v)
    except ValueError:
        raise ConfigError(
            f"--nproc-per-node: {v!r} is not a positive integer or one of cpu, gpu, xpu, npu, auto"
        ) from None
    if n < 1:
        raise ConfigError(f"--nproc-per-node: {n} must be >= 1")
    return n


def parse_std_map(flag: str, value: str, nproc: int) -> dict[int, int]:
    """torchrun's `--redirects`/`--tee` syntax: `0..3` for all ranks or `0:1,1:2` per rank."""
    v = str(value).strip()
    if v in ("0", "1", "2", "3"):
        return {r: int(v) for r in range(nproc)}
    out: dict[int, int] = {r: 0 for r in range(nproc)}
    try:
        for item in v.split(","):
            lr, s = item.split(":")
            if s not in ("0", "1", "2", "3"):
                raise ValueError
            out[int(lr)] = int(s)
    except ValueError:
        raise ConfigError(
            f"{flag}: {value!r} is not 0-3 or a map like 0:1,1:2 (1=stdout, 2=stderr, 3=both)"
        ) from None
    return out


def parse_rdzv_conf(value: str) -> dict[str, str]:
    out: dict[str, str] = {}
    if not value:
        return out
    for item in value.split(","):
        if not item.strip():
            continue
        if "=" not in item:
            raise ConfigError(f"--rdzv-conf: {item!r} is not key=value")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def parse_signals(value: str) -> list[int]:
    sigs = []
    for name in value.split(","):
        name = name.strip()
        if not name:
            continue
        sig = getattr(signal, name, None)
        if not isinstance(sig, signal.Signals) or name.startswith("SIG_"):
            raise ConfigError(f"--signals-to-handle: {name!r} is not a signal name (e.g. SIGTERM)")
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(f"--signals-to-handle: {name} cannot be handled")
        sigs.append(int(sig))
    return sigs


def parse_strategy(value: str) -> list[str]:
    items = [s.strip() for s in value.split(",") if s.strip()]
    aliases = {"recover": [plan.RECOVER_IN_PLACE], plan.ELASTIC: [plan.ELASTIC, plan.RESTART_ALL]}
    out: list[str] = []
    for s in items:
        if s not in plan.STRATEGIES and s not in aliases:
            raise ConfigError(
                f"--recover-strategy: {s!r} is not one of "
                f"{', '.join(plan.STRATEGIES)} (alias: recover)"
            )
        for one in aliases.get(s, [s]):  # elastic-training falls back to restart-all
            if one not in out:
                out.append(one)
    if not out:
        raise ConfigError("--recover-strategy: empty list")
    if plan.EXIT not in out:
        out.append(plan.EXIT)
    return out


def strategy_from_seed_env(env: dict[str, str]) -> tuple[str | None, list[str]]:
    """Map Ascend's HIGH_AVAILABILITY / PROCESS_RECOVER / ... variables onto a strategy chain.

    Returns (chain or None when none of them is set, log lines explaining the mapping)."""
    notes: list[str] = []
    ha = env.get("HIGH_AVAILABILITY", "").strip().lower()
    chain: list[str] | None = None
    if ha:
        mapping = {
            "retry": [plan.RETRY, plan.RECOVER_IN_PLACE, plan.RESTART_ALL],
            "recover": [plan.RECOVER_IN_PLACE, plan.RESTART_ALL],
            "dump": [plan.DUMP],
            "elastic-training": [plan.ELASTIC, plan.RESTART_ALL],
        }
        if ha not in mapping:
            raise ConfigError(f"HIGH_AVAILABILITY={ha!r} is not one of {', '.join(mapping)}")
        chain = list(mapping[ha])
        notes.append(f"HIGH_AVAILABILITY={ha} -> recover strategy {','.join(chain)}")
    flags = {k: env.get(k, "").strip().lower() for k in SEED_ENV_VARS[1:]}
    on = {k for k, v in flags.items() if v in ("1", "on", "true")}
    if on and chain is None:
        chain = [plan.RECOVER_IN_PLACE, plan.RESTART_ALL]
    if on:
        notes.append(f"{', '.join(sorted(on))} set -> process-level recovery enabled")
    if chain is not None:
        chain.append(plan.EXIT)
    return chain, notes


def port_is_free(host: str, port: int) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host if host not in ("localhost", "") else "127.0.0.1", port))
        return True
    except OSError:
        return False


# The words of an on/off setting (flags and --rdzv-conf keys read anything else as off, like
# torchrun; FTRUN_* switches refuse anything else: `parse_switch`).
ON_WORDS = ("1", "true", "yes", "on")
OFF_WORDS = ("0", "false", "no", "off")


def _truthy(v: str) -> bool:
    return str(v).strip().lower() in ON_WORDS


def build_config(raw: dict, env: dict[str, str] | None = None) -> LaunchConfig:
    """Resolve raw CLI values (click's dict, torchrun dest names) into a LaunchConfig.

    One named step per concern, in this order (the first bad value found is the one reported)."""
    env = dict(os.environ if env is None else env)
    cfg = _what_to_run(raw)
    _topology(cfg, raw)
    _supervision(cfg, raw, env)
    _recover_strategy(cfg, raw, env)
    _worker_logs(cfg, raw, env)
    _parity_flags(cfg, raw)
    _rendezvous(cfg, raw, env)
    _observation(cfg, env)
    cfg.node_replace_timeout = parse_replacement_wait(cfg.rdzv_conf, env, cfg.elastic_training)
    cfg.elastic_grow = parse_elastic_grow(cfg.rdzv_conf, env)
    cfg.subhealth_file = parse_subhealth_file(cfg.rdzv_conf, env)
    _store_backend(cfg)
    _standalone(cfg)
    if cfg.store_backend == "embedded":
        _embedded_store(cfg, raw)
    else:
        _etcd_node(cfg, raw)
    _proxy(cfg)
    _store_loop(cfg, env)
    _parity_notes(cfg)
    _spare_and_phases(cfg, env)
    return cfg


def _what_to_run(raw: dict) -> LaunchConfig:
    """The script (or module / executable) and its arguments."""
    script = raw.get("training_script")
    if not script:
        raise ConfigError("missing training script: ftrun [flags] SCRIPT [args...]")
    cfg = LaunchConfig(script=script, script_args=list(raw.get("training_script_args") or []))
    cfg.module = bool(raw.get("module"))
    cfg.no_python = bool(raw.get("no_python"))
    cfg.run_path = bool(raw.get("run_path"))
    if cfg.module and cfg.no_python:
        raise ConfigError("--no-python cannot be used with -m/--module")
    if cfg.run_path:
        # Script workers are always started with Popen; --run-path runs the file with runpy.
        cfg.notes.append("--run-path: the script is executed with runpy in each worker process")
    if not (cfg.module or cfg.no_python) and not os.path.exists(script):
        raise ConfigError(f"training script {script!r} does not exist")
    return cfg


def _topology(cfg: LaunchConfig, raw: dict) -> None:
    """--nnodes, --nproc-per-node, --role."""
    cfg.min_nodes, cfg.max_nodes = parse_nnodes(raw.get("nnodes", "1:1"))
    cfg.nproc_per_node = resolve_nproc(raw.get("nproc_per_node", "1"))
    cfg.role = raw.get("role") or "default"


def _supervision(cfg: LaunchConfig, raw: dict, env: dict[str, str]) -> None:
    """Restart budget, polling, shutdown grace, hang detection, forwarded signals."""
    cfg.max_restarts = int(raw.get("max_restarts", 0))
    if cfg.max_restarts < 0:
        raise ConfigError(f"--max-restarts: {cfg.max_restarts} must be >= 0")
    cfg.monitor_interval = float(raw.get("monitor_interval", 0.1))
    if not cfg.monitor_interval > 0:
        raise ConfigError(f"--monitor-interval: {cfg.monitor_interval} must be > 0 (seconds)")
    st = raw.get("shutdown_timeout")
    if st is None:
        st = env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", DEFAULT_SHUTDOWN_TIMEOUT)
    try:
        cfg.shutdown_timeout = float(st)
    except ValueError:
        raise ConfigError(f"--shutdown-timeout: {st!r} is not a number of seconds") from None
    if cfg.shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout: {st} must be >= 0")
    cfg.hang = parse_hang_policy(parse_hang_timeout(raw.get("hang_timeout")), env)
    cfg.death_notice = parse_death_notice(env.get(death_notice.ENV, ""))
    cfg.fault_window = parse_fault_window(env.get("FTRUN_FAULT_WINDOW", ""))
    cfg.warm_spares = parse_warm_spares(raw.get("warm_spares"), env)
    cfg.transfer_stripes = parse_transfer_stripes(env.get("FTRUN_TRANSFER_STRIPES", ""))
    cfg.signals_to_handle = parse_signals(
        raw.get("signals_to_handle") or "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    )


MAX_WARM_SPARES = 8


def parse_transfer_stripes(raw: str) -> int:
    """FTRUN_TRANSFER_STRIPES: `auto` (default; one sending replica per node, returned as
    `AUTO_STRIPES`) or how many replicas send one replacement its state, 1..MAX_STRIPES."""
    value = raw.strip().lower() or "auto"
    if value == "auto":
        return AUTO_STRIPES
    n = int(value) if value.isdigit() else 0
    if not 1 <= n <= MAX_STRIPES:
        raise ConfigError(
            f"FTRUN_TRANSFER_STRIPES={raw.strip()!r}: must be 'auto' (one sending "
            f"replica per node) or a whole number of sending replicas in "
            f"1..{MAX_STRIPES} (1: no striping)"
        )
    return n


def parse_warm_spares(value: object, env: dict[str, str]) -> int:
    """--warm-spares, else FTRUN_WARM_SPARES, else 0 when FTRUN_WARM_SPARE=0, else 2."""
    if value not in (None, ""):
        text = str(value).strip()
        name = f"--warm-spares: {text!r}"
    elif env.get("FTRUN_WARM_SPARES", "") != "":
        text = env["FTRUN_WARM_SPARES"].strip()
        name = f"FTRUN_WARM_SPARES={text!r}:"
    else:
        return 0 if env.get("FTRUN_WARM_SPARE", "1") == "0" else 2
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_WARM_SPARES:
        raise ConfigError(
            f"{name} must be a whole number of spare processes per node in 0..{MAX_WARM_SPARES}"
        )
    return n


def parse_hang_timeout(value: object) -> float | None:
    """--hang-timeout: "auto" (None: adaptive), 0 (off) or seconds > 0."""
    text = "auto" if value is None or value == "" else str(value).strip()
    if text.lower() == "auto":
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise ConfigError(
            f"--hang-timeout: {text!r} is not 'auto' or a number of seconds (0 = off)"
        ) from None
    if seconds < 0 or seconds != seconds or seconds == float("inf"):
        raise ConfigError(f"--hang-timeout: {text!r} must be 'auto', 0 (off) or seconds > 0")
    return seconds


# The FTRUN_HANG_* knobs of the automatic hang timeout: variable -> (HangPolicy field, default).
HANG_KNOBS = {
    "FTRUN_HANG_FLOOR": ("floor", DEFAULT_FLOOR),
    "FTRUN_HANG_MULTIPLIER": ("multiplier", DEFAULT_MULTIPLIER),
    "FTRUN_HANG_FIRST_STEP": ("first_step", DEFAULT_FIRST_STEP),
    "FTRUN_HANG_UNMODIFIED": ("unmodified", DEFAULT_UNMODIFIED),
    "FTRUN_HANG_STOP": ("stop_answer", DEFAULT_STOP_ANSWER),
}


def parse_hang_policy(timeout: float | None, env: dict[str, str]) -> HangPolicy:
    """The hang policy: `timeout` (--hang-timeout, from `parse_hang_timeout`) and the
    FTRUN_HANG_* knobs (seconds > 0; unset or empty: the default)."""
    knobs = {}
    for name, (attr, default) in HANG_KNOBS.items():
        knobs[attr] = _hang_knob(name, env.get(name, ""), default)
    return HangPolicy(timeout, **knobs)


def _hang_knob(name: str, raw: str, default: float) -> float:
    if raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not a number (hang detection knob, seconds)"
        ) from None
    if not value > 0:
        raise ConfigError(f"{name}={raw!r} must be > 0 (hang detection knob, seconds)")
    return value


def parse_switch(name: str, raw: str, default: bool) -> bool:
    """An on/off variable: 1/0 (also on/off, true/false, yes/no); unset or empty: `default`."""
    text = raw.strip().lower()
    if text == "":
        return default
    if text in ON_WORDS:
        return True
    if text in OFF_WORDS:
        return False
    raise ConfigError(
        f"{name}={raw!r}: must be 1 (on) or 0 (off) (also on/off, true/false, yes/no)"
    )


def parse_death_notice(raw: str) -> bool:
    """FTRUN_DEATH_NOTICE in ftrun's environment: 0 turns the early death notice off (default
    on). A worker's slot ("<path>:<offset>", which ftrun sets for its workers) inherited by an
    ftrun started inside a worker counts as unset."""
    path, sep, offset = raw.strip().rpartition(":")
    if sep and path and offset.isdigit():
        return True
    return parse_switch(death_notice.ENV, raw, True)


def _recover_strategy(cfg: LaunchConfig, raw: dict, env: dict[str, str]) -> None:
    """--recover-strategy, else the Ascend HIGH_AVAILABILITY variables, else the default."""
    strategy = raw.get("recover_strategy")
    seed_chain, seed_notes = strategy_from_seed_env(env)
    cfg.notes.extend(seed_notes)
    named = strategy.split(",") if strategy else [env.get("HIGH_AVAILABILITY", "")]
    cfg.elastic_training = ELASTIC_TRAINING in (s.strip().lower() for s in named)
    if strategy:
        cfg.recover_strategy = parse_strategy(strategy)
        if seed_chain:
            cfg.notes.append(
                "--recover-strategy given: it wins over the HIGH_AVAILABILITY variables"
            )
    elif seed_chain:
        cfg.recover_strategy = seed_chain
    else:
        cfg.recover_strategy = parse_strategy(DEFAULT_RECOVER_STRATEGY)


def _worker_logs(cfg: LaunchConfig, raw: dict, env: dict[str, str]) -> None:
    """Where worker output goes: redirects, tee, console filter, log dir, prefix, filters."""
    cfg.redirects = parse_std_map("--redirects", raw.get("redirects", "0"), cfg.nproc_per_node)
    cfg.tee = parse_std_map("--tee", raw.get("tee", "0"), cfg.nproc_per_node)
    lrf = raw.get("local_ranks_filter") or ""
    if lrf:
        try:
            cfg.local_ranks_filter = {int(x) for x in lrf.split(",") if x.strip()}
        except ValueError:
            raise ConfigError(
                f"--local-ranks-filter: {lrf!r} is not a comma list of integers"
            ) from None
    cfg.log_dir = raw.get("log_dir")
    cfg.log_line_prefix_template = (
        raw.get("log_line_prefix_template")
        or env.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
        or None
    )
    cfg.duplicate_stdout_filters = list(raw.get("duplicate_stdout_filters") or [])
    cfg.duplicate_stderr_filters = list(raw.get("duplicate_stderr_filters") or [])


def _parity_flags(cfg: LaunchConfig, raw: dict) -> None:
    """torchrun flags accepted for parity (noted at start where ftrun differs)."""
    cfg.start_method = raw.get("start_method") or "spawn"
    cfg.event_log_handler = raw.get("event_log_handler") or "null"
    cfg.logs_specs = raw.get("logs_specs")
    cfg.numa_binding = raw.get("numa_binding")
    cfg.virtual_local_rank = bool(raw.get("virtual_local_rank"))


def _rendezvous(cfg: LaunchConfig, raw: dict, env: dict[str, str]) -> None:
    """The rendezvous flags as given, and the timeouts and token file of --rdzv-conf."""
    cfg.rdzv_conf = parse_rdzv_conf(raw.get("rdzv_conf") or "")
    cfg.rdzv_backend = (raw.get("rdzv_backend") or "static").strip()
    cfg.rdzv_endpoint = (raw.get("rdzv_endpoint") or "").strip()
    cfg.rdzv_id = raw.get("rdzv_id") or "none"
    cfg.master_addr = raw.get("master_addr") or "127.0.0.1"
    mp = raw.get("master_port")
    cfg.master_port = None if mp in (None, "") else int(mp)
    if cfg.master_port is not None and not 0 <= cfg.master_port <= 65535:
        raise ConfigError(f"--master-port: {cfg.master_port} out of range 0-65535")
    cfg.local_addr = raw.get("local_addr")
    cfg.standalone = bool(raw.get("standalone"))
    tiered = raw.get("enable_tiered_parallel_tcpstore")
    cfg.enable_tiered_store = _truthy(tiered) if tiered is not None else False
    try:
        cfg.rdzv_settings = RendezvousSettings.from_rdzv_conf(cfg.rdzv_conf)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    cfg.join_timeout = cfg.rdzv_settings.join_timeout
    cfg.last_call_timeout = cfg.rdzv_settings.last_call_timeout
    cfg.token_file = cfg.rdzv_conf.get("token_file")
    cfg.job_token = parse_job_token(cfg.token_file, env)


def parse_job_token(token_file: str | None, env: dict[str, str]) -> str | None:
    """The job token from `--rdzv-conf token_file=F` (a private file) or FTRUN_JOB_TOKEN (unset:
    None, the store takes any client); a bad one is a ConfigError naming its source."""
    try:
        return auth.resolve_token(token_file, env)
    except auth.TokenError as e:
        source = f"--rdzv-conf token_file={token_file}" if token_file else auth.TOKEN_ENV
        raise ConfigError(f"{source}: {e}") from None


def _observation(cfg: LaunchConfig, env: dict[str, str]) -> None:
    """What the agent's observer publishes: the metrics port and the progress records' pace."""
    cfg.metrics_port = parse_metrics_port(cfg.rdzv_conf, env)
    cfg.progress_interval = parse_progress_interval(env.get("FTRUN_PROGRESS_INTERVAL", ""))


def parse_fault_window(raw: str) -> float:
    """FTRUN_FAULT_WINDOW: seconds the controller holds a possible consequence (another rank's
    error in the same collective) for its cause, 0..60; unset or empty: the default (2)."""
    text = raw.strip()
    if not text:
        return LaunchConfig.fault_window
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 60:
        raise ConfigError(f"FTRUN_FAULT_WINDOW={raw!r}: must be seconds in 0..60")
    return seconds


def parse_metrics_port(conf: dict[str, str], env: dict[str, str]) -> int | None:
    """`--rdzv-conf metrics_port=PORT`, else FTRUN_METRICS_PORT; 0 = any free port; None (no
    metrics) when neither is set."""
    if "metrics_port" in conf:
        raw, where = conf["metrics_port"], "--rdzv-conf metrics_port"
    elif env.get("FTRUN_METRICS_PORT", "") != "":
        raw, where = env["FTRUN_METRICS_PORT"], "FTRUN_METRICS_PORT"
    else:
        return None
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ConfigError(f"{where}={raw!r}: must be a port number 0-65535 (0 = any free port)")
    return port


def parse_progress_interval(raw: str) -> float:
    """FTRUN_PROGRESS_INTERVAL: seconds between `progress` records (default 5)."""
    text = raw.strip() or "5"
    try:
        interval = float(text)
    except ValueError:
        interval = -1.0
    if not (math.isfinite(interval) and interval > 0):
        raise ConfigError(f"FTRUN_PROGRESS_INTERVAL={raw!r}: must be seconds > 0")
    return interval


ELASTIC_TRAINING = "elastic-training"
WAIT_RESCHEDULE_RANGE = (30.0, 270.0)  # the Ascend guide's range for wait-reschedule-timeout
WAIT_RESCHEDULE_DEFAULT = 270.0  # its default
NODE_REPLACE_DEFAULT = 600.0


def parse_replacement_wait(conf: dict[str, str], env: dict[str, str], elastic: bool) -> float:
    """How long a lost node's ranks wait for a hot spare or a replacement agent before the world
    shrinks (or the job falls back). Two names for this one wait: ftrun's node_replace_timeout
    (seconds > 0) and the Ascend guide's wait_reschedule_timeout (30 to 270 s), each as
    `--rdzv-conf KEY=S` or its variable (FTRUN_NODE_REPLACE_TIMEOUT,
    FTRUN_WAIT_RESCHEDULE_TIMEOUT). A flag wins over a variable; both names at the same level is
    a ConfigError. Default: 270 s with elastic-training asked for (the guide's), else 600 s."""
    rescheduled = _wait_reschedule_source(conf, env)
    replaced = _node_replace_source(conf, env)
    if rescheduled and replaced and rescheduled[2] == replaced[2]:
        raise ConfigError(
            f"{rescheduled[0]} and {replaced[0]} name the same wait (for a replacement before "
            "the world shrinks): give one"
        )
    if rescheduled and (not replaced or rescheduled[2] == "flag"):
        return parse_wait_reschedule_timeout(conf, env)
    if replaced:
        return parse_node_replace_timeout(conf, env)
    return WAIT_RESCHEDULE_DEFAULT if elastic else NODE_REPLACE_DEFAULT


def _wait_reschedule_source(conf: dict[str, str], env: dict[str, str]) -> tuple | None:
    """(name, text, "flag" or "env") of wait_reschedule_timeout, or None when not given."""
    if conf.get("wait_reschedule_timeout") not in (None, ""):
        return ("--rdzv-conf wait_reschedule_timeout", conf["wait_reschedule_timeout"], "flag")
    if env.get("FTRUN_WAIT_RESCHEDULE_TIMEOUT") not in (None, ""):
        return ("FTRUN_WAIT_RESCHEDULE_TIMEOUT", env["FTRUN_WAIT_RESCHEDULE_TIMEOUT"], "env")
    return None


def _node_replace_source(conf: dict[str, str], env: dict[str, str]) -> tuple | None:
    """(name, text, "flag" or "env") of node_replace_timeout, or None when not given."""
    if conf.get("node_replace_timeout") not in (None, ""):
        return ("--rdzv-conf node_replace_timeout", conf["node_replace_timeout"], "flag")
    if env.get("FTRUN_NODE_REPLACE_TIMEOUT") not in (None, ""):
        return ("FTRUN_NODE_REPLACE_TIMEOUT", env["FTRUN_NODE_REPLACE_TIMEOUT"], "env")
    return None


def parse_elastic_grow(conf: dict[str, str], env: dict[str, str]) -> bool:
    """Whether the world grows back live after a live shrink (elastic-training): `--rdzv-conf
    elastic_grow=0|1`, else FTRUN_ELASTIC_GROW; on by default. A flag wins over the variable;
    a value that is no switch is a ConfigError naming it."""
    if conf.get("elastic_grow") not in (None, ""):
        name, text = "--rdzv-conf elastic_grow", conf["elastic_grow"]
    else:
        name, text = "FTRUN_ELASTIC_GROW", env.get("FTRUN_ELASTIC_GROW", "")
    return parse_switch(name, text, default=True)


def parse_subhealth_file(conf: dict[str, str], env: dict[str, str]) -> str:
    """This node's sub-health file (launcher.agent.subhealth): `--rdzv-conf
    subhealth_file=PATH`, else FTRUN_SUBHEALTH_FILE; "" for none. The file may appear later,
    its directory must exist: else a ConfigError naming the source."""
    if conf.get("subhealth_file") not in (None, ""):
        name, path = "--rdzv-conf subhealth_file", conf["subhealth_file"]
    else:
        name, path = "FTRUN_SUBHEALTH_FILE", env.get("FTRUN_SUBHEALTH_FILE", "")
    path = path.strip()
    if not path:
        return ""
    where = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(where) or os.path.isdir(path):
        raise ConfigError(
            f"{name}={path!r}: a file path whose directory exists is allowed ({where} is no "
            "directory)"
            if not os.path.isdir(where)
            else f"{name}={path!r}: a file path is allowed (this is a directory)"
        )
    return os.path.abspath(path)


def parse_wait_reschedule_timeout(conf: dict[str, str], env: dict[str, str]) -> float:
    """The Ascend guide's wait-reschedule-timeout: `--rdzv-conf wait_reschedule_timeout=S`, else
    FTRUN_WAIT_RESCHEDULE_TIMEOUT; seconds from 30 to 270. ConfigError names the key."""
    found = _wait_reschedule_source(conf, env)
    if found is None:
        return WAIT_RESCHEDULE_DEFAULT
    name, text, _ = found
    try:
        value = float(str(text).strip())
    except ValueError:
        value = float("nan")
    low, high = WAIT_RESCHEDULE_RANGE
    if not (math.isfinite(value) and low <= value <= high):
        raise ConfigError(
            f"{name}={text!r}: must be seconds from {low:g} to {high:g} (the Ascend guide's "
            "wait-reschedule-timeout: how long a lost node waits for a replacement before the "
            "world shrinks)"
        )
    return value


def parse_node_replace_timeout(conf: dict[str, str], env: dict[str, str]) -> float:
    """How long a lost node's ranks wait for a hot spare or a replacement agent before the
    controller falls back: `--rdzv-conf node_replace_timeout=S`, else FTRUN_NODE_REPLACE_TIMEOUT,
    else 600 s. ConfigError names the key and what is allowed."""
    if conf.get("node_replace_timeout") not in (None, ""):
        name, text = "--rdzv-conf node_replace_timeout", conf["node_replace_timeout"]
    elif env.get("FTRUN_NODE_REPLACE_TIMEOUT") not in (None, ""):
        name, text = "FTRUN_NODE_REPLACE_TIMEOUT", env["FTRUN_NODE_REPLACE_TIMEOUT"]
    else:
        return 600.0
    try:
        value = float(str(text).strip())
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(
            f"{name}={text!r}: must be a number of seconds > 0 (how long a lost "
            "node's ranks wait for a hot spare or a replacement agent)"
        )
    return value


def _store_backend(cfg: LaunchConfig) -> None:
    """Map --rdzv-backend onto the store ftrun runs: embedded, or etcd (endpoints checked)."""
    backend = cfg.rdzv_backend
    if backend in ETCD_BACKENDS:
        cfg.store_backend = "etcd"
        if backend == "etcd-v2":
            cfg.notes.append(
                "--rdzv-backend etcd-v2 is served by the etcd v3 API (etcd 3.6 dropped v2)"
            )
        if not cfg.rdzv_endpoint:
            raise ConfigError(
                f"--rdzv-endpoint is required with --rdzv-backend {backend} "
                "(host[:port][,host[:port]...])"
            )
        try:
            parse_endpoints(cfg.rdzv_endpoint, ETCD_DEFAULT_PORT, what="--rdzv-endpoint")
        except EndpointError as e:
            raise ConfigError(str(e)) from None
    elif backend in EMBEDDED_BACKENDS:
        cfg.store_backend = "embedded"
    else:
        raise ConfigError(
            f"--rdzv-backend: {backend!r} is not one of "
            f"{', '.join(sorted(EMBEDDED_BACKENDS | ETCD_BACKENDS))}"
        )


def _standalone(cfg: LaunchConfig) -> None:
    if cfg.standalone:
        if cfg.max_nodes != 1 or cfg.min_nodes != 1:
            raise ConfigError("--standalone runs a single node; drop --nnodes or set it to 1")
        cfg.rdzv_id = str(uuid.uuid4())
        cfg.notes.append(f"--standalone: local store on a free port, run id {cfg.rdzv_id}")


def _embedded_store(cfg: LaunchConfig, raw: dict) -> None:
    """Where the embedded store lives, this node's rank, and whether this node hosts it."""
    auto_single = (
        cfg.rdzv_backend == "static"
        and not cfg.rdzv_endpoint
        and cfg.master_port is None
        and cfg.max_nodes == 1
    )
    if cfg.standalone or auto_single:
        # torchrun's single-node auto-switch: a private store on a free port.
        cfg.store_host, cfg.store_port = "127.0.0.1", 0
        cfg.master_addr_for_workers = "localhost"
        if cfg.rdzv_id == "none":
            cfg.rdzv_id = str(uuid.uuid4())
        cfg.node_rank = 0
    elif cfg.rdzv_backend == "static" or not cfg.rdzv_endpoint:
        cfg.store_host = cfg.master_addr
        cfg.store_port = DEFAULT_MASTER_PORT if cfg.master_port is None else cfg.master_port
        cfg.master_addr_for_workers = cfg.master_addr
        cfg.node_rank = _node_rank(cfg, raw)
    else:
        cfg.store_host, cfg.store_port = _rdzv_endpoint(cfg.rdzv_endpoint)
        cfg.master_addr_for_workers = cfg.store_host
        cfg.node_rank = _node_rank(cfg, raw)
    if cfg.node_rank is not None and not 0 <= cfg.node_rank < cfg.max_nodes:
        raise ConfigError(f"--node-rank: {cfg.node_rank} must be in 0..{cfg.max_nodes - 1}")
    if cfg.node_rank is not None:
        cfg.is_store_host = cfg.node_rank == 0
    elif cfg.max_nodes == 1:
        cfg.is_store_host = True
    else:
        try:  # torchrun's is_host rule: --rdzv-conf is_host, else the endpoint is local
            cfg.is_store_host = wants_to_host(cfg.store_host, cfg.rdzv_conf)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # a busy port: joined as a client when it is this run's store (rendezvous.nodes.hosting)
        return
    if cfg.is_store_host and cfg.store_port and not port_is_free("0.0.0.0", cfg.store_port):
        raise ConfigError(f"--master-port: port {cfg.store_port} is already in use on this host")


def _node_rank(cfg: LaunchConfig, raw: dict) -> int | None:
    """--node-rank for the static backend; None (ranks by arrival) for the dynamic ones."""
    given = int(raw.get("node_rank") or 0)
    if not cfg.dynamic:
        return given
    if given != 0:
        cfg.notes.append(
            f"--node-rank {given} is only used for the static rendezvous backend; "
            f"it is ignored with --rdzv-backend {cfg.rdzv_backend} (node ranks "
            "come from the rendezvous, in arrival order)"
        )
    return None


def _rdzv_endpoint(value: str) -> tuple[str, int]:
    """The embedded store's one `--rdzv-endpoint` (port 29400 by default; 0 = a free port)."""
    try:
        ep = parse_endpoint(value, DEFAULT_C10D_PORT, what="--rdzv-endpoint", min_port=0)
    except EndpointError as e:
        raise ConfigError(str(e)) from None
    return ep.host, ep.port


def _etcd_node(cfg: LaunchConfig, raw: dict) -> None:
    """With etcd every node is a store client; node ranks come from the rendezvous."""
    cfg.node_rank = _node_rank(cfg, raw)
    cfg.is_store_host = False


def _proxy(cfg: LaunchConfig) -> None:
    """The per-node store proxy: on for several nodes, etcd or the tiered flag; proxy= wins."""
    proxy_conf = cfg.rdzv_conf.get("proxy")
    if proxy_conf is not None:
        cfg.proxy = _truthy(proxy_conf)
    else:
        cfg.proxy = cfg.max_nodes > 1 or cfg.store_backend == "etcd" or cfg.enable_tiered_store
    if cfg.store_backend == "etcd" and not cfg.proxy:
        raise ConfigError(
            "--rdzv-conf proxy=false is not possible with etcd: unmodified workers "
            "speak TCPStore, which only the per-node proxy translates to etcd"
        )


def _store_loop(cfg: LaunchConfig, env: dict[str, str]) -> None:
    """FTRUN_STORE_NICE: the nice value of the hosted store's loop thread (not the proxy's);
    FTRUN_STORE_ACCEL: whether the store and the proxy use their C read paths (when built)."""
    try:
        cfg.store_nice = loop_nice(env)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    cfg.store_accel = parse_switch("FTRUN_STORE_ACCEL", env.get("FTRUN_STORE_ACCEL", ""), True)


def _parity_notes(cfg: LaunchConfig) -> None:
    if cfg.enable_tiered_store:
        cfg.notes.append("--enable_tiered_parallel_tcpstore: per-node store proxies on")
    if cfg.event_log_handler != "null":
        cfg.notes.append(
            f"--event-log-handler {cfg.event_log_handler}: ftrun writes events.jsonl instead"
        )
    if cfg.numa_binding:
        cfg.notes.append(
            f"--numa-binding {cfg.numa_binding}: accepted; binding is left to the OS on CPU"
        )


# ---------------------------------------------------------------- spare pool and agent phases
DEFAULT_PHASE_TIMEOUT = LaunchConfig.phase_timeout  # the field's default


def _spare_and_phases(cfg: LaunchConfig, env: dict[str, str]) -> None:
    """FTRUN_SPARE_FORK, FTRUN_SPARE_START, FTRUN_WORKER_START, FTRUN_SPARE_IMPORTS,
    FTRUN_SPARE_LEARN and FTRUN_PHASE_TIMEOUT. (FTRUN_SPARE_NICE was no user setting but the
    warm-up priority the agent handed a spare or the fork server: now in their command line,
    `launcher.workers.spare_process.nice_args`.)"""
    # 1 (default): warm spares are forked from one fork server per node that imported torch
    # once; 0: each spare imports torch itself
    cfg.spare_fork = parse_switch("FTRUN_SPARE_FORK", env.get("FTRUN_SPARE_FORK", ""), True)
    cfg.spare_start = parse_spare_start(env.get("FTRUN_SPARE_START", ""))
    cfg.worker_start = parse_worker_start(env.get("FTRUN_WORKER_START", ""))
    cfg.spare_imports = parse_spare_imports(env.get("FTRUN_SPARE_IMPORTS", ""))
    cfg.spare_learn = parse_switch("FTRUN_SPARE_LEARN", env.get("FTRUN_SPARE_LEARN", ""), True)
    cfg.phase_timeout = parse_phase_timeout(env.get("FTRUN_PHASE_TIMEOUT", ""))


SPARE_STARTS = ("auto", "workers", "hello")
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def parse_choice(name: str, raw: str, choices: tuple[str, ...], meaning: str) -> str:
    """A variable that names one of `choices` (case-insensitive; unset or empty: the first);
    anything else is a ConfigError naming it, the choices and their `meaning`."""
    value = raw.strip().lower() or choices[0]
    if value not in choices:
        raise ConfigError(f"{name}={raw!r}: must be one of {', '.join(choices)} ({meaning})")
    return value


def parse_spare_start(raw: str) -> str:
    """FTRUN_SPARE_START: when the node's spare pool starts (default auto)."""
    return parse_choice(
        "FTRUN_SPARE_START",
        raw,
        SPARE_STARTS,
        "auto: with the workers when the script names launcher.runtime and a CPU is free beside "
        "the ranks, else at the first rank's hello",
    )


WORKER_STARTS = ("auto", "fork", "exec")


def parse_worker_start(raw: str) -> str:
    """FTRUN_WORKER_START: how the node's ranks start (default auto)."""
    return parse_choice(
        "FTRUN_WORKER_START",
        raw,
        WORKER_STARTS,
        "auto: forked from the node's fork server when the script's source imports torch; fork: "
        "whenever the fork server can be used; exec: each rank its own `python -u script`",
    )


def parse_spare_imports(raw: str) -> list[str]:
    """FTRUN_SPARE_IMPORTS: comma-separated module names (e.g. megatron.core,transformers)."""
    names = [n.strip() for n in raw.split(",") if n.strip()]
    for name in names:
        if not _MODULE_NAME.fullmatch(name):
            raise ConfigError(
                f"FTRUN_SPARE_IMPORTS={raw!r}: {name!r} is not a module name (comma-separated "
                "dotted names, e.g. megatron.core,transformers)"
            )
    return names


def parse_phase_timeout(raw: str) -> float:
    """FTRUN_PHASE_TIMEOUT: seconds each recovery phase may take before the controller falls
    back (default 120)."""
    value = raw.strip()
    if not value:
        return DEFAULT_PHASE_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ConfigError(
            f"FTRUN_PHASE_TIMEOUT={value!r}: must be a number of seconds > 0 (default "
            f"{DEFAULT_PHASE_TIMEOUT:g})"
        )
    return seconds
