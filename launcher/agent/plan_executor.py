"""Carrying out the controller's plans on one node, and the barrier of a job that finished.

Owns: what an agent does for each strategy of a `Plan` (the decision is the controller's):
  retry, recover-in-place  push Stop to the surviving local ranks (deferred for a rank not
                           connected yet, delivered when it says hello), kill and respawn the
                           local ranks the plan restarts;
  restart-all              stop every local worker, count this node in the stopped barrier,
                           wait for the controller's go, respawn every local rank;
  dump                     survivors stop and save the current step, then as exit;
  exit                     stop every worker, print the failure summary, exit code 1;
and `finish()`, the barrier of a successful job: every node's workers done, then every agent
leaving (the store host last). Methods return the agent's exit code, or None to keep running.
They run on the agent's event loop: the restart barrier's count is written off it
(`launcher.agent.loop_store`) and the wait for the go ends as soon as this node loses its membership
(the loop then self-fences), so a store that does not answer never holds the loop up.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from typing import Callable

from launcher.agent.agent_events import PlanEvent, SignalEvent
from launcher.agent.errors import JobFailures
from launcher.agent.grow_back import ReturningRanks
from launcher.agent.hot_switch import IncomingRanks
from launcher.agent.loop_store import Call, LoopStore
from launcher.agent.status_relay import StatusRelay
from launcher.agent.store_stack import AgentWorld
from launcher.config import LaunchConfig
from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from launcher.protocol.messages import Stop
from launcher.workers.channel import ChannelServer
from launcher.workers.spawner import Spawner
from launcher.workers.workers import NodeWorkers, Worker, stop_workers
from rendezvous.kv import KVStore

# the rounds the live processes stay in (a stop for the survivors, the failed ones respawned)
LIVE = (P.RETRY, P.RECOVER_IN_PLACE, P.ELASTIC, P.GROW, P.SWITCH)
FINISH_TIMEOUT = 300.0  # all nodes' workers done
LEAVE_TIMEOUT = 10.0  # the store host waits this long for the other agents to leave


class JobFailed(Exception):
    """A phase of a plan cannot complete: the agent exits with `code`."""

    def __init__(self, code: int) -> None:
        super().__init__(f"job failed (exit code {code})")
        self.code = code


class PlanExecutor:
    def __init__(
        self,
        cfg: LaunchConfig,
        log: AgentLog,
        kv: KVStore,
        world: AgentWorld,
        workers: NodeWorkers,
        spawner: Spawner,
        channel: ChannelServer,
        failures: JobFailures,
        stop: threading.Event | None = None,
        dump: Callable[[Worker], object] | None = None,
        store: LoopStore | None = None,
        lost: Callable[[], bool] | None = None,
        stop_sent: Callable[[int, int], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.log = log
        self.kv = kv
        self.world = world
        self.workers = workers
        self.spawner = spawner
        self.channel = channel
        self.failures = failures
        self._pending_stop: dict[int, Stop] = {}  # rank -> stop it has not received yet
        self.stop = stop or threading.Event()  # set by a signal: every wait here ends at once
        self._dump_stacks = dump  # stack dump of a live rank the controller blamed for a hang
        self._store = store  # the agent's off-loop writes (None: written here, tests)
        self._lost = lost or (lambda: False)  # this node lost its membership (it self-fences)
        # (rank, generation): a survivor got a round's stop; the hang watch expects it to enter
        # the round, and kills it when it stays blocked in a collective instead
        self._stop_sent = stop_sent or (lambda rank, generation: None)
        # after a live shrink: the dropped ranks' returning processes (a live grow back)
        self.returning = ReturningRanks(log, kv, workers, spawner, cfg.elastic_grow)
        # a hot switch's incoming processes (ftctl migrate, sub-health)
        self.incoming = IncomingRanks(log, kv, workers, spawner, channel, world.group_rank)
        # the node's ranks' statuses of a process-level round, as one record for the controller
        self.relay = StatusRelay(kv, world.group_rank, log, cfg.phase_timeout, self.stop)
        # nodes a live shrink dropped whole: the end barrier does not wait for them (node_return)
        self.nodes_out: Callable[[], int] = lambda: 0

    def execute(self, plan: P.Plan) -> int | None:
        self.log.info(
            "plan-received",
            f"executing {plan.strategy} for generation {plan.generation} ({plan.reason})",
            strategy=plan.strategy,
            failed_ranks=plan.failed_ranks,
        )
        self.relay.stop(join=0.0)  # a newer plan: the older round's statuses are of no use
        self.incoming.take_over(plan)  # a hot switch's new processes in place, or stopped
        if plan.strategy == P.ELASTIC:  # a live shrink: the failed ranks leave the world
            leaving = self.workers.of_ranks(plan.failed_ranks)
            self.workers.left.update(w.rank for w in leaving)
            peers = [w for w in leaving if w.alive]  # a lost rank's healthy TP/PP peers
            stop_workers(peers, signal.SIGKILL, 0.0)
            self.failures.note_terminated(peers)
        if plan.strategy in LIVE:  # ELASTIC, GROW, SWITCH: no rank restarts, the survivors' stop
            self._recover(plan, respawn=plan.strategy in (P.RECOVER_IN_PLACE, P.RETRY))
        self.returning.after(plan)  # the dropped ranks' returning processes (grow_back)
        if plan.strategy == P.RESTART_ALL:
            return self._restart_all(plan)
        if plan.strategy in LIVE:
            return None
        if plan.strategy == P.DUMP:
            return self._dump(plan)
        return self._exit(plan)

    # ---------------------------------------------------------------- strategies
    def _stop_all(self, sig: int) -> None:
        live = self.workers.alive()
        stop_workers(self.workers.all(), sig, self.cfg.shutdown_timeout)
        self.failures.note_terminated(live)

    def _dump_blamed(self, plan: P.Plan) -> None:
        """A live local rank the controller blamed for a hang: its stacks before it is stopped."""
        cause = plan.root_cause or {}
        if cause.get("kind") != "hang" or self._dump_stacks is None:
            return
        for w in self.workers.of_ranks(plan.failed_ranks):
            if w.alive and w.pid == cause.get("pid", w.pid):
                self._dump_stacks(w)

    def _restart_all(self, plan: P.Plan) -> int | None:
        g = plan.generation
        t0 = time.monotonic()
        self.workers.left.clear()  # every rank of the job starts again (after a live shrink too)
        self._dump_blamed(plan)
        self._stop_all(signal.SIGTERM)
        nodes = self.world.group_world_size

        def counted(n: int) -> None:
            if n >= nodes:
                self.kv.set(P.all_stopped_key(g), b"1")

        if self._store is not None:
            self._store.add(P.stopped_key(g), 1, then=counted)
        else:
            counted(self.kv.add(P.stopped_key(g), 1))
        if not self._wait_go(g, max(self.cfg.join_timeout, 60.0)):
            if self.stop.is_set():
                raise JobFailed(1)  # a signal: the agent leaves (torchrun's exit code 1)
            if self._lost():
                self.log.warning(
                    "restart-abandoned",
                    f"generation {g}: this node lost its "
                    "membership while it waited for the restart; it self-fences",
                )
                return None
            self.log.error(
                "phase-timeout", f"generation {g}: the controller did not release the restart"
            )
            raise JobFailed(1)
        self.workers.aware.clear()
        self.spawner.spawn_all(self.workers.all(), g)
        self.log.info(
            "restarted",
            f"generation {g}: all {len(self.workers.by_local)} local workers "
            f"restarted in {time.monotonic() - t0:.3f}s",
            restart_s=round(time.monotonic() - t0, 4),
        )
        return None

    def _wait_go(self, g: int, timeout: float) -> bool:
        """Wait for the controller's go in slices, ending at once when a signal arrives or this
        node loses its membership. Each slice's store call runs off the loop (a store that does
        not answer blocks a call until read_timeout); an error is retried the next slice."""
        end = time.monotonic() + timeout
        call: Call | None = None
        while not self.stop.is_set() and not self._lost():
            left = end - time.monotonic()
            if left <= 0:
                return False
            if call is None:
                call = Call.start(lambda: self.kv.wait([P.go_key(g)], min(0.25, left)), "go")
            if not call.wait(0.3):
                continue  # the store has not answered yet
            done, call = call, None
            if done.error is None and done.value:
                return True
            if done.error is not None:
                self.stop.wait(0.25)
        return False

    def _recover(self, plan: P.Plan, respawn: bool = True) -> None:
        g = plan.generation
        stop = Stop(generation=g, strategy=plan.strategy, failed_ranks=plan.failed_ranks)
        restart = self.workers.of_ranks(plan.restart_ranks)
        sent_at = (
            time.time()
        )  # no later than any survivor's stop clock (the hang watch's stop_sent)
        for w in self.workers.alive():
            if w in restart:
                continue
            if not self.channel.send(w.rank, stop, pid=w.pid):
                # e.g. a replacement still starting (the connection its killed predecessor
                # left may still be open): it gets the stop as soon as it says hello
                self._pending_stop[w.rank] = stop
                self.log.warning(
                    "stop-deferred",
                    f"rank {w.rank} is not connected yet; the stop for "
                    f"generation {g} is delivered when it connects",
                    rank=w.rank,
                )
            else:
                self._stop_sent(w.rank, g)
        self._dump_blamed(plan)
        for w in restart if respawn else []:
            self._pending_stop.pop(w.rank, None)
            if w.alive:
                stop_workers([w], signal.SIGKILL, 0.0)
            self.workers.aware.discard(w.rank)
            self.spawner.spawn(w, g, replacement=True)
        respawned = [w.rank for w in restart] if respawn else []
        w_left = self.workers.left
        self.relay.follow(
            g, [w.rank for w in self.workers.alive() if w.rank not in w_left and not w.finished]
        )
        self.log.info(
            "stop-sent",
            f"generation {g}: stop sent to survivors, {len(respawned)} local rank(s) respawned",
            respawned=respawned,
            sent_at=sent_at,
        )

    def on_hello(self, rank: int, generation: int) -> None:
        """A rank connected: deliver the stop it missed (when it started before that round)."""
        pending = self._pending_stop.pop(rank, None)
        if pending is not None and generation < pending.generation:
            if self.channel.send(rank, pending):
                self._stop_sent(rank, pending.generation)
            self.log.info(
                "stop-sent",
                f"deferred stop for generation {pending.generation} delivered to rank {rank}",
                rank=rank,
            )

    def _dump(self, plan: P.Plan) -> int:
        """Survivors stop, save the current step (the runtime's dump fallback) and exit."""
        stop = Stop(
            generation=plan.generation, strategy=plan.strategy, failed_ranks=plan.failed_ranks
        )
        for w in self.workers.alive():
            if w.rank not in plan.failed_ranks:
                w.stopping = True
                self.channel.send(w.rank, stop, pid=w.pid)
        deadline = time.monotonic() + max(self.cfg.shutdown_timeout, 120.0)
        for w in self.workers.alive():
            if w.proc is not None:
                try:
                    w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:  # stopped below
                    pass
        self.log.info(
            "dump-done", "survivors saved the current step (dying-gasp checkpoint); exiting"
        )
        return self._exit(plan)

    def _exit(self, plan: P.Plan) -> int:
        self._stop_all(signal.SIGTERM)
        self.failures.print_summary(self.log, os.path.basename(self.cfg.script), plan.reason)
        return 1

    # ---------------------------------------------------------------- a job that finished
    def finish(
        self, generation: int, events: "queue.Queue[object]"
    ) -> int | PlanEvent | SignalEvent:
        """This node's workers all succeeded: wait for every node's, then leave. Returns 0, or
        the event that interrupted the wait (a new round: another node failed; a signal)."""
        n = self.kv.add(P.done_key(generation), 1)
        nodes = self.world.group_world_size - self.nodes_out()
        self.log.info(
            "node-done",
            f"all local workers finished ({n}/{nodes} nodes done)",
            nodes_done=n,
        )
        deadline = time.monotonic() + FINISH_TIMEOUT
        while time.monotonic() < deadline:
            raw = self.kv.try_get(P.done_key(generation))
            if raw is not None and int(raw) >= nodes:
                break
            try:
                ev = events.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(ev, (PlanEvent, SignalEvent)):
                return ev
        self.kv.add(P.EXITED_KEY, 1)
        if self.world.is_leader and self.world.group_world_size > 1:
            end = time.monotonic() + LEAVE_TIMEOUT
            while time.monotonic() < end and not self.stop.is_set():
                raw = self.kv.try_get(P.EXITED_KEY)
                if raw is not None and int(raw) >= nodes:
                    break
                time.sleep(0.05)
        self.log.info("job-done", "job finished successfully")
        return 0
