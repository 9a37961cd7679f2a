"""The node agent: one per node, an event loop that supervises this node's workers.

Owns: the life of one node's part of a job and the event loop at its centre, in phases
(`agent_state.AgentPhase`: STARTING, JOINING the rendezvous, ENTERING a world, RUNNING, or
AWAITING_ROUND as a replacement for a lost node, STOPPING on a signal, DONE). Start-up builds the
observer (`observer`: status, progress, metrics), the store stack (`store_stack`: store, token,
node rendezvous, proxy, store address), the controller role (`controller_role`: on the leader
node, or elected with etcd so it moves when its node is lost), the worker channel (`channel`),
the reaper (`workers`), the spawner (`spawner`: worker environment, warm spare), the plan
executor (`plan_executor`) and the fault reporter (`fault_reports`: reports to the controller
off the loop, refused once this node is stale), then spawns the workers. What they share is
`agent_state.AgentState`. The loop then reacts to one event at a time:
  WorkerExit      a worker ended (seen at once): `worker_exits` carries out what
                  `exit_verdict` says it means (success, a stop ftrun asked for, or a fault)
  ChannelMessage  a runtime-aware worker's Hello, Heartbeat, FaultReport, Recovered, Bye
                  (`worker_messages`)
  PlanEvent       the controller's plan for the next generation: handed to the plan executor;
                  a plan with `new_round` (the world shrinks: a lost node was not taken over;
                  or grows: scale_up=restart) stops the workers, moves this agent to that
                  rendezvous round and enters the new world (renumbered ranks), restarting
                  every worker (`_next_round`)
  InjectEvent     `ftctl inject` for a local rank (`worker_messages`: sent on the channel)
  SignalEvent     SIGTERM/SIGINT/...: forwarded to the workers, then the agent leaves
  NodeLostEvent   this node lost its membership (cut off from the store too long): self-fence
and, every monitor interval, the health check (warm spares: `spare_care`; hang guard: hung
ranks, progress records). News of other nodes comes on the membership thread
(`membership_news`). Faults are reported to the controller (`launcher.control.decision`
decides); nothing is decided here.
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
)
from launcher.agent.agent_state import AgentPhase, AgentState
from launcher.agent.exit_guard import ExitGuard
from launcher.agent.fault_reports import FaultReporter
from launcher.agent.hang_guard import HangGuard
from launcher.agent.loop_store import LoopStore
from launcher.agent.membership_news import MembershipNews
from launcher.agent.node_return import (
    concerns_replacement,
    end_out_of_world,
    enter_as_replacement,
)
from launcher.agent.plan_executor import JobFailed
from launcher.agent.spare_care import tend_spares
from launcher.agent.store_stack import StoreStack
from launcher.agent.worker_exits import WorkerExits
from launcher.agent.worker_messages import WorkerMessages
from launcher.agent.world_parts import (
    announce_round,
    announce_world,
    build_world_parts,
    world_feeds,
)
from launcher.config import LaunchConfig
from launcher.control.controller import Controller
from launcher.control.controller_role import ControllerRole
from launcher.control.controller_settings import ControllerHooks, ControllerSettings
from launcher.control.fault_memory import FaultMemory
from launcher.observe.logs import AgentLog, RunLogDir
from launcher.observe.observer import NodeObserver
from launcher.protocol import plan as P
from launcher.protocol.death_notice import NoticeBoard
from launcher.workers.channel import ChannelMessage, ChannelServer
from launcher.workers.workers import NodeWorkers, Reaper, WorkerExit, stop_workers
from rendezvous.errors import (
    JoinInterrupted,
    NodeLostError,
    RendezvousGracefulExit,
    StoreHostLostError,
)
from rendezvous.kv import KVStore, StoreError
from rendezvous.nodes.keys import LEAVE_SIGNAL


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
        host = socket.gethostname()
        run_dir = RunLogDir.create(cfg.log_dir, cfg.rdzv_id)
        self.log = AgentLog(cfg.node_rank, run_dir.events_path)
        self.stack = StoreStack(cfg, self.log)
        self.state = AgentState(
            cfg,
            self.log,
            host,
            run_dir,
            self.stack,
            HangGuard(cfg, self.log, run_dir, host, lambda: self.state.workers),
            FaultMemory(os.path.join(cfg.log_dir or run_dir.path, "fault_memory.json")),
        )
        self.observer: NodeObserver | None = None  # status, progress records, metrics
        self._sock_dir = tempfile.mkdtemp(prefix="ftrun-")
        self._master: tuple[str, int] = ("", 0)  # MASTER_ADDR/PORT local workers use
        self._feeds: list[KeyFeed] = []
        self.exits = WorkerExits(self.state, self._finish)
        self.messages = WorkerMessages(self.state)
        self.news = MembershipNews(self.state)
        self._handlers: dict[type, Callable[[Any], int | None]] = {
            WorkerExit: self.exits.on_exit,
            ChannelMessage: self.messages.on_message,
            PlanEvent: self._on_plan,
            InjectEvent: self.messages.on_inject,
            SignalEvent: self._on_signal,
            NodeLostEvent: self._on_lost,
        }

    # ------------------------------------------------------------------ main
    def run(self) -> int:
        cfg = self.cfg
        announce_start(cfg, self.log)
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
            self.observer = NodeObserver.start(self.cfg, self.log, self.state.run_dir.path)
            self._start()
            return self._loop()
        except JobFailed as e:
            return e.code
        except (AgentSignal, JoinInterrupted) as e:
            return signalled_in_rendezvous(self.log, self.state.signum, e)
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
        s = self.state
        s.kv = self._rendezvous(open_store=True)
        s.reporter = FaultReporter(s.kv, self.log, self.stack.me, self.stack.check_member)
        s.loop_store = LoopStore(s.kv, self.log)
        s.channel = ChannelServer(os.path.join(self._sock_dir, "agent.sock"), s.events)
        s.notices = NoticeBoard(self.cfg.nproc_per_node, self.cfg.death_notice)
        s.reaper = Reaper(s.events, s.notices.settle)
        self._master = self.stack.start_proxy()
        self.stack.publish(s.the_world(), s.run_dir.path)
        self._enter_world()

    def _rendezvous(self, open_store: bool, next_round: bool = False) -> KVStore:
        """Open the store (first time) and join (or move to the next rendezvous round); a
        signal ends either at once (AgentSignal or JoinInterrupted): there are no workers."""
        s = self.state
        s.enter(AgentPhase.JOINING)  # the signal handler raises from here on
        try:
            if s.stopping.is_set():
                raise AgentSignal(s.signum or signal.SIGTERM)
            kv = self.stack.open() if open_store else s.kv
            assert kv is not None
            if next_round:
                s.world = self.stack.next_round(stop=s.stopping)
            else:
                s.world = self.stack.join(
                    s.host,
                    self.news.on_node_lost,
                    self.news.on_node_joined,
                    stop=s.stopping,
                    on_lost=self._on_lost_news,
                    on_left=self.news.on_node_left,
                )
        finally:
            if s.phase is AgentPhase.JOINING:
                s.enter(AgentPhase.ENTERING)
        if s.stopping.is_set():
            raise AgentSignal(s.signum or signal.SIGTERM)
        return kv

    def _enter_world(self) -> None:
        """Controller (leader), workers, spawner, executor and feeds for the world just joined;
        spawn the workers unless this agent replaces a lost node (it waits for its round)."""
        s, world = self.state, self.state.the_world()
        assert s.kv is not None
        rejoined = self.stack.rejoined
        announce_world(s, world, self._master)
        assert self.observer is not None and s.loop_store is not None
        self.observer.attach(s.kv, world.group_rank, world.is_leader, self.stack.server_stats())
        s.hangs.attach(s.kv, world.group_rank, world.group_world_size, put=s.loop_store.put)
        # A replacement agent: plans published from the moment it joined concern it (the leader
        # starts a round for its arrival, possibly before join() returned).
        raw = s.kv.try_get(P.GENERATION_KEY)
        s.generation = (
            self.stack.generation_before_join if rejoined else (int(raw) if raw is not None else 0)
        )
        self.log.generation = s.generation
        s.role = ControllerRole(
            self.log, self.stack, self._new_controller, world.group_rank, s.host
        )
        s.role.start(world.is_leader)
        s.workers = NodeWorkers.create(world.rank_base, self.cfg.nproc_per_node)
        build_world_parts(s, world, self._master, self.stack.lost_error)
        assert s.spawner is not None
        if rejoined:  # its ranks start in its arrival's round, or return (live grow back)
            enter_as_replacement(s, world, self.news.report_arrival)
        else:
            s.enter(AgentPhase.RUNNING)
            s.spawner.spawn_all(s.workers.all(), s.generation)
        self._feeds = world_feeds(s, world)
        for feed in self._feeds:
            feed.start()

    def _new_controller(self) -> Controller:
        cfg, world = self.cfg, self.state.the_world()
        assert self.state.kv is not None
        settings = ControllerSettings(
            world_size=world.world_size,
            nnodes=world.group_world_size,
            max_restarts=cfg.max_restarts,
            chain=tuple(cfg.recover_strategy),
            phase_timeout=cfg.phase_timeout,
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
        return Controller(self.state.kv, self.log, settings, hooks)

    def _leave_world(self) -> None:
        """Undo `_enter_world` (workers already killed): before rejoining as a fresh node."""
        s = self.state
        if s.role is not None:
            s.role.stop()
            s.role = None
        for feed in self._feeds:
            feed.stop()
        self._feeds = []
        if s.spawner is not None:
            s.spawner.stop()
            s.spawner = None

    def _loop(self) -> int:
        next_check = time.monotonic() + self.cfg.monitor_interval
        while True:
            try:
                ev = self.state.events.get(timeout=max(0.0, next_check - time.monotonic()))
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

    def _health_check(self) -> None:
        """Every monitor interval: keep the warm spare, find hung ranks, publish progress."""
        s = self.state
        assert s.spawner is not None and s.world is not None
        tend_spares(s)  # keep the warm spares; a ready one overtakes a cold replacement
        s.hangs.check(s.generation, s.world.group_rank)

    # ------------------------------------------------------------------ plans
    def _on_plan(self, ev: PlanEvent) -> int | None:
        s = self.state
        assert s.world is not None and s.executor is not None
        plan = ev.plan
        if plan.generation <= s.generation:
            # a plan of a world this agent left (a feed from before it self-fenced delivered it
            # late): executing it would take the agent's generation backwards, and the job's
            # end barrier (per generation) would never fill
            self.log.info(
                "plan-skipped",
                f"plan for generation {plan.generation} is not newer than "
                f"this agent's generation {s.generation}: ignored",
            )
            return None
        s.generation = plan.generation
        self.log.generation = plan.generation
        if s.phase is AgentPhase.AWAITING_ROUND:
            local = [w.rank for w in s.workers.all()]
            if not concerns_replacement(plan, s.world.group_rank, local):
                self.log.info(
                    "plan-skipped",
                    f"generation {plan.generation} began before this "
                    "replacement agent joined; waiting for the round of its arrival",
                )
                return None
            s.enter(AgentPhase.RUNNING)  # from here on, an ordinary member
        s.failures.note_plan(plan)
        if plan.new_round:
            return self._next_round(plan)
        if plan.strategy == P.RECOVER_IN_PLACE and s.spawner is not None:
            # every local runtime rank takes part in the round and reports it done
            local = {w.rank for w in s.workers.all()}
            s.spawner.hold_spares(plan.generation, set(s.workers.aware) & local)
        return s.executor.execute(plan)

    def _next_round(self, plan: P.Plan) -> int | None:
        """Restart-all in a new world: stop every local worker, leave this world, join
        rendezvous round `plan.new_round` (without the lost nodes, or with the agents waiting
        to get in; survivors keep their order, renumbered), then enter the new world and start
        every worker with its new RANK, GROUP_RANK and WORLD_SIZE (torchrun's semantics: the
        script resumes from its own checkpoint). A signal meanwhile ends the agent as in the
        rendezvous."""
        s = self.state
        g, before = plan.generation, s.the_world()
        t0 = time.monotonic()
        self.log.info(
            "plan-received",
            f"executing {plan.strategy} for generation {g} in "
            f"rendezvous round {plan.new_round} ({plan.reason})",
            strategy=plan.strategy,
            failed_ranks=plan.failed_ranks,
            new_round=plan.new_round,
        )
        live = s.workers.alive()
        stop_workers(s.workers.all(), signal.SIGTERM, self.cfg.shutdown_timeout)
        s.failures.note_terminated(live)
        self._leave_world()
        self._rendezvous(open_store=False, next_round=True)
        world = s.the_world()
        self.stack.publish(world, s.run_dir.path)
        announce_round(self.log, plan, before, world)
        self._enter_world()
        self.log.info(
            "restarted",
            f"generation {g}: all {len(s.workers.by_local)} local "
            f"workers restarted in a world of {world.world_size} in "
            f"{time.monotonic() - t0:.3f}s",
            restart_s=round(time.monotonic() - t0, 4),
        )
        return None

    def _finish(self) -> int | None:
        s = self.state
        assert s.executor is not None
        out = s.executor.finish(s.generation, s.events)
        return out if isinstance(out, int) else self._dispatch(out)

    # ------------------------------------------------------------------ signals and shutdown
    def _install_signals(self) -> None:
        for sig in self.cfg.signals_to_handle:
            try:
                signal.signal(sig, self._signal_handler)
            except (ValueError, OSError):
                pass

    def _signal_handler(self, signum: int, frame: object) -> None:
        """No I/O here: note the signal, interrupt the rendezvous, wake the loop. In the
        rendezvous (before any worker exists) raise, as torchrun does, to end any wait."""
        s = self.state
        if s.signum is None:
            s.signum = signum
        s.stopping.set()
        self.stack.interrupt()
        s.events.put(SignalEvent(signum))
        if s.phase is AgentPhase.JOINING:
            s.phase = AgentPhase.STOPPING  # raise once; no I/O here (no phase record)
            raise AgentSignal(signum)

    def _on_signal(self, ev: SignalEvent) -> int:
        """torchrun: SignalException -> workers stopped with the signal, exit code 1."""
        name = signal.Signals(ev.signum).name
        self.log.warning(
            "signal",
            f"received {name}: forwarding to workers, then leaving the "
            f"job (grace {self.cfg.shutdown_timeout:g}s)",
            signal=name,
        )
        self.state.enter(AgentPhase.STOPPING)
        stop_workers(self.state.workers.all(), ev.signum, self.cfg.shutdown_timeout)
        return 1

    # ------------------------------------------------------------------ self-fencing
    def _on_lost_news(self, lost: object) -> None:
        """Membership thread: this agent is no longer a member; the loop self-fences."""
        self.state.events.put(NodeLostEvent(str(getattr(lost, "message", lost))))

    def _on_lost(self, ev: NodeLostEvent) -> int | None:
        """Cut off from the store longer than the liveness timeout: kill the local workers at
        once (the others already count them lost), then leave with the reason."""
        err = self.stack.lost_error()
        end_out_of_world(self.state, err)  # its ranks left the world and the job ended: exit 0
        reason = str(err) if err is not None else ev.reason
        self.log.error(
            "self-fence",
            f"this node lost its membership ({reason}): killing its "
            f"{len(self.state.workers.alive())} local worker(s) at once",
            reason=reason,
        )
        stop_workers(self.state.workers.all(), signal.SIGKILL, 0.0)
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
        s = self.state
        stop_workers(s.workers.all(), signal.SIGKILL, 0.0)
        slow = lambda msg: self.log.warning("shutdown-slow", msg)  # noqa: E731
        parts = [self.observer, s.role, *self._feeds, s.channel, s.reaper, s.notices]
        _stop_together([*parts, s.spawner, s.reporter, s.loop_store], slow)
        reason = LEAVE_SIGNAL if s.signum is not None else None
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
        s.enter(AgentPhase.DONE)
        self.log.close()


def signalled_in_rendezvous(log: AgentLog, signum: int | None, e: Exception) -> int:
    """A signal (or a stop) ended the rendezvous: torchrun's exit code 1."""
    name = signal.Signals(signum).name if signum else "a stop request"
    log.warning(
        "signal", f"received {name} during the rendezvous: leaving at once ({e})", signal=name
    )
    return 1


def announce_start(cfg: LaunchConfig, log: AgentLog) -> None:
    """The agent's first lines: its configuration, notes, hang policy, OMP_NUM_THREADS."""
    log.info("start", f"ftrun {cfg.describe()}", config=cfg.public())
    for note in cfg.notes:
        log.info("note", note)
    log.info("hang-policy", f"hang detection: {cfg.hang.describe()}", hang_timeout=cfg.hang.timeout)
    if "OMP_NUM_THREADS" not in os.environ and cfg.nproc_per_node > 1:
        log.warning(
            "omp",
            "Setting OMP_NUM_THREADS environment variable for each process "
            "to be 1 in default, to avoid your system being overloaded, please "
            "further tune the variable for optimal performance in your "
            "application as needed.",
        )


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
            f"shutdown: {', '.join(late)} did not stop within {STOP_TOGETHER_S:g} s; "
            "going on without them"
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
