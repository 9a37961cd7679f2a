"""The node agent: one per node, an event loop that supervises this node's workers.

Owns: the life of one node's part of a job and the event loop at its centre. Start-up builds the
observer (`observer`: status, progress, metrics), the store stack (`store_stack`: store, token,
node rendezvous, proxy, store address), the controller role (`controller_role`: on the leader
node, or elected with etcd so it moves when its node is lost), the worker channel (`channel`),
the reaper (`workers`), the spawner (`spawner`: worker environment, warm spare), the plan
executor (`plan_executor`) and the fault reporter (`fault_reports`: reports to the controller
off the loop, refused once this node is stale), then spawns the workers. The loop then reacts
to one event at a time:
  WorkerExit      a worker ended (seen at once): success, a stop ftrun asked for, or a fault
  ChannelMessage  a runtime-aware worker's Hello, Heartbeat, FaultReport, Recovered, Bye
  PlanEvent       the controller's plan for the next generation: handed to the plan executor;
                  a plan with `new_round` (the world shrinks: a lost node was not taken over;
                  or grows: scale_up=restart) stops the workers, moves this agent to that
                  rendezvous round and enters the new world (renumbered ranks), restarting
                  every worker (`_next_round`)
  InjectEvent     `ftctl inject` for a local rank
  SignalEvent     SIGTERM/SIGINT/...: forwarded to the workers, then the agent leaves
  NodeLostEvent   this node lost its membership (cut off from the store too long): self-fence
and, every monitor interval, the health check (warm spare, hang guard: hung ranks, progress
records). Faults are reported to the controller (`launcher.control.decision` decides); nothing is decided
here.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

from launcher.agent.agent_events import (
    InjectEvent,
    KeyFeed,
    PlanEvent,
    SignalEvent,
    inject_feed,
    plan_feed,
)
from launcher.agent.errors import JobFailures, failure_from_exit, stderr_cause, stderr_last_words
from launcher.agent.exit_guard import ExitGuard
from launcher.agent.fault_reports import FaultReporter
from launcher.agent.hang_guard import HangGuard
from launcher.agent.injections import carry_out
from launcher.agent.loop_store import LoopStore
from launcher.agent.plan_executor import JobFailed, PlanExecutor
from launcher.agent.store_stack import AgentWorld, StoreStack
from launcher.config import LaunchConfig
from launcher.control.controller import Controller
from launcher.control.controller_role import ControllerRole
from launcher.control.controller_settings import ControllerHooks, ControllerSettings
from launcher.control.fault_memory import FaultMemory
from launcher.observe.logs import AgentLog, RunLogDir
from launcher.observe.observer import NodeObserver
from launcher.protocol import plan as P
from launcher.protocol.death_notice import NoticeBoard
from launcher.protocol.faults import FaultKind, collective_failure
from launcher.protocol.messages import Bye, FaultReport, Heartbeat, Hello, Recovered
from launcher.workers.channel import ChannelMessage, ChannelServer
from launcher.workers.spawner import Spawner, WorkerWorld
from launcher.workers.workers import (
    NodeWorkers,
    Reaper,
    WorkerExit,
    signal_name,
    stop_workers,
)
from rendezvous.errors import (
    FencedError,
    JoinInterrupted,
    NodeLostError,
    RendezvousGracefulExit,
    StoreHostLostError,
)
from rendezvous.kv import KVStore, StoreError
from rendezvous.nodes.keys import LEAVE_SIGNAL

STDERR_LINES = 20  # of a failed worker's stderr.log, in its failure when it left no error file


class AgentSignal(Exception):
    """Raised by the signal handler while the agent is in the rendezvous (no workers yet), like
    torchrun's SignalException: ends any wait at once."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum


@dataclasses.dataclass
class NodeLostEvent:
    """Membership says this agent is no longer a member (from the membership thread)."""

    reason: str


class Agent:
    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.host = socket.gethostname()
        self.run_dir = RunLogDir.create(cfg.log_dir, cfg.rdzv_id)
        self.log = AgentLog(cfg.node_rank, self.run_dir.events_path)
        # SimpleQueue: put() is reentrant, so the signal handler may use it
        self.events: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self.stopping = threading.Event()  # a signal asked this agent to end
        self.signum: int | None = None
        self._raise_on_signal = False  # in the rendezvous: the handler raises AgentSignal
        self.stack = StoreStack(cfg, self.log)
        self.observer: NodeObserver | None = None  # status, progress records, metrics
        self.generation = 0
        self.failures = JobFailures()
        self.hangs = HangGuard(cfg, self.log, self.run_dir, self.host, lambda: self.workers)
        self.fault_memory = FaultMemory(
            os.path.join(cfg.log_dir or self.run_dir.path, "fault_memory.json")
        )
        self.rejoined = False  # a replacement for a lost node, until the round of its arrival
        self._sock_dir = tempfile.mkdtemp(prefix="ftrun-")
        # built by _start(), in this order
        self.kv: KVStore | None = None
        self.world: AgentWorld | None = None
        self.role: ControllerRole | None = None  # the controller, on the leader / elected agent
        self._master: tuple[str, int] = ("", 0)  # MASTER_ADDR/PORT local workers use
        self.channel: ChannelServer | None = None
        self.reaper: Reaper | None = None
        self.notices: NoticeBoard | None = (
            None  # workers' death notices (launcher.protocol.death_notice)
        )
        self.workers = NodeWorkers({})
        self.spawner: Spawner | None = None
        self.executor: PlanExecutor | None = None
        self.reporter: FaultReporter | None = None  # fault reports to the controller
        self.loop_store: LoopStore | None = None  # the loop's other store writes, off the loop
        self._feeds: list[KeyFeed] = []
        self._handlers: dict[type, Callable[[Any], int | None]] = {
            WorkerExit: self._on_exit,
            ChannelMessage: self._on_message,
            PlanEvent: self._on_plan,
            InjectEvent: self._on_inject,
            SignalEvent: self._on_signal,
            NodeLostEvent: self._on_lost,
        }

    # ------------------------------------------------------------------ main
    def run(self) -> int:
        cfg = self.cfg
        self.log.info("start", f"ftrun {cfg.describe()}", config=dataclasses.asdict(cfg))
        for note in cfg.notes:
            self.log.info("note", note)
        self.log.info(
            "hang-policy", f"hang detection: {cfg.hang.describe()}", hang_timeout=cfg.hang.timeout
        )
        if "OMP_NUM_THREADS" not in os.environ and cfg.nproc_per_node > 1:
            self.log.warning(
                "omp",
                "Setting OMP_NUM_THREADS environment variable for each process "
                "to be 1 in default, to avoid your system being overloaded, please "
                "further tune the variable for optimal performance in your "
                "application as needed.",
            )
        self._install_signals()
        code = 1
        try:
            code = self._run()
            return code
        finally:
            # every part's stop is bounded; this bounds the whole way out, wherever it hangs
            guard = ExitGuard(
                code, SHUTDOWN_LIMIT_S + 3 * cfg.rdzv_settings.keep_alive_interval, "shutdown"
            )
            try:
                self.shutdown()
            finally:
                guard.cancel()

    def _run(self) -> int:
        """Start, run the loop; the exit code (failures: one line each)."""
        try:
            self.observer = NodeObserver.start(self.cfg, self.log, self.run_dir.path)
            self._start()
            return self._loop()
        except JobFailed as e:
            return e.code
        except (AgentSignal, JoinInterrupted) as e:
            return self._signalled_in_rendezvous(e)
        except RendezvousGracefulExit as e:
            self.log.info("spare-done", f"{e}; nothing to do, exiting")
            return 0
        except NodeLostError as e:
            self.log.error("node-lost", f"{e}")
            return 1
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
            self.log.error(
                "internal-error",
                f"ftrun internal error: {type(e).__name__}: {e} "
                f"(traceback in {self.log.events_path})",
                traceback=traceback.format_exc(),
            )
            return 1

    def _start(self) -> None:
        """Store stack and world, then channel, reaper and the world's parts (`_enter_world`)."""
        self.kv = self._rendezvous(open_store=True)
        self.reporter = FaultReporter(self.kv, self.log, self.stack.me, self.stack.check_member)
        self.loop_store = LoopStore(self.kv, self.log)
        self.channel = ChannelServer(os.path.join(self._sock_dir, "agent.sock"), self.events)
        self.reaper = Reaper(self.events)
        self.notices = NoticeBoard(self.cfg.nproc_per_node, self.cfg.death_notice)
        self._master = self.stack.start_proxy()
        self.stack.publish(self._world(), self.run_dir.path)
        self._enter_world()

    def _world(self) -> AgentWorld:
        assert self.world is not None
        return self.world

    def _rendezvous(self, open_store: bool, next_round: bool = False) -> KVStore:
        """Open the store (first time) and join (or move to the next rendezvous round); a
        signal ends either at once (AgentSignal or JoinInterrupted): there are no workers."""
        self._raise_on_signal = True
        try:
            if self.stopping.is_set():
                raise AgentSignal(self.signum or signal.SIGTERM)
            kv = self.stack.open() if open_store else self.kv
            assert kv is not None
            if next_round:
                self.world = self.stack.next_round(stop=self.stopping)
            else:
                self.world = self.stack.join(
                    self.host,
                    self._on_node_lost,
                    self._on_node_joined,
                    stop=self.stopping,
                    on_lost=self._on_lost_news,
                    on_left=self._on_node_left,
                )
        finally:
            self._raise_on_signal = False
        if self.stopping.is_set():
            raise AgentSignal(self.signum or signal.SIGTERM)
        return kv

    def _enter_world(self) -> None:
        """Controller (leader), workers, spawner, executor and feeds for the world just joined;
        spawn the workers unless this agent replaces a lost node (it waits for its round)."""
        cfg, kv, world = self.cfg, self.kv, self._world()
        assert kv is not None and self.channel is not None and self.reaper is not None
        self.rejoined = self.stack.rejoined
        if world.from_spare:
            self.log.warning(
                "spare-takes-over",
                f"hot spare {self.host} takes over node "
                f"{world.group_rank} (ranks {world.rank_base}.."
                f"{world.rank_base + cfg.nproc_per_node - 1})",
                group_rank=world.group_rank,
            )
        self.log.node_rank = world.group_rank
        master_addr, master_port = self._master
        self.log.info(
            "rendezvous",
            f"node {world.group_rank}/{world.group_world_size}, "
            f"ranks {world.rank_base}..{world.rank_base + cfg.nproc_per_node - 1} "
            f"of {world.world_size}; workers use store {master_addr}:{master_port}; "
            f"logs in {self.run_dir.path}",
            group_rank=world.group_rank,
            world_size=world.world_size,
            master_port=master_port,
            log_dir=self.run_dir.path,
        )
        assert self.observer is not None
        self.observer.attach(kv, world.group_rank, world.is_leader, self.stack.server_stats())
        assert self.loop_store is not None
        self.hangs.attach(kv, world.group_rank, world.group_world_size, put=self.loop_store.put)
        # A replacement agent: plans published from the moment it joined concern it (the leader
        # starts a round for its arrival, possibly before join() returned).
        raw = kv.try_get(P.GENERATION_KEY)
        self.generation = (
            self.stack.generation_before_join
            if self.rejoined
            else (int(raw) if raw is not None else 0)
        )
        self.log.generation = self.generation
        self.role = ControllerRole(
            self.log, self.stack, self._new_controller, world.group_rank, self.host
        )
        self.role.start(world.is_leader)
        self.workers = NodeWorkers.create(world.rank_base, cfg.nproc_per_node)
        self.spawner = Spawner(
            cfg,
            WorkerWorld(
                world.group_rank,
                world.group_world_size,
                world.world_size,
                master_addr,
                master_port,
                self.channel.path,
            ),
            self.run_dir,
            self.log,
            self.host,
            self.reaper,
            on_spawn=self.hangs.on_spawn,
            notices=self.notices,
        )
        self.executor = PlanExecutor(
            cfg,
            self.log,
            kv,
            world,
            self.workers,
            self.spawner,
            self.channel,
            self.failures,
            stop=self.stopping,
            dump=lambda w: self.hangs.dump(w, w.rank in self.workers.aware),
            store=self.loop_store,
            lost=lambda: self.stack.lost_error() is not None,
            stop_sent=self.hangs.stop_sent,
        )
        if self.rejoined:
            self.log.warning(
                "rejoined",
                f"replacement agent for node {world.group_rank}: "
                f"waiting for generation {self.generation + 1}",
            )
            if self.controller is not None:
                # It took over the leader's node and runs the controller itself: no other agent
                # reports its arrival, so it does (else no round would ever start its ranks).
                self._report_arrival(world.group_rank)
        else:
            self.spawner.spawn_all(self.workers.all(), self.generation)
        self._feeds = [plan_feed(kv, self.generation, self.events), inject_feed(kv, self.events)]
        for feed in self._feeds:
            feed.start()

    @property
    def controller(self) -> Controller | None:
        """The controller when this agent runs it (leader, or elected with etcd), else None."""
        return self.role.controller if self.role is not None else None

    def _new_controller(self) -> Controller:
        cfg, world = self.cfg, self._world()
        assert self.kv is not None
        settings = ControllerSettings(
            world_size=world.world_size,
            nnodes=world.group_world_size,
            max_restarts=cfg.max_restarts,
            chain=tuple(cfg.recover_strategy),
            phase_timeout=float(os.environ.get("FTRUN_PHASE_TIMEOUT", 120)),
            window=cfg.fault_window,
            node_replace_timeout=cfg.node_replace_timeout,
            min_nodes=cfg.min_nodes,
            max_nodes=cfg.max_nodes,
            transfer_stripes=cfg.transfer_stripes,
            world_round=self.stack.world_round(),
        )
        hooks = ControllerHooks(
            stale=self.stack.stale,
            fence=self.stack.check_member,
            new_round=self.stack.request_round if self.stack.can_renumber else None,
            waiting=(self.stack.waiting if cfg.rdzv_settings.scale_up == "restart" else None),
        )
        return Controller(self.kv, self.log, settings, hooks)

    def _leave_world(self) -> None:
        """Undo `_enter_world` (workers already killed): before rejoining as a fresh node."""
        if self.role is not None:
            self.role.stop()
            self.role = None
        for feed in self._feeds:
            feed.stop()
        self._feeds = []
        if self.spawner is not None:
            self.spawner.stop()
            self.spawner = None

    def _loop(self) -> int:
        next_check = time.monotonic() + self.cfg.monitor_interval
        while True:
            try:
                ev = self.events.get(timeout=max(0.0, next_check - time.monotonic()))
            except queue.Empty:
                ev = None
            code = self._dispatch(ev)
            if code is not None:
                return code
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + self.cfg.monitor_interval
                self._health_check()

    def _dispatch(self, ev: object | None) -> int | None:
        handler = self._handlers.get(type(ev))
        return None if handler is None else handler(ev)

    # ------------------------------------------------------------------ worker exits and faults
    def _on_exit(self, ev: WorkerExit) -> int | None:
        assert self.world is not None
        w = self.workers.by_local[ev.local_rank]
        if w.pid != ev.pid:
            return None  # an older process of this rank (already replaced)
        if w.stopping:
            self.log.info(
                "exit",
                f"rank {w.rank} stopped by ftrun (code {ev.code})",
                rank=w.rank,
                pid=ev.pid,
                exitcode=ev.code,
            )
            return None
        if ev.code == P.EXIT_FALLBACK and w.rank in self.workers.aware:
            self.log.info(
                "exit",
                f"rank {w.rank} left for the fallback (pid {ev.pid})",
                rank=w.rank,
                pid=ev.pid,
                exitcode=ev.code,
            )
            return None
        if ev.code == 0:
            self.log.info(
                "exit",
                f"rank {w.rank} finished (pid {ev.pid})",
                rank=w.rank,
                pid=ev.pid,
                exitcode=0,
            )
            self._mark_finished(w)
            return self._finish() if self.workers.all_succeeded() else None
        if w.hung_at_exit:  # killed by the hang guard after its goodbye (see HangGuard)
            self.log.warning(
                "exit",
                f"rank {w.rank} killed after hanging at exit (pid {ev.pid}, code "
                f"{ev.code}); finished: it had said goodbye",
                rank=w.rank,
                pid=ev.pid,
                exitcode=ev.code,
                hung_at_exit=True,
            )
            return self._finish() if self.workers.all_succeeded() else None
        if w.ended_after_goodbye:  # a signal in its teardown, after rt.finish(): its work is done
            cause = stderr_cause(self._stderr_tail(w))
            self.log.warning(
                "exit",
                f"rank {w.rank} died of {signal_name(ev.code)} at exit after "
                f"its goodbye (pid {ev.pid}); finished: its work was done"
                + (f"; its stderr: {cause[-200:]!r}" if cause else ""),
                rank=w.rank,
                pid=ev.pid,
                exitcode=ev.code,
                after_goodbye=True,
            )
            return self._finish() if self.workers.all_succeeded() else None
        hang = self.hangs.take_killed(w.rank)
        f = failure_from_exit(
            w.rank,
            w.local_rank,
            self.host,
            ev.pid,
            ev.code,
            ev.time,
            w.generation,
            self.world.group_rank,
            w.error_file,
        )
        tail = self._stderr_tail(w)
        if tail:
            f.stderr_file = self._stderr_path(w)
            if not f.traceback:  # a signal or a bare exit: what the process said last is the clue
                lines = stderr_last_words(tail, STDERR_LINES)
                what = (
                    f"last {len(lines)} lines of {f.stderr_file}"
                    if lines == tail.rstrip().splitlines()[-len(lines) :]
                    else f"{len(lines)} lines of {f.stderr_file} (its end before Python's "
                    "fatal-error dump, and the dump's head)"
                )
                f.traceback = f"{what}:\n" + "\n".join(lines)
        evidence: dict = {
            "traceback": f.traceback[-4000:],
            "error_file": f.error_file,
            "stderr_file": f.stderr_file,
            "finished_ranks": self.workers.finished(),
        }
        kind = FaultKind.HANG if hang else FaultKind.SIGNAL if ev.code < 0 else FaultKind.EXIT
        if hang is not None:
            evidence.update(hang.evidence())
            f.message = f"hung: {hang.basis}; killed by ftrun ({f.message})"
        elif w.rank not in self.workers.aware:
            broken = collective_failure(f.message + "\n" + f.traceback + "\n" + tail)
            if broken:  # a peer's fault may explain it: the controller blames the rank that hangs
                kind = FaultKind.NETWORK
                evidence["collective"] = broken
        f.kind = kind.value
        self.failures.add(f)
        self.log.error(
            "worker-failed",
            f"rank {w.rank} (pid {ev.pid}) {kind.value}: {f.message}"
            + (f" (its stderr: {f.stderr_file})" if f.stderr_file else ""),
            rank=w.rank,
            pid=ev.pid,
            exitcode=ev.code,
            signal=f.signal,
            stderr_file=f.stderr_file or None,
            fault_kind=kind.value,
            detect_ms=round((time.time() - ev.time) * 1000, 3),
            early_notice=ev.early,
        )
        self._report(
            P.Fault(
                kind=kind.value,
                rank=w.rank,
                node=self.world.group_rank,
                generation=self.generation,
                message=f.message,
                exitcode=ev.code,
                signal=f.signal,
                pid=ev.pid,
                local_rank=w.local_rank,
                host=self.host,
                time=ev.time,
                evidence=evidence,
            )
        )
        return None

    def _mark_finished(self, w: Any) -> None:
        """Tell the controller `w`'s process is done with the job (`P.finished_key`): no
        recovery round can count on it any more."""
        assert self.loop_store is not None
        self.loop_store.put(P.finished_key(w.rank), str(w.generation).encode())

    def _stderr_path(self, w: Any) -> str:
        return os.path.join(self.run_dir.attempt_dir(w.generation), str(w.local_rank), "stderr.log")

    def _stderr_tail(self, w: Any) -> str:
        """The end of a worker's stderr.log (--redirects/--tee), "" without one."""
        path = self._stderr_path(w)
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 8192))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _report(self, fault: P.Fault) -> None:
        """To the controller, off this loop (`launcher.agent.fault_reports`): a store that does not
        answer (this node cut off) never holds up the loop, and so never its self-fencing."""
        assert self.reporter is not None
        self.reporter.report(fault)

    # ------------------------------------------------------------------ worker channel
    def _on_message(self, ev: ChannelMessage) -> None:
        msg = ev.msg
        if isinstance(msg, Hello):
            self._on_hello(msg, ev.pid)
        elif isinstance(msg, Heartbeat):
            self.log.observe("heartbeat", **dataclasses.asdict(msg))
            self.hangs.on_heartbeat(msg)
            if self.spawner is not None:
                self.spawner.rank_progressed(msg.rank, msg.committed_step, msg.state_bytes)
        elif isinstance(msg, FaultReport):
            self._on_fault_report(msg, ev.pid)
        elif isinstance(msg, Recovered):
            if self.spawner is not None:
                self.spawner.rank_recovered(msg.rank, msg.generation, msg.resume_step)
            self.log.info(
                "rank-recovered",
                f"rank {msg.rank} resumed generation {msg.generation} at step {msg.resume_step}",
                rank=msg.rank,
                generation=msg.generation,
                resume_step=msg.resume_step,
                action=msg.action,
                replacement=msg.replacement,
                marks=msg.marks,
                transfer_bytes=msg.transfer_bytes,
                transfer_s=msg.transfer_s,
                source=msg.source,
                transfer_path=msg.transfer_path,
                **msg.timings,
            )
        elif isinstance(msg, Bye):
            self.hangs.on_bye(msg.rank)
            w = self.workers.by_rank(msg.rank)
            if w is not None and w.alive and (ev.pid is None or ev.pid == w.pid):
                w.said_bye = True
                self._mark_finished(w)

    def _on_hello(self, msg: Hello, pid: int | None) -> None:
        assert self.loop_store is not None and self.executor is not None
        if msg.rank not in self.workers.aware:
            self.workers.aware.add(msg.rank)
            self.loop_store.put(P.aware_key(msg.rank), b"1")
        self.log.info(
            "hello", f"rank {msg.rank} (pid {pid}) uses the ftrun runtime", rank=msg.rank, pid=pid
        )
        self._watch_death(msg, pid)
        self.executor.on_hello(msg.rank, msg.generation)

    def _watch_death(self, msg: Hello, pid: int | None) -> None:
        """The rank holds its death-notice slot: report its exit the moment it starts dying."""
        w = self.workers.by_rank(msg.rank)
        if (
            not msg.notice_tid
            or w is None
            or not w.notice
            or w.proc is None
            or pid != w.pid
            or self.notices is None
            or self.reaper is None
        ):
            return
        proc, reaper = w.proc, self.reaper
        self.notices.watch(
            w.notice, w.proc.pid, msg.notice_tid, lambda code: reaper.announce(w, proc, code)
        )

    def _on_fault_report(self, msg: FaultReport, pid: int | None) -> None:
        assert self.world is not None
        kind = FaultKind.parse(msg.kind)
        self.log.error(
            "worker-fault",
            f"rank {msg.rank} reports {kind.value}"
            + (" [injected]" if msg.injected else "")
            + f": {msg.message}",
            rank=msg.rank,
            fault_kind=kind.value,
            injected=msg.injected,
            step=msg.step,
        )
        w = self.workers.by_rank(msg.rank)
        evidence: dict = {
            "step": msg.step,
            "phase": msg.phase,
            "finished_ranks": self.workers.finished(),
        }
        if msg.collective:
            evidence["collective"] = msg.collective  # possibly a consequence: the controller blames
        if kind in (FaultKind.UCE_LOW, FaultKind.UCE_HIGH) and w is not None:
            evidence.update(self.fault_memory.record_uce_evidence(f"{self.host}:{w.local_rank}"))
            if evidence["repeat_uce"]:
                self.log.warning(
                    "uce-repeat",
                    f"device {evidence['device']} had "
                    f"{evidence['uce_count_24h']} UCEs within 24 h: no more in-place "
                    "retries on it",
                    rank=msg.rank,
                    device=evidence["device"],
                )
        self._report(
            P.Fault(
                kind=kind.value,
                rank=msg.rank,
                node=self.world.group_rank,
                generation=msg.generation if msg.generation >= 0 else self.generation,
                message=msg.message,
                pid=pid,
                local_rank=w.local_rank if w else None,
                host=self.host,
                injected=msg.injected,
                evidence=evidence,
            )
        )

    def _on_inject(self, ev: InjectEvent) -> None:
        w = self.workers.by_rank(ev.injection.rank)
        if w is None:
            return  # another node's rank
        assert self.channel is not None
        carry_out(ev.injection, w, w.rank in self.workers.aware, self.channel.send, self.log)

    def _health_check(self) -> None:
        """Every monitor interval: keep the warm spare, find hung ranks, publish progress."""
        assert self.spawner is not None and self.world is not None
        if self.workers.aware:
            self.spawner.keep_spare(self.workers.all()[0])
        self.hangs.check(self.generation, self.world.group_rank)

    # ------------------------------------------------------------------ plans
    def _on_plan(self, ev: PlanEvent) -> int | None:
        assert self.world is not None and self.executor is not None
        plan = ev.plan
        if plan.generation <= self.generation:
            # a plan of a world this agent left (a feed from before it self-fenced delivered it
            # late): executing it would take the agent's generation backwards, and the job's
            # end barrier (per generation) would never fill
            self.log.info(
                "plan-skipped",
                f"plan for generation {plan.generation} is not newer than "
                f"this agent's generation {self.generation}: ignored",
            )
            return None
        self.generation = plan.generation
        self.log.generation = plan.generation
        if self.rejoined:
            cause = plan.root_cause or {}
            if not (
                cause.get("evidence", {}).get("node_joined")
                and cause.get("node") == self.world.group_rank
            ):
                self.log.info(
                    "plan-skipped",
                    f"generation {plan.generation} began before this "
                    "replacement agent joined; waiting for the round of its arrival",
                )
                return None
            self.rejoined = False  # from here on, an ordinary member
        self.failures.note_plan(plan)
        if plan.new_round:
            return self._next_round(plan)
        if plan.strategy == P.RECOVER_IN_PLACE and self.spawner is not None:
            # every local runtime rank takes part in the round and reports it done
            local = {w.rank for w in self.workers.all()}
            self.spawner.hold_spares(plan.generation, set(self.workers.aware) & local)
        return self.executor.execute(plan)

    def _next_round(self, plan: P.Plan) -> int | None:
        """Restart-all in a new world: stop every local worker, leave this world, join
        rendezvous round `plan.new_round` (without the lost nodes, or with the agents waiting to
        get in; survivors keep their order, renumbered), then enter the new world and start every worker with its new RANK,
        GROUP_RANK and WORLD_SIZE (torchrun's semantics: the script resumes from its own
        checkpoint). A signal meanwhile ends the agent as in the rendezvous."""
        g, before = plan.generation, self._world()
        t0 = time.monotonic()
        self.log.info(
            "plan-received",
            f"executing {plan.strategy} for generation {g} in "
            f"rendezvous round {plan.new_round} ({plan.reason})",
            strategy=plan.strategy,
            failed_ranks=plan.failed_ranks,
            new_round=plan.new_round,
        )
        live = self.workers.alive()
        stop_workers(self.workers.all(), signal.SIGTERM, self.cfg.shutdown_timeout)
        self.failures.note_terminated(live)
        self._leave_world()
        self._rendezvous(open_store=False, next_round=True)
        world = self._world()
        self.stack.publish(world, self.run_dir.path)
        self.log.info(
            "round-joined",
            f"rendezvous round {plan.new_round}: node "
            f"{before.group_rank} -> {world.group_rank} of {world.group_world_size}, "
            f"world size {before.world_size} -> {world.world_size}",
            new_round=plan.new_round,
            old_group_rank=before.group_rank,
            group_rank=world.group_rank,
            world_size=world.world_size,
            old_world_size=before.world_size,
            nnodes=world.group_world_size,
        )
        self._enter_world()
        self.log.info(
            "restarted",
            f"generation {g}: all {len(self.workers.by_local)} local "
            f"workers restarted in a world of {world.world_size} in "
            f"{time.monotonic() - t0:.3f}s",
            restart_s=round(time.monotonic() - t0, 4),
        )
        return None

    def _finish(self) -> int | None:
        assert self.executor is not None
        out = self.executor.finish(self.generation, self.events)
        return out if isinstance(out, int) else self._dispatch(out)

    # ------------------------------------------------------------------ membership news
    def _loss_reason(self) -> str:
        """Why membership declares a node lost, in words: the liveness mechanism that saw it."""
        t = self.cfg.rdzv_settings.liveness_timeout
        if self.cfg.store_backend == "etcd":
            return f"its etcd lease expired (TTL {t:g}s)"
        return f"no heartbeat for {t:g}s"

    def _node_ranks(self, node: int) -> list[int]:
        n = self.cfg.nproc_per_node
        return list(range(node * n, (node + 1) * n))

    def _on_node_left(self, node: int, reason: str) -> None:
        """Membership thread: a node left on purpose. Stopped by a signal (preemption): its
        ranks need a new home, as after a crash; any other reason (done, a new round) is not a
        loss."""
        if reason == LEAVE_SIGNAL and not self.stopping.is_set():
            self._on_node_lost(node, "its agent left on a signal (stopped or preempted)")

    def _on_node_lost(self, node: int, why: str = "") -> None:
        """Membership thread: handled here, not in the main loop, which may be waiting on a
        round that this very death holds up."""
        why = why or self._loss_reason()
        who = (
            "a hot spare or a replacement agent (same --node_rank) takes over its ranks "
            f"{self._node_ranks(node)} within node_replace_timeout="
            f"{self.cfg.node_replace_timeout:g}s, else the job falls back"
        )
        self.log.error(
            "node-lost",
            f"node {node} lost ({why}): {who}",
            lost_node=node,
            reason=why,
            node_ranks=self._node_ranks(node),
        )
        if self.controller is not None:
            # Reported as a node-lost fault: survivors stop (runtime-aware jobs) and the
            # replacement's arrival starts the round that starts its ranks.
            self.controller.note_node(node, lost=True, why=why)

    def _on_node_joined(self, node: int) -> None:
        self.log.warning(
            "node-joined",
            f"a hot spare or replacement agent took over node {node} "
            f"(ranks {self._node_ranks(node)})",
            joined_node=node,
        )
        self._report_arrival(node)

    def _report_arrival(self, node: int) -> None:
        """Tell the controller a new agent holds `node`: the round that starts its ranks."""
        c = self.controller
        if c is None:
            return  # no controller here: the one elected next finds the arrival (reconcile)
        try:
            c.note_arrival(node, self.stack.incarnation_of(node), host=self.host)
        except (FencedError, StoreError) as e:  # the reporter retries it, or refuses it if stale
            self.log.warning(
                "fault-report-retry",
                f"arrival of node {node} not reported yet ({e}); retrying off the loop",
                joined_node=node,
            )
            self._report(
                P.Fault(
                    kind=FaultKind.NODE_LOST.value,
                    rank=None,
                    node=node,
                    generation=self.generation,
                    message=f"hot spare or replacement agent for node {node}",
                    host=self.host,
                    evidence={"node_joined": True, "node_ranks": self._node_ranks(node)},
                )
            )

    # ------------------------------------------------------------------ signals and shutdown
    def _install_signals(self) -> None:
        for s in self.cfg.signals_to_handle:
            try:
                signal.signal(s, self._signal_handler)
            except (ValueError, OSError):
                pass

    def _signal_handler(self, signum: int, frame: object) -> None:
        """No I/O here: note the signal, interrupt the rendezvous, wake the loop. In the
        rendezvous (before any worker exists) raise, as torchrun does, to end any wait."""
        if self.signum is None:
            self.signum = signum
        self.stopping.set()
        self.stack.interrupt()
        self.events.put(SignalEvent(signum))
        if self._raise_on_signal:
            self._raise_on_signal = False
            raise AgentSignal(signum)

    def _signalled_in_rendezvous(self, e: Exception) -> int:
        """A signal (or a stop) ended the rendezvous: torchrun's exit code 1."""
        name = signal.Signals(self.signum).name if self.signum else "a stop request"
        self.log.warning(
            "signal", f"received {name} during the rendezvous: leaving at once ({e})", signal=name
        )
        return 1

    def _on_signal(self, ev: SignalEvent) -> int:
        """torchrun: SignalException -> workers stopped with the signal, exit code 1."""
        name = signal.Signals(ev.signum).name
        self.log.warning(
            "signal",
            f"received {name}: forwarding to workers, then leaving the "
            f"job (grace {self.cfg.shutdown_timeout:g}s)",
            signal=name,
        )
        stop_workers(self.workers.all(), ev.signum, self.cfg.shutdown_timeout)
        return 1

    # ------------------------------------------------------------------ self-fencing
    def _on_lost_news(self, lost: object) -> None:
        """Membership thread: this agent is no longer a member; the loop self-fences."""
        self.events.put(NodeLostEvent(str(getattr(lost, "message", lost))))

    def _on_lost(self, ev: NodeLostEvent) -> int | None:
        """Cut off from the store longer than the liveness timeout: kill the local workers at
        once (the others already count them lost), then leave with the reason."""
        err = self.stack.lost_error()
        reason = str(err) if err is not None else ev.reason
        self.log.error(
            "self-fence",
            f"this node lost its membership ({reason}): killing its "
            f"{len(self.workers.alive())} local worker(s) at once",
            reason=reason,
        )
        stop_workers(self.workers.all(), signal.SIGKILL, 0.0)
        return self._rejoin_after_loss(err)

    def _rejoin_after_loss(self, err: NodeLostError | None) -> int | None:
        """Rejoin as a fresh node once the store answers again (a replacement: it waits for the
        round of its arrival). With the embedded store gone, StoreHostLostError ends the agent
        with its one line (raised out of join())."""
        if isinstance(err, StoreHostLostError):
            raise err
        self._leave_world()
        self.stack.renew()
        self.log.warning("rejoin", "self-fenced; rejoining the job as a fresh node")
        self._rendezvous(open_store=False)
        self._enter_world()
        return None

    def shutdown(self) -> None:
        """Stop everything this agent started, workers first, the store last."""
        stop_workers(self.workers.all(), signal.SIGKILL, 0.0)
        slow = lambda msg: self.log.warning("shutdown-slow", msg)  # noqa: E731
        _stop_together(
            [
                self.observer,
                self.role,
                *self._feeds,
                self.channel,
                self.reaper,
                self.notices,
                self.spawner,
                self.reporter,
                self.loop_store,
            ],
            slow,
        )
        reason = LEAVE_SIGNAL if self.signum is not None else None
        # the store last, and bounded too: its calls wait up to the store timeout each, and the
        # store host waits up to 3 keep-alive intervals for the hot spares to see the end
        _within(
            "store",
            lambda: self.stack.close(reason),
            STORE_CLOSE_S + 3 * self.cfg.rdzv_settings.keep_alive_interval,
            slow,
        )
        try:
            os.rmdir(self._sock_dir)
        except OSError:
            pass
        self.log.close()


STOP_TOGETHER_S = 10.0  # all of an agent's parts stop within this long, or are left behind


def _stop_together(parts: list[Any], log: Callable[[str], None] | None = None) -> None:
    """Stop independent parts at the same time. Each `stop()` waits for its own thread to see
    the request (up to its poll interval); one after another those waits add up and a signalled
    agent overran --shutdown-timeout + 1 s. Every stop() bounds its own join; all of them get
    STOP_TOGETHER_S in total, and the ones still running then are named (`log`)."""
    late, failed = _run_bounded(
        [(type(p).__name__, p.stop) for p in parts if p is not None], STOP_TOGETHER_S
    )
    for name, exc in failed:  # as an uncaught exception of its thread would be shown
        print(f"Exception in ftrun-stop-{name}:", file=sys.stderr)
        traceback.print_exception(exc)
    if late and log is not None:
        log(
            f"shutdown: {', '.join(late)} did not stop within {STOP_TOGETHER_S:g} s; going on without them"
        )


def _run_bounded(
    calls: list[tuple[str, Callable[[], None]]], timeout: float
) -> tuple[list[str], list[tuple[str, BaseException]]]:
    """Run each (name, fn) on a daemon thread of its own, all at once, for at most `timeout` s
    in total; returns the names still running then (left behind) and the exceptions of the
    calls that raised."""
    failed: list[tuple[str, BaseException]] = []

    def run(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            failed.append((name, exc))

    threads = [
        threading.Thread(target=run, args=(name, fn), name=f"ftrun-stop-{name}", daemon=True)
        for name, fn in calls
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t.name.removeprefix("ftrun-stop-") for t in threads if t.is_alive()], failed


STORE_CLOSE_S = 10.0  # the store stack closes within this (+ the spares' wait on the store host)
# the whole shutdown (+ 3 keep-alives): the parts, the store, and 5 s for the rest (the workers'
# SIGKILL, the log); past it the agent leaves with its code and every thread's stack on stderr
SHUTDOWN_LIMIT_S = STOP_TOGETHER_S + STORE_CLOSE_S + 5.0


def _within(
    name: str, fn: Callable[[], None], timeout: float, log: Callable[[str], None] | None = None
) -> bool:
    """Run `fn` on a daemon thread for at most `timeout` s: False (and one line to `log`) when it
    is still running then (the agent goes on without it); its exception is raised here."""
    late, failed = _run_bounded([(name, fn)], timeout)
    if late:
        if log is not None:
            log(f"shutdown: {name} did not stop within {timeout:g} s; going on without it")
        return False
    if failed:
        raise failed[0][1]
    return True


def run_agent(cfg: LaunchConfig) -> int:
    """Run this node's agent; returns the process exit code (torchrun's: 0, 1)."""
    return Agent(cfg).run()
