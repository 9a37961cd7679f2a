"""The node agent: hosts or joins the store, spawns and supervises this node's workers.

Owns: the life of one node's part of a job. It joins the node-level rendezvous, hosts the
embedded store (leader) or connects to it, starts the per-node store proxy, spawns one worker per
local rank with torchrun's environment plus `FTRUN_*`, and then reacts to events: a worker exit
(seen at once by the reaper), a message from a runtime-aware worker, a new plan from the
controller, a signal. It executes plans (stop/respawn single ranks, restart all, exit) and prints
the failure summary. Decisions are not made here: faults go to the controller.
"""
from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field

from launcher import plan as P
from launcher.channel import ChannelMessage, ChannelServer
from launcher.config import LaunchConfig
from launcher.controller import Controller, post_fault
from launcher.errors import (Failure, copy_root_error_file, failure_from_exit, format_summary,
                             root_cause)
from launcher.fault_memory import FaultMemory
from launcher.faults import FaultKind
from launcher.inject import carry_out
from launcher.messages import Bye, FaultReport, Heartbeat, Hello, Recovered, Stop
from launcher.logs import AgentLog, RunLogDir, render_prefix
from launcher.observer import NodeObserver
from launcher.spare import SparePool
from launcher.workers import Reaper, Worker, WorkerExit, send_signal, spawn, stop_workers
from rendezvous import auth
from rendezvous.kv import KVStore, StoreError

UNTIMED_PHASES = {"init", "recovering", "checkpoint", "done"}


@dataclass
class PlanEvent:
    plan: P.Plan


@dataclass
class InjectEvent:
    injection: P.Injection


@dataclass
class SignalEvent:
    signum: int


@dataclass
class AgentWorld:
    """What this agent knows of the job after node-level rendezvous."""

    group_rank: int
    group_world_size: int
    rank_base: int
    world_size: int
    is_leader: bool


class JobFailed(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


@dataclass
class Agent:
    cfg: LaunchConfig
    log: AgentLog = field(init=False)
    events: "queue.Queue[object]" = field(default_factory=queue.Queue)
    workers: dict[int, Worker] = field(default_factory=dict)
    generation: int = 0
    failures: list[Failure] = field(default_factory=list)
    terminated: list[tuple[int, int]] = field(default_factory=list)
    root_fault: P.Fault | None = None

    def __post_init__(self) -> None:
        cfg = self.cfg
        self.host = socket.gethostname()
        self.run_dir = RunLogDir.create(cfg.log_dir, cfg.rdzv_id)
        self.log = AgentLog(cfg.node_rank, self.run_dir.events_path)
        self.observer: NodeObserver | None = None  # status, progress records, metrics
        self._console_lock = threading.Lock()
        self._stop = threading.Event()
        self._server = None
        self._proxy = None
        self._membership = None
        self.kv: KVStore | None = None
        self.controller: Controller | None = None
        self.channel: ChannelServer | None = None
        self.reaper: Reaper | None = None
        self._sock_dir = tempfile.mkdtemp(prefix="ftrun-")
        self._watch_thread: threading.Thread | None = None
        self._last_progress: dict[int, float] = {}
        self._hang_killed: set[int] = set()
        self._waiting: dict[int, bool] = {}  # rank -> its last heartbeat says: inside a collective
        self._aware: set[int] = set()
        self._pending_stop: dict[int, Stop] = {}
        self.rejoined = False
        self.spares = None
        if os.environ.get("FTRUN_WARM_SPARE", "1") != "0" and not cfg.no_python:
            self.spares = SparePool(os.environ.get("PYTHON_EXEC", sys.executable),
                                    lambda m: self.log.info("spare", m))
        self._progress: dict[int, tuple] = {}
        self._inject_thread: threading.Thread | None = None
        self.fault_memory = FaultMemory(os.path.join(cfg.log_dir or self.run_dir.path,
                                                     "fault_memory.json"))

    # ------------------------------------------------------------------ store and rendezvous
    def _etcd_kv(self) -> KVStore:
        """A client of the job's etcd store (the agent's own, and each proxy upstream link)."""
        from rendezvous.etcd import EtcdConf, EtcdKV, parse_endpoints  # imports gRPC: only for etcd

        cfg = self.cfg
        return EtcdKV(parse_endpoints(cfg.rdzv_endpoint), root=f"/ftrun/{cfg.rdzv_id}",
                      conf=EtcdConf.from_rdzv_conf(cfg.rdzv_conf))

    def _setup_store(self) -> None:
        cfg = self.cfg
        token = auth.resolve_token(cfg.token_file)
        if cfg.store_backend == "etcd":
            # The agent forks workers while gRPC threads run; gRPC's fork handlers only warn.
            os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
            self.kv = self._etcd_kv()
            self.log.info("store", f"etcd store at {cfg.rdzv_endpoint} (run {cfg.rdzv_id})")
        elif cfg.is_store_host:
            from rendezvous.server import StoreServer

            if cfg.proxy and token is None and cfg.max_nodes == 1:
                token = auth.generate_token()  # only this agent and its proxy need it
            if cfg.proxy and token is None:
                self.log.warning("store-auth", "no job token (FTRUN_JOB_TOKEN or --rdzv-conf "
                                 "token_file=...): the store port accepts any client")
            host = "127.0.0.1" if cfg.store_port == 0 else "0.0.0.0"
            self._server = StoreServer(host=host, port=cfg.store_port,
                                       token=token if cfg.proxy else None)
            self._server.start()
            self.kv = self._server.kv
            self.log.info("store", f"hosting the store on {host}:{self._server.port}"
                          + (" (token required)" if cfg.proxy and token else ""),
                          port=self._server.port)
        else:
            from rendezvous.client import StoreClient

            self.kv = StoreClient(cfg.store_host, cfg.store_port, token=token,
                                  timeout=cfg.join_timeout)
            self.log.info("store", f"using the store at {cfg.store_host}:{cfg.store_port}")
        self._token_value = token

    def store_port(self) -> int:
        if self._server is not None:
            return int(self._server.port)
        return self.cfg.store_port

    def _setup_proxy(self) -> tuple[str, int]:
        """Start the per-node proxy when enabled; return the MASTER_ADDR/PORT workers get."""
        cfg = self.cfg
        if not cfg.proxy:
            return cfg.master_addr_for_workers, self.store_port()
        from rendezvous.proxy import StoreProxy

        if cfg.store_backend == "etcd":
            self._proxy = StoreProxy(self._etcd_kv, listen_host="127.0.0.1", port=0)
        else:
            host = "127.0.0.1" if self._server is not None else cfg.store_host
            self._proxy = StoreProxy((host, self.store_port(), self._token_value),
                                     listen_host="127.0.0.1", port=0)
        self._proxy.start()
        self.log.info("proxy", f"store proxy for local workers on 127.0.0.1:{self._proxy.port}")
        return "127.0.0.1", int(self._proxy.port)

    def _rendezvous(self) -> AgentWorld:
        cfg = self.cfg
        assert self.kv is not None
        if cfg.max_nodes == 1 and cfg.store_backend == "embedded":
            return AgentWorld(0, 1, 0, cfg.nproc_per_node, True)
        from rendezvous.membership import Membership

        self._membership = Membership(
            self.kv, node_rank=cfg.node_rank, nnodes_min=cfg.min_nodes, nnodes_max=cfg.max_nodes,
            local_world_size=cfg.nproc_per_node, host=cfg.local_addr or self.host,
            run_id=cfg.rdzv_id, join_timeout=cfg.join_timeout,
            last_call_timeout=cfg.last_call_timeout)
        raw = self.kv.try_get(P.GENERATION_KEY)
        self._generation_before_join = int(raw) if raw is not None else 0
        w = self._membership.join(timeout=cfg.join_timeout)
        self._membership.start_heartbeat()
        self._membership.watch_nodes(self._on_node_dead, self._on_node_join)
        self.rejoined = bool(w.rejoined)
        return AgentWorld(w.group_rank, w.group_world_size, w.nodes[w.group_rank].rank_base,
                         w.world_size, w.leader_node == w.group_rank)

    def _on_node_join(self, node: int) -> None:
        self._on_node_joined(node)

    def _on_node_dead(self, node: int) -> None:
        """Membership thread: handled here, not in the main loop, which may be waiting on a
        round that this very death holds up."""
        self._on_node_lost(node)

    # ------------------------------------------------------------------ workers
    def worker_env(self, w: Worker, replacement: bool) -> dict[str, str]:
        cfg, world = self.cfg, self.world
        env = dict(os.environ)
        env.update({
            "RANK": str(w.rank),
            "LOCAL_RANK": "0" if cfg.virtual_local_rank else str(w.local_rank),
            "WORLD_SIZE": str(world.world_size),
            "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node),
            "GROUP_RANK": str(world.group_rank),
            "GROUP_WORLD_SIZE": str(world.group_world_size),
            "ROLE_NAME": cfg.role,
            "ROLE_RANK": str(w.rank),
            "ROLE_WORLD_SIZE": str(world.world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(w.generation),
            "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts),
            "TORCHELASTIC_RUN_ID": cfg.rdzv_id,
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "TORCHELASTIC_ERROR_FILE": w.error_file,
            "TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(signal.Signals(s).name
                                                       for s in cfg.signals_to_handle),
            "FTRUN_AGENT_SOCKET": self.channel.path if self.channel else "",
            "FTRUN_GENERATION": str(w.generation),
            "FTRUN_REPLACEMENT": "1" if replacement else "0",
            "FTRUN_RUN_ID": cfg.rdzv_id,
            "FTRUN_NODE_RANK": str(world.group_rank),
            "FTRUN_LOG_DIR": self.run_dir.path,
            "FTRUN_MONITOR_INTERVAL": str(cfg.monitor_interval),
        })
        if cfg.virtual_local_rank and "CUDA_VISIBLE_DEVICES" not in os.environ:
            env["CUDA_VISIBLE_DEVICES"] = str(w.local_rank)
        if "OMP_NUM_THREADS" not in os.environ and cfg.nproc_per_node > 1:
            env["OMP_NUM_THREADS"] = "1"
        return env

    def spawn_worker(self, w: Worker, generation: int, replacement: bool) -> None:
        cfg = self.cfg
        w.generation = generation
        d = self.run_dir.rank_dir(generation, w.local_rank)
        w.error_file = os.path.join(d, "error.json")
        red, tee = cfg.redirects.get(w.local_rank, 0), cfg.tee.get(w.local_rank, 0)
        shown = cfg.local_ranks_filter is None or w.local_rank in cfg.local_ranks_filter
        out_file = os.path.join(d, "stdout.log") if (red | tee) & 1 else None
        err_file = os.path.join(d, "stderr.log") if (red | tee) & 2 else None
        prefix = render_prefix(cfg.log_line_prefix_template, cfg.role, w.local_rank, w.rank, self.host)
        cmd = cfg.worker_command(w.local_rank)
        if not shown:  # --local-ranks-filter: this rank's output stays off the console
            out_file, err_file = out_file or os.devnull, err_file or os.devnull
        attempt = self.run_dir.attempt_dir(generation)
        env = self.worker_env(w, replacement)
        if replacement and self._spawn_from_spare(w, cmd, env, inherit=not (red or tee) and shown):
            return
        spawn(w, cmd, env, out_file, err_file,
              tee_out=bool(tee & 1) and shown, tee_err=bool(tee & 2) and shown, prefix=prefix,
              console_lock=self._console_lock,
              filters=(cfg.duplicate_stdout_filters, cfg.duplicate_stderr_filters),
              filtered=(os.path.join(attempt, "filtered_stdout.log"),
                        os.path.join(attempt, "filtered_stderr.log")))
        self._watch_new(w)
        self.log.info("spawn", f"rank {w.rank} (local {w.local_rank}) started, pid {w.pid}"
                      + (" as replacement" if replacement else ""), rank=w.rank,
                      local_rank=w.local_rank, pid=w.pid, generation=generation,
                      replacement=replacement)

    def _watch_new(self, w: Worker) -> None:
        """A rank got a new process: watch its exit, restart its progress clock."""
        assert self.reaper is not None
        self.reaper.watch(w)
        self._last_progress.pop(w.rank, None)
        self._progress.pop(w.rank, None)

    def _spawn_from_spare(self, w: Worker, cmd: list[str], env: dict[str, str], inherit: bool) -> bool:
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
        self._watch_new(w)
        self.log.info("spawn", f"rank {w.rank} (local {w.local_rank}) started from the warm spare, "
                      f"pid {w.pid}, as replacement", rank=w.rank, local_rank=w.local_rank, pid=w.pid,
                      generation=w.generation, replacement=True, warm=True)
        return True

    def _keep_spare(self) -> None:
        """One warm spare per node once the job uses the runtime (unmodified jobs pay nothing)."""
        if self.spares is None or not self._aware:
            return
        w = next(iter(self.workers.values()))
        env = self.worker_env(w, replacement=True)
        self.spares.ensure(env)

    def spawn_all(self, generation: int) -> None:
        for w in self.workers.values():
            self.spawn_worker(w, generation, replacement=False)

    # ------------------------------------------------------------------ main
    def run(self) -> int:
        cfg = self.cfg
        self.log.info("start", f"ftrun {cfg.describe()}", config=dataclasses.asdict(cfg))
        for note in cfg.notes:
            self.log.info("note", note)
        if "OMP_NUM_THREADS" not in os.environ and cfg.nproc_per_node > 1:
            self.log.warning("omp", "Setting OMP_NUM_THREADS environment variable for each process "
                             "to be 1 in default, to avoid your system being overloaded, please "
                             "further tune the variable for optimal performance in your "
                             "application as needed.")
        self._install_signals()
        try:
            self.observer = NodeObserver.start(cfg, self.log, self.run_dir.path)
            self._setup_store()
            self.world = self._rendezvous()
            self.log.node_rank = self.world.group_rank
            self.master_addr, self.master_port = self._setup_proxy()
            self.log.info("rendezvous", f"node {self.world.group_rank}/{self.world.group_world_size}, "
                          f"ranks {self.world.rank_base}..{self.world.rank_base + cfg.nproc_per_node - 1} "
                          f"of {self.world.world_size}; workers use store "
                          f"{self.master_addr}:{self.master_port}; logs in {self.run_dir.path}",
                          group_rank=self.world.group_rank, world_size=self.world.world_size,
                          master_port=self.master_port, log_dir=self.run_dir.path)
            assert self.kv is not None
            self._publish_store_address()
            self.observer.attach(self.kv, self.world.group_rank, self.world.is_leader,
                                 self._server.stats.copy if self._server is not None else None)
            if self.rejoined:
                # Plans published from the moment it joined concern it: the leader starts a
                # round for its arrival, possibly before join() returned.
                self.generation = self._generation_before_join
            else:
                raw = self.kv.try_get(P.GENERATION_KEY)
                self.generation = int(raw) if raw is not None else 0
            self.log.generation = self.generation
            if self.world.is_leader:
                self.controller = Controller(self.kv, self.log, self.world.world_size,
                                             self.world.group_world_size, cfg.max_restarts,
                                             cfg.recover_strategy,
                                             phase_timeout=float(os.environ.get("FTRUN_PHASE_TIMEOUT", 120)))
                self.controller.start()
            self.channel = ChannelServer(os.path.join(self._sock_dir, "agent.sock"), self.events)
            self.reaper = Reaper(self.events)
            for lr in range(cfg.nproc_per_node):
                self.workers[lr] = Worker(local_rank=lr, rank=self.world.rank_base + lr)
            if self.rejoined:
                # A replacement agent: its ranks start with the next generation's plan.
                self.log.warning("rejoined", f"replacement agent for node {self.world.group_rank}: "
                                 f"waiting for generation {self.generation + 1}")
            else:
                self.spawn_all(self.generation)
            self._watch_thread = threading.Thread(target=self._watch_plans, name="ftrun-plans",
                                                  daemon=True)
            self._watch_thread.start()
            self._inject_thread = threading.Thread(target=self._watch_injections,
                                                   name="ftrun-inject", daemon=True)
            self._inject_thread.start()
            return self._loop()
        except JobFailed as e:
            return e.code
        except StoreError as e:
            self.log.error("store-error", f"store: {e}")
            return 1
        except TimeoutError as e:
            self.log.error("timeout", f"{e}")
            return 1
        except ValueError as e:  # bad rendezvous parameters found late (e.g. membership)
            self.log.error("config-error", f"{e}")
            return 2
        except Exception as e:  # noqa: BLE001 - last resort: one line for people, details in events
            self.log.error("internal-error", f"ftrun internal error: {type(e).__name__}: {e} "
                           f"(traceback in {self.log.events_path})", traceback=traceback.format_exc())
            return 1
        finally:
            self.shutdown()

    def _publish_store_address(self) -> None:
        """Tell people and `ftctl` where this job's store is (store.json in the run log dir)."""
        assert self.kv is not None
        if self.cfg.store_backend == "etcd":
            addr = self.cfg.rdzv_endpoint
        elif self._server is not None:
            host = self.cfg.store_host if self.cfg.store_port else "127.0.0.1"
            addr = f"{host}:{self._server.port}"
        else:
            addr = f"{self.cfg.store_host}:{self.cfg.store_port}"
        if self.world.is_leader:
            self.kv.set(P.WORLD_SIZE_KEY, str(self.world.world_size).encode())
        path = os.path.join(self.run_dir.path, P.STORE_ADDR_FILE)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"addr": addr, "backend": self.cfg.store_backend,
                       "token_required": bool(self._token_value and self.cfg.proxy)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.store_addr = addr
        self.log.info("store-address", f"job store at {addr} (ftctl --addr {addr})", addr=addr)

    def _watch_injections(self) -> None:
        assert self.kv is not None
        nxt = 1
        raw = self.kv.try_get(P.INJECT_SEQ)
        if raw is not None:
            nxt = int(raw) + 1  # requests made before this agent started are not replayed
        while not self._stop.is_set():
            try:
                if self.kv.wait([P.inject_key(nxt)], 0.5):
                    self.events.put(InjectEvent(P.Injection.from_json(self.kv.get(P.inject_key(nxt), 5.0))))
                    nxt += 1
            except StoreError:
                if self._stop.is_set():
                    return
                time.sleep(0.2)

    def _watch_plans(self) -> None:
        assert self.kv is not None
        nxt = self.generation + 1
        while not self._stop.is_set():
            try:
                if self.kv.wait([P.plan_key(nxt)], 0.5):
                    self.events.put(PlanEvent(P.Plan.from_json(self.kv.get(P.plan_key(nxt), 5.0))))
                    nxt += 1
            except StoreError:
                if self._stop.is_set():
                    return
                time.sleep(0.2)

    def _loop(self) -> int:
        cfg = self.cfg
        next_check = time.monotonic() + cfg.monitor_interval
        while True:
            try:
                ev = self.events.get(timeout=max(0.0, next_check - time.monotonic()))
            except queue.Empty:
                ev = None
            if isinstance(ev, WorkerExit):
                code = self._on_exit(ev)
                if code is not None:
                    return code
            elif isinstance(ev, ChannelMessage):
                self._on_message(ev)
            elif isinstance(ev, PlanEvent):
                code = self._on_plan(ev.plan)
                if code is not None:
                    return code
            elif isinstance(ev, SignalEvent):
                return self._on_signal(ev.signum)
            elif isinstance(ev, InjectEvent):
                self._on_inject(ev.injection)
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + cfg.monitor_interval
                self._health_check()

    # ------------------------------------------------------------------ events
    def _on_exit(self, ev: WorkerExit) -> int | None:
        w = self.workers[ev.local_rank]
        if w.pid != ev.pid:
            return None  # an older process of this rank (already replaced)
        if w.stopping:
            self.log.info("exit", f"rank {w.rank} stopped by ftrun (code {ev.code})", rank=w.rank,
                          pid=ev.pid, exitcode=ev.code)
            return None
        if ev.code == P.EXIT_FALLBACK and w.rank in self._aware:
            self.log.info("exit", f"rank {w.rank} left for the fallback (pid {ev.pid})", rank=w.rank,
                          pid=ev.pid, exitcode=ev.code)
            return None
        if ev.code == 0:
            self.log.info("exit", f"rank {w.rank} finished (pid {ev.pid})", rank=w.rank, pid=ev.pid,
                          exitcode=0)
            if all(x.exit_code == 0 for x in self.workers.values()):
                return self._finish()
            return None
        kind = FaultKind.HANG if w.rank in self._hang_killed else (
            FaultKind.SIGNAL if ev.code < 0 else FaultKind.EXIT)
        self._hang_killed.discard(w.rank)
        f = failure_from_exit(w.rank, w.local_rank, self.host, ev.pid, ev.code, ev.time,
                              w.generation, self.world.group_rank, w.error_file)
        f.kind = kind.value
        self.failures.append(f)
        latency_ms = (time.time() - ev.time) * 1000
        self.log.error("worker-failed", f"rank {w.rank} (pid {ev.pid}) {kind.value}: {f.message}",
                       rank=w.rank, pid=ev.pid, exitcode=ev.code, signal=f.signal,
                       fault_kind=kind.value, detect_ms=round(latency_ms, 3))
        self._report(P.Fault(kind=kind.value, rank=w.rank, node=self.world.group_rank,
                             generation=self.generation, message=f.message, exitcode=ev.code,
                             signal=f.signal, pid=ev.pid, local_rank=w.local_rank, host=self.host,
                             time=ev.time, evidence={"traceback": f.traceback[-4000:],
                                                     "error_file": f.error_file}))
        return None

    def _report(self, fault: P.Fault) -> None:
        assert self.kv is not None
        seq = post_fault(self.kv, fault)
        self.log.info("fault-reported", f"fault #{seq} reported to the controller", seq=seq,
                      rank=fault.rank)

    def _on_message(self, ev: ChannelMessage) -> None:
        msg = ev.msg
        if isinstance(msg, Hello):
            self._on_hello(msg, ev.pid)
        elif isinstance(msg, Heartbeat):
            self._on_heartbeat(msg)
        elif isinstance(msg, FaultReport):
            self._on_fault_report(msg, ev.pid)
        elif isinstance(msg, Recovered):
            self.log.info("rank-recovered", f"rank {msg.rank} resumed generation {msg.generation} at "
                          f"step {msg.resume_step}", rank=msg.rank, generation=msg.generation,
                          resume_step=msg.resume_step, action=msg.action,
                          replacement=msg.replacement, marks=msg.marks,
                          transfer_bytes=msg.transfer_bytes, transfer_s=msg.transfer_s,
                          source=msg.source, **msg.timings)
        elif isinstance(msg, Bye):
            self._last_progress.pop(msg.rank, None)

    def _on_hello(self, msg: Hello, pid: int | None) -> None:
        assert self.kv is not None
        rank = msg.rank
        if rank not in self._aware:
            self._aware.add(rank)
            self.kv.set(P.aware_key(rank), b"1")
        self.log.info("hello", f"rank {rank} (pid {pid}) uses the ftrun runtime", rank=rank, pid=pid)
        pending = self._pending_stop.pop(rank, None)
        if pending is not None and msg.generation < pending.generation:
            assert self.channel is not None
            self.channel.send(rank, pending)
            self.log.info("stop-sent", f"deferred stop for generation {pending.generation} "
                          f"delivered to rank {rank}", rank=rank)

    def _on_heartbeat(self, msg: Heartbeat) -> None:
        self.log.observe("heartbeat", **dataclasses.asdict(msg))
        rank = msg.rank
        self._waiting[rank] = msg.waiting
        mark = msg.progress()
        if self._progress.get(rank) != mark:  # progress, not mere liveness, resets the clock
            self._progress[rank] = mark
            self._last_progress[rank] = time.time()
        if msg.phase in UNTIMED_PHASES:
            # start-up, recovery and checkpoint writes are bounded by the runtime's own
            # timeouts; the hang clock only runs while the worker trains
            self._last_progress.pop(rank, None)

    def _on_fault_report(self, msg: FaultReport, pid: int | None) -> None:
        rank = msg.rank
        kind = FaultKind.parse(msg.kind).value
        self.log.error("worker-fault", f"rank {rank} reports {kind}"
                       + (" [injected]" if msg.injected else "") + f": {msg.message}",
                       rank=rank, fault_kind=kind, injected=msg.injected, step=msg.step)
        w = self._worker_by_rank(rank)
        evidence: dict = {"step": msg.step, "phase": msg.phase}
        if kind in (FaultKind.UCE_LOW.value, FaultKind.UCE_HIGH.value) and w is not None:
            device = f"{self.host}:{w.local_rank}"
            count = self.fault_memory.record_uce(device)
            evidence.update(device=device, uce_count_24h=count, repeat_uce=count >= 2)
            if count >= 2:
                self.log.warning("uce-repeat", f"device {device} had {count} UCEs within 24 h: "
                                 "no more in-place retries on it", rank=rank, device=device)
        self._report(P.Fault(kind=kind, rank=rank, node=self.world.group_rank,
                             generation=self.generation, message=msg.message,
                             pid=pid, local_rank=w.local_rank if w else None, host=self.host,
                             injected=msg.injected, evidence=evidence))

    def _on_inject(self, inj: P.Injection) -> None:
        w = self._worker_by_rank(inj.rank)
        if w is None:
            return  # another node's rank
        assert self.channel is not None
        carry_out(inj, w, inj.rank in self._aware, self.channel.send, self.log)

    def _worker_by_rank(self, rank: int) -> Worker | None:
        for w in self.workers.values():
            if w.rank == rank:
                return w
        return None

    def _health_check(self) -> None:
        self._keep_spare()
        if self.cfg.hang_timeout <= 0:
            return
        now = time.time()
        for w in self.workers.values():
            if not w.alive or w.stopping or w.rank not in self._aware:
                continue
            last = self._last_progress.get(w.rank)
            if self._waiting.get(w.rank):
                # blocked in a collective on its peers (a hung peer, or one still recovering): not
                # hung itself; the collective's own timeout (FTRUN_STORE_TIMEOUT) bounds the wait
                continue
            if last is not None and now - last > self.cfg.hang_timeout:
                self.log.error("hang", f"rank {w.rank} made no progress for {now - last:.1f}s "
                               f"(--hang-timeout {self.cfg.hang_timeout}); dumping its stacks, "
                               "then killing it", rank=w.rank, pid=w.pid, idle_s=round(now - last, 3))
                send_signal(w, signal.SIGUSR1)  # the runtime registers faulthandler on SIGUSR1
                time.sleep(0.2)
                self._hang_killed.add(w.rank)
                self._last_progress.pop(w.rank, None)
                send_signal(w, signal.SIGKILL)

    # ------------------------------------------------------------------ plans
    def _on_plan(self, plan: P.Plan) -> int | None:
        self.generation = plan.generation
        self.log.generation = plan.generation
        if self.rejoined:
            cause = plan.root_cause or {}
            if not (cause.get("evidence", {}).get("node_joined") and cause.get("node") == self.world.group_rank):
                self.log.info("plan-skipped", f"generation {plan.generation} began before this "
                              "replacement agent joined; waiting for the round of its arrival")
                return None
            self.rejoined = False  # from here on, an ordinary member
        if plan.root_cause and self.root_fault is None:
            self.root_fault = P.Fault(**{k: v for k, v in plan.root_cause.items()
                                         if k in {f.name for f in dataclasses.fields(P.Fault)}})
        self.log.info("plan-received", f"executing {plan.strategy} for generation {plan.generation}"
                      f" ({plan.reason})", strategy=plan.strategy, failed_ranks=plan.failed_ranks)
        if plan.strategy == P.RESTART_ALL:
            return self._restart_all(plan)
        if plan.strategy in (P.RECOVER_IN_PLACE, P.RETRY):
            self._recover(plan)
            return None
        if plan.strategy == P.DUMP:
            return self._dump(plan)
        return self._exit(plan)

    def _local_ranks(self, ranks: list[int]) -> list[Worker]:
        return [w for w in self.workers.values() if w.rank in ranks]

    def _restart_all(self, plan: P.Plan) -> int | None:
        assert self.kv is not None
        g = plan.generation
        t0 = time.monotonic()
        live = [w for w in self.workers.values() if w.alive]
        stop_workers(list(self.workers.values()), signal.SIGTERM, self.cfg.shutdown_timeout)
        self.terminated.extend((w.rank, w.pid or 0) for w in live)
        if self.kv.add(P.stopped_key(g), 1) >= self.world.group_world_size:
            self.kv.set(P.all_stopped_key(g), b"1")
        if not self.kv.wait([P.go_key(g)], max(self.cfg.join_timeout, 60.0)):
            self.log.error("phase-timeout", f"generation {g}: the controller did not release the restart")
            raise JobFailed(1)
        self._aware.clear()
        self.spawn_all(g)
        self.log.info("restarted", f"generation {g}: all {len(self.workers)} local workers restarted "
                      f"in {time.monotonic() - t0:.3f}s", restart_s=round(time.monotonic() - t0, 4))
        return None

    def _recover(self, plan: P.Plan) -> None:
        g = plan.generation
        stop_msg = Stop(generation=g, strategy=plan.strategy, failed_ranks=plan.failed_ranks)
        restart = self._local_ranks(plan.restart_ranks)
        for w in self.workers.values():
            if w in restart or not w.alive:
                continue
            assert self.channel is not None
            if not self.channel.send(w.rank, stop_msg):
                # e.g. a replacement still starting: it gets the stop as soon as it says hello
                self._pending_stop[w.rank] = stop_msg
                self.log.warning("stop-deferred", f"rank {w.rank} is not connected yet; the stop for "
                                 f"generation {g} is delivered when it connects", rank=w.rank)
        for w in restart:
            self._pending_stop.pop(w.rank, None)
            if w.alive:
                stop_workers([w], signal.SIGKILL, 0.0)
            self._aware.discard(w.rank)
            self.spawn_worker(w, g, replacement=True)
        self.log.info("stop-sent", f"generation {g}: stop sent to survivors, "
                      f"{len(restart)} local rank(s) respawned", respawned=[w.rank for w in restart])

    def _dump(self, plan: P.Plan) -> int:
        """Survivors stop, save the current step (the runtime's dump fallback) and exit."""
        assert self.channel is not None
        for w in self.workers.values():
            if w.alive and w.rank not in plan.failed_ranks:
                w.stopping = True
                self.channel.send(w.rank, Stop(generation=plan.generation, strategy=plan.strategy,
                                               failed_ranks=plan.failed_ranks))
        deadline = time.monotonic() + max(self.cfg.shutdown_timeout, 120.0)
        for w in self.workers.values():
            if w.alive and w.proc is not None:
                try:
                    w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:  # stopped below
                    pass
        self.log.info("dump-done", "survivors saved the current step (dying-gasp checkpoint); exiting")
        return self._exit(plan)

    def _exit(self, plan: P.Plan) -> int:
        live = [w for w in self.workers.values() if w.alive]
        stop_workers(list(self.workers.values()), signal.SIGTERM, self.cfg.shutdown_timeout)
        self.terminated.extend((w.rank, w.pid or 0) for w in live)
        self._print_summary(plan.reason)
        return 1

    def _print_summary(self, reason: str) -> None:
        failures = list(self.failures)
        rf = self.root_fault
        if rf is not None and not any(f.rank == rf.rank and f.pid == rf.pid for f in failures):
            failures.append(Failure(rank=rf.rank if rf.rank is not None else -1,
                                    local_rank=rf.local_rank if rf.local_rank is not None else -1,
                                    host=rf.host, pid=rf.pid or 0, exitcode=rf.exitcode or 1,
                                    time=rf.time, generation=rf.generation, node=rf.node,
                                    kind=rf.kind, message=rf.message,
                                    traceback=str(rf.evidence.get("traceback", ""))))
        if rf is not None:  # the controller's root cause comes first even if observed elsewhere
            for f in failures:
                if f.rank == rf.rank and f.pid == rf.pid:
                    f.time = min(f.time, rf.time)
        terminated = [(r, p) for r, p in self.terminated
                      if not any(f.rank == r and f.pid == p for f in failures)]
        text = format_summary(os.path.basename(self.cfg.script), failures, terminated, reason)
        self.log.print_block(text)
        rc = root_cause(failures)
        if rc is not None and copy_root_error_file(rc, os.environ.get("TORCHELASTIC_ERROR_FILE")):
            self.log.info("error-file", "root cause error file copied to TORCHELASTIC_ERROR_FILE")
        self.log.event("summary", "job failed", "error", root_cause=dataclasses.asdict(rc) if rc else None)

    def _on_node_lost(self, node: int) -> None:
        self.log.error("node-lost", f"node {node} stopped heartbeating; its ranks restart when a "
                       f"replacement agent joins as node {node}", lost_node=node)
        if self.controller is not None:
            # No round yet: without the node's agent nothing can restart its ranks. Survivors'
            # own failures are handled as usual; the replacement's arrival starts the round.
            self.controller.note_node(node, lost=True)

    def _on_node_joined(self, node: int) -> None:
        self.log.warning("node-joined", f"a replacement agent joined as node {node}", joined_node=node)
        if self.controller is not None:
            self.controller.note_node(node, lost=False)
            self._report(P.Fault(kind=FaultKind.EXIT.value, rank=None, node=node,
                                 generation=self.generation, message=f"replacement agent for node {node}",
                                 host=self.host, evidence={"node_joined": True}))

    # ------------------------------------------------------------------ finish / signals
    def _finish(self) -> int | None:
        assert self.kv is not None
        g = self.generation
        n = self.kv.add(P.done_key(g), 1)
        self.log.info("node-done", f"all local workers finished ({n}/{self.world.group_world_size} "
                      "nodes done)", nodes_done=n)
        deadline = time.monotonic() + 300.0
        while time.monotonic() < deadline:
            raw = self.kv.try_get(P.done_key(g))
            if raw is not None and int(raw) >= self.world.group_world_size:
                break
            try:
                ev = self.events.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(ev, PlanEvent):
                # another node failed after we finished: take part in the new round
                return self._on_plan(ev.plan)
            if isinstance(ev, SignalEvent):
                return self._on_signal(ev.signum)
        self.kv.add(P.EXITED_KEY, 1)
        if self.world.is_leader and self.world.group_world_size > 1:
            end = time.monotonic() + 10.0
            while time.monotonic() < end:
                raw = self.kv.try_get(P.EXITED_KEY)
                if raw is not None and int(raw) >= self.world.group_world_size:
                    break
                time.sleep(0.05)
        self.log.info("job-done", "job finished successfully")
        return 0

    def _install_signals(self) -> None:
        for s in self.cfg.signals_to_handle:
            try:
                signal.signal(s, lambda signum, frame: self.events.put(SignalEvent(signum)))
            except (ValueError, OSError):
                pass

    def _on_signal(self, signum: int) -> int:
        name = signal.Signals(signum).name
        self.log.warning("signal", f"received {name}: forwarding to workers, then shutting down "
                         f"(grace {self.cfg.shutdown_timeout:.0f}s)", signal=name)
        stop_workers(list(self.workers.values()), signum, self.cfg.shutdown_timeout)
        return 1

    def shutdown(self) -> None:
        self._stop.set()
        if self.observer is not None:
            self.observer.stop()
        stop_workers(list(self.workers.values()), signal.SIGKILL, 0.0)
        if self.controller is not None:
            self.controller.stop()
        for t in (self._watch_thread, self._inject_thread):
            if t is not None:
                t.join(2.0)
        if self._membership is not None:
            self._membership.stop()
        if self.channel is not None:
            self.channel.stop()
        if self.reaper is not None:
            self.reaper.stop()
        if self.spares is not None:
            self.spares.stop()
        if self._proxy is not None:
            self._proxy.stop()
        if self.kv is not None and self._server is None:
            self.kv.close()
        if self._server is not None:
            self._server.stop()
        try:
            os.rmdir(self._sock_dir)
        except OSError:
            pass
        self.log.close()


def run_agent(cfg: LaunchConfig) -> int:
    """Run this node's agent; returns the process exit code (torchrun's: 0, 1)."""
    return Agent(cfg).run()
