"""Simulated node agents for scripts/bench_scale.py, built from ftrun's real control plane.

Owns: `SimNode`, one agent of a simulated node: its own `StoreClient` to the job's store, the
real node rendezvous and liveness (`rendezvous.nodes.membership.Membership`: join, heartbeats,
the checker, the event log, hot spares), the real per-node `StoreProxy` its ranks talk to, the
real plan and inject feeds (`launcher.agent.agent_events.KeyFeed`), the agent's periodic store
writes at default settings (the progress record `launcher.control.progress.ProgressBoard`, and
the observer's node status: `plan.node_status_key` written once a second,
`plan.RESTARTS_USED_KEY` read as `launcher.observe.observer` reads it), the aware keys its
ranks' hellos cause, faults posted as `FaultReporter` posts them (`fault_intake.post_fault`),
and what the plan executor does for a process-level plan (Stop to the survivors, a replacement
for each failed rank, and the agent's real `StatusRelay`: the node's statuses posted as one
record). The leader node also runs the real
`launcher.control.controller.Controller` with the agent's hooks, and tells it about lost and
arriving nodes as `launcher.agent.membership_news` does. Only the workers are simulated
(`scale_ranks`).
"""

from __future__ import annotations

import queue
import re
import threading
import time

from scale_measure import CountingStoreClient, RequestCounts
from scale_ranks import RankLoop, RankRecord, SimRank

from launcher.agent.agent_events import PlanEvent, inject_feed, plan_feed
from launcher.agent.status_relay import StatusRelay
from launcher.control.controller import Controller
from launcher.control.controller_settings import ControllerHooks, ControllerSettings
from launcher.control.fault_intake import post_fault
from launcher.control.progress import ProgressBoard
from launcher.observe.logs import AgentLog
from launcher.observe.observer import RESTARTS_AFTER_PLAN, RESTARTS_REFRESH
from launcher.protocol import plan as P
from launcher.protocol.faults import FaultKind
from rendezvous.kv import StoreError
from rendezvous.nodes.membership import Membership
from rendezvous.nodes.settings import MembershipSettings, RendezvousSettings
from rendezvous.nodes.world import NodeWorld
from rendezvous.store.client import StoreClient
from rendezvous.store.proxy import StoreProxy

CHAIN = (P.RETRY, P.RECOVER_IN_PLACE, P.RESTART_ALL, P.EXIT)  # ftrun's default chain
TICK = 1.0  # s: the observer's publication and the progress record (launcher defaults)
RELAYED = "/node_statuses/"  # the relay's record of a node's statuses (`plan.node_statuses_key`)


class SimNode:
    """One simulated agent (see the module docstring). Owned by the benchmark's job:
    `join()` (blocks), `start()`, `crash()` or `stop()`."""

    def __init__(
        self,
        store: tuple[str, int],
        nnodes: int,
        per_node: int,
        run_id: str,
        ranks: RankLoop,
        events_path: str | None = None,
        rdzv: RendezvousSettings | None = None,
        counts: RequestCounts | None = None,
    ) -> None:
        self.store, self.per_node, self.ranks_loop = store, per_node, ranks
        self.kv = (
            StoreClient(store[0], store[1], timeout=60.0)
            if counts is None
            else CountingStoreClient(
                store[0], store[1], timeout=60.0, counts=counts, stamped=(RELAYED,)
            )
        )
        self.settings = MembershipSettings(
            None, nnodes, nnodes, per_node, "127.0.0.1", run_id, rdzv=rdzv or RendezvousSettings()
        )
        self.membership = Membership(self.kv, self.settings)
        self.events_path = events_path
        self.world: NodeWorld | None = None
        self.proxy: StoreProxy | None = None
        self.controller: Controller | None = None
        self.ranks: dict[int, SimRank] = {}
        self.events: queue.Queue[object] = queue.Queue()
        self.plans_seen: dict[int, float] = {}  # generation -> wall time its plan reached us
        # wall times this agent began posting a fault report (before its two requests: the
        # controller may have the report before the poster's thread runs again)
        self.faults_posted: list[float] = []
        self.joined_at = 0.0
        self.started = False
        self.crashed = False
        self._feeds: list = []
        self.relay: StatusRelay | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ---- start --------------------------------------------------------------------------
    def join(self, timeout: float = 600.0) -> NodeWorld:
        self.world = self.membership.join(timeout=timeout, stop=self._stop)
        self.joined_at = time.time()
        return self.world

    @property
    def group_rank(self) -> int:
        assert self.world is not None
        return self.world.group_rank

    def local_ranks(self) -> list[int]:
        base = self.group_rank * self.per_node
        return list(range(base, base + self.per_node))

    def start(self, replacement: bool = False) -> None:
        """After join(): proxy, feeds, membership watch, controller (leader), then the ranks."""
        world = self.world
        assert world is not None
        self.proxy = StoreProxy(self.store, listen_host="127.0.0.1", port=0)
        self.proxy.start()
        g = world.generation
        log = AgentLog(world.group_rank, None, quiet=True)
        self.relay = StatusRelay(self.kv, world.group_rank, log, halt=self._stop)
        self._feeds = [plan_feed(self.kv, g, self.events), inject_feed(self.kv, self.events)]
        for f in self._feeds:
            f.start()
        self.membership.watch_nodes(self._on_dead, self._on_join)
        if world.group_rank == world.leader_node and not replacement:
            self.controller = self._make_controller(world)
            self.controller.start()
        self._spawn(self._event_loop, "events")
        self._spawn(self._tick_loop, "tick")
        if not replacement:  # a hot spare's ranks start with the controller's plan
            self._launch(self.local_ranks(), g, replacement=False)
        self.started = True

    def _make_controller(self, world: NodeWorld) -> Controller:
        settings = ControllerSettings(
            world_size=world.world_size,
            nnodes=world.group_world_size,
            max_restarts=1000,
            chain=CHAIN,
        )
        m = self.membership
        hooks = ControllerHooks(stale=m.stale, fence=m.check_member)
        log = AgentLog(world.group_rank, self.events_path, quiet=True)
        return Controller(self.kv, log, settings, hooks)

    def _launch(self, ranks: list[int], generation: int, replacement: bool) -> None:
        assert self.proxy is not None
        new = [
            SimRank(
                r,
                r - self.group_rank * self.per_node,
                ("127.0.0.1", int(self.proxy.port)),
                generation,
                replacement,
                self._hello,
            )
            for r in ranks
        ]
        for sr in new:
            self.ranks[sr.rank] = sr
        self.ranks_loop.launch(new)

    def records(self) -> list[RankRecord]:
        """What the benchmark reads about this node's ranks (one per local rank started)."""
        return [sr.record for sr in list(self.ranks.values())]

    def idle(self) -> bool:
        """Nothing left on the agent's queue (every hello's aware key written)."""
        return self.events.empty()

    def summary(self) -> dict:
        """What the benchmark polls (compact, JSON): its ranks' count, whether each has its
        world, the (generation, resumed generation) pairs among them, the plans seen, idle."""
        recs = self.records()
        return {
            "n": len(recs),
            "started": all(r.started_at for r in recs),
            "gens": sorted({(r.generation, r.resumed_generation) for r in recs}),
            "plans_seen": dict(self.plans_seen),
            "faults_posted": list(self.faults_posted),
            "relayed": self.relayed(),
            "idle": self.idle(),
        }

    def relayed(self) -> dict[str, float]:
        """Generation (as text) -> wall time this agent's relay posted its node's statuses of
        that round (with a counting client; else none)."""
        out = {}
        for key, t in dict(getattr(self.kv, "stamps", {})).items():
            m = re.search(r"g(\d+)" + RELAYED, key)
            if m:
                out[m.group(1)] = t
        return out

    def spare_waiting(self) -> bool:
        """A hot spare waits (as this node's membership sees it)."""
        return bool(self.membership.spares())

    def _hello(self, rank: int) -> None:
        """(loop thread) A rank's Hello: the agent marks it aware, off the loop."""
        self.events.put(("hello", rank))

    def _spawn(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=f"sim-node-{name}", daemon=True)
        t.start()
        self._threads.append(t)

    # ---- the agent's loop ---------------------------------------------------------------
    def _event_loop(self) -> None:
        while not self._stop.is_set():
            try:
                ev = self.events.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                self._handle(ev)
            except StoreError:
                if self._stop.is_set():
                    return

    def _handle(self, ev: object) -> None:
        if isinstance(ev, PlanEvent):
            self._execute(ev.plan)
        elif isinstance(ev, tuple) and ev[0] == "hello":
            self.kv.set(P.aware_key(ev[1]), b"1")
        elif isinstance(ev, tuple) and ev[0] == "died":
            self._report_death(ev[1])

    def _execute(self, plan: P.Plan) -> None:
        """The plan executor for a process-level plan: Stop(g') to the local survivors, a
        replacement for each local failed rank."""
        g = plan.generation
        self.plans_seen[g] = time.time()
        if self.relay is not None:
            self.relay.stop(join=0.0)
        if plan.strategy not in (P.RETRY, P.RECOVER_IN_PLACE):
            return
        mine = set(self.local_ranks())
        restart = sorted(mine & set(plan.restart_ranks))
        survivors = [self.ranks[r] for r in sorted(mine - set(restart)) if r in self.ranks]

        def stop_all() -> None:
            for sr in survivors:
                sr.request_stop(g)

        self.ranks_loop.call(stop_all)
        if restart:
            self._launch(restart, g, replacement=True)
        assert self.relay is not None  # the agent's relay: this node's statuses as one record
        self.relay.follow(g, sorted(mine))

    def kill_rank(self, rank: int) -> None:
        """SIGKILL one local rank; its agent sees the exit and reports the fault."""
        sr = self.ranks[rank]
        self.ranks_loop.call(sr.kill)
        self.events.put(("died", rank))

    def _report_death(self, rank: int) -> None:
        gr, inc = self.membership.me
        sr = self.ranks[rank]
        self.faults_posted.append(time.time())
        post_fault(
            self.kv,
            P.Fault(
                kind=FaultKind.SIGNAL.value,
                rank=rank,
                node=gr,
                generation=sr.generation,
                message=f"rank {rank} was killed by SIGKILL",
                signal="SIGKILL",
                local_rank=sr.local_rank,
                host="sim",
                by_node=gr,
                by_incarnation=inc,
            ),
        )

    def _tick_loop(self) -> None:
        """The observer's status publication and the health check's progress record."""
        assert self.world is not None
        board = ProgressBoard(self.kv, self.group_rank)
        read_at = -RESTARTS_REFRESH
        while not self._stop.wait(TICK):
            try:  # the restart budget: as the observer reads it (around plans, else rarely)
                last_plan = max(self.plans_seen.values(), default=0.0)
                if time.time() - last_plan < RESTARTS_AFTER_PLAN or (
                    time.monotonic() - read_at >= RESTARTS_REFRESH
                ):
                    read_at = time.monotonic()
                    self.kv.present([P.RESTARTS_USED_KEY])
                self.kv.set(P.node_status_key(self.group_rank), self._status())
                board.publish(self._progress())
            except StoreError:
                if self._stop.is_set():
                    return

    def _status(self) -> bytes:
        gens = {sr.record.generation for sr in self.ranks.values()}
        return (
            f'{{"node": {self.group_rank}, "ranks": {len(self.ranks)}, '
            f'"generations": {sorted(gens)}, "time": {time.time()}}}'
        ).encode()

    def _progress(self) -> dict[int, dict]:
        now = time.monotonic()
        return {
            r: {
                "aware": True,
                "idle_s": round(now - sr.record.beat, 3) if sr.record.beat else 0.0,
                "waiting": False,
                "silent_s": round(now - sr.record.beat, 3) if sr.record.beat else 0.0,
                "state": "R",
                "phase": "step",
                "local_rank": sr.local_rank,
            }
            for r, sr in self.ranks.items()
        }

    # ---- membership news (membership threads) --------------------------------------------
    def _on_dead(self, node: int) -> None:
        if self.controller is not None:
            self.controller.note_node(node, lost=True, why="no heartbeat (simulated crash)")

    def _on_join(self, node: int) -> None:
        if self.controller is not None:
            inc = self.membership.liveness.roster.alive().get(node, 0)
            self.controller.note_arrival(node, inc, host="sim")

    # ---- end ----------------------------------------------------------------------------
    def _halt(self) -> None:
        self._stop.set()
        if self.relay is not None:
            self.relay.stop(join=1.0)
        if self.controller is not None:
            self.controller.stop()
        for f in self._feeds:
            f.stop(1.0)
        for t in self._threads:
            t.join(2.0)
        if self.proxy is not None:
            self.proxy.stop()

    def crash(self) -> None:
        """The node dies: its ranks, proxy and agent at once (no leave, no goodbye)."""
        self.crashed = True
        ranks = list(self.ranks.values())

        def kill_all() -> None:
            for sr in ranks:
                sr.kill()

        self.ranks_loop.call(kill_all)
        self.membership.stop(leave=False)
        self.kv.close()
        self._halt()

    def stop(self) -> None:
        """The job ended: leave on purpose, stop everything this node started."""
        if self.crashed or self._stop.is_set():
            return
        self._halt()
        try:
            self.membership.stop(leave=True)
        finally:
            self.kv.close()
