"""Node-level rendezvous on any KVStore: join, group ranks, hot spares, replacements, leaving,
self-fencing and the controller role.

Owns: `Membership` (one per agent; its API), built from a `MembershipSettings`
(`rendezvous.nodes.settings`: who this node is, the world it expects, torchrun's `--rdzv-conf`
settings). How it joins is split by job: finding, closing and entering the world is
`rendezvous.nodes.joining.Joining`, taking over a running world (replacement, hot spare) is
`rendezvous.nodes.replacing.Replacing`; `Membership` keeps the API, watching, leaving,
fencing, rounds and the controller role. The records it returns are in `rendezvous.nodes.world`
(`NodeWorld`, `NodeInfo`, `SpareInfo`), its store keys and node record in
`rendezvous.nodes.keys`, its errors in `rendezvous.errors`. How agents show they are alive and
learn of each other's deaths is `rendezvous.nodes.liveness` (leases on etcd, heartbeats
elsewhere); the etcd controller election is `rendezvous.nodes.election`.

Rendezvous (once per run; the world is written once under WORLD_KEY and read by everyone):
  * static (node_rank given, nnodes fixed): each agent registers under its node rank; the
    first agent that sees all nnodes registrations writes the world (create-if-absent).
    group_rank == node_rank.
  * dynamic (node_rank None, --nnodes MIN:MAX; c10d, etcd, etcd-v2, parallel): agents take
    arrival slots from a counter; the agent taking slot MAX-1 closes the world at once; once MIN
    have arrived every agent starts a `last_call_timeout` timer and the first timer to fire
    closes the world with whoever has arrived (at most MAX). Group ranks follow arrival slots.
    No node rank is needed (the caller passes None for these backends).
  * an agent that arrives after the world is closed: a static agent takes its node rank back
    once its previous holder is dead (a replacement); a dynamic agent takes a vacant group rank
    (its holder died or left by signal) or, when there is none, waits as a **hot spare**: its
    record is visible under `keys.spare_key` (`Membership.spares()` lists them with their
    addresses) and it claims the next vacancy itself (first claim wins), keeping the rank's
    rank base; the survivors keep theirs and hear of it through `on_join`. A spare ends with
    `RendezvousGracefulExit` when every node left with reason "done" (the run finished).

The API an agent uses:
    m = Membership(kv, MembershipSettings(node_rank, nmin, nmax, lws, addr, run_id,
                                          rdzv=RendezvousSettings(...), hosts_store=...))
    world = m.join(stop=shutdown_event)   # every wait ends within waits.SLICE of stop.set()
                                          # (JoinInterrupted) or m.interrupt() (signal-safe)
    m.watch_nodes(on_dead, on_join, on_leader, on_lost=on_lost)
    ... on SIGTERM/SIGINT/SIGHUP: m.leave(keys.LEAVE_SIGNAL)  (left marker + lease revoked at
        once: the others see a leave, not a death; a spare may take the ranks)
    ... at a normal end: m.stop()       (reason LEAVE_DONE)
    ... on_lost(Lost) / m.lost set: m.lost_error() says what to do (NodeLostError: kill the
        local workers, m.stop(leave=False), then m.renew().join() as a fresh node;
        StoreHostLostError: the embedded store is gone, print it and exit)
    ... controller writes: m.checked_set(key, value), m.advance_generation(old, new)
        (FencedError when this agent is stale); m.check_member(what) before any other control
        write; m.stale(group_rank, incarnation) for a reader to refuse a stale writer's record
    ... etcd only (m.can_elect): m.elect(on_elected, on_deposed) -> Election

The leader is group rank 0 in a static world and the lowest live group rank in a dynamic one
(see `rendezvous.nodes.liveness.roster`); with etcd, `elect()` makes the controller role move to
another agent when its node is lost.

A store that still holds the world of an earlier run with the same run id whose nodes are all
gone (finished or crashed) is detected at join: one agent retires that world, clears the run's
keys and everyone starts a fresh rendezvous (generation 0).

The global recovery generation lives at `keys.GENERATION_KEY` (written by the controller);
membership initialises it to 0 and reads it for `current_generation()`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from typing import Callable

from rendezvous.errors import (
    STORE_UNREACHABLE,
    FencedError,
    JoinInterrupted,
    NodeLostError,
    RendezvousError,
    RendezvousGracefulExit,
    StoreHostLostError,
)
from rendezvous.kv import KVStore, StoreError
from rendezvous.nodes import rounds
from rendezvous.nodes.election import Election, read_controller
from rendezvous.nodes.joining import Joining
from rendezvous.nodes.keys import (
    GENERATION_KEY,
    LEAVE_DONE,
    LEAVE_ROUND,
    LEAVE_SIGNAL,
    SPARE_PREFIX,
    WORLD_KEY,
    Registration,
    left_key,
)
from rendezvous.nodes.liveness import LeaseLiveness, Lost, Timing, liveness_for
from rendezvous.nodes.replacing import Replacing
from rendezvous.nodes.settings import MembershipSettings, RendezvousSettings
from rendezvous.nodes.waits import Interrupt
from rendezvous.nodes.world import NodeInfo, NodeWorld, SpareInfo

__all__ = [
    "FencedError",
    "JoinInterrupted",
    "Lost",
    "Membership",
    "MembershipSettings",
    "NodeInfo",
    "NodeLostError",
    "NodeWorld",
    "RendezvousError",
    "RendezvousGracefulExit",
    "RendezvousSettings",
    "SpareInfo",
    "StoreHostLostError",
]

log = logging.getLogger("ftrun.membership")


class Membership(Joining, Replacing):
    """Node-level rendezvous and liveness for one agent (API: see the module docstring). Built
    from `MembershipSettings`; `previous`, `prev_rank` and `expect` are set by `renew()` and
    `next_round()` for the Membership that follows this one."""

    def __init__(
        self,
        kv: KVStore,
        settings: MembershipSettings,
        *,
        previous: NodeWorld | None = None,
        prev_rank: int = -1,
        expect: int = 0,
    ) -> None:
        if not isinstance(settings, MembershipSettings):
            raise TypeError(f"settings={settings!r}: must be a MembershipSettings")
        self.kv = kv
        self.settings = settings
        self.rdzv = settings.rdzv
        self.timing = Timing(
            float(self.rdzv.keep_alive_interval), float(self.rdzv.liveness_timeout)
        )
        self.node_rank = settings.node_rank
        self.nnodes_min, self.nnodes_max = settings.nnodes_min, settings.nnodes_max
        self.local_world_size = settings.local_world_size
        self.host = settings.host
        self.run_id = settings.run_id
        self.hosts_store = settings.hosts_store
        self.prev_rank = prev_rank  # next_round(): group rank in the previous round
        self.expect = expect  # next_round(): close as soon as this many arrived
        self.previous = previous  # the world of the lost agent this one renews (renew())
        self.static = settings.static
        self.nonce = uuid.uuid4().hex
        self.pid = os.getpid()
        self.world: NodeWorld | None = None
        self.incarnation = 0
        self._interrupt = Interrupt()
        self.liveness = liveness_for(kv, self.timing, self.static, self.nonce)
        self.liveness.interrupt = self._interrupt
        self.lost = self.liveness.roster.lost  # set when this agent is no longer a member
        self._watch_lock = threading.Lock()
        self._watching = False
        self._election: Election | None = None
        self._round_opened = 0  # the round a retired marker seen at join opened
        self._slot: int | None = None  # dynamic arrival slot while the world is not closed

    def renew(self) -> "Membership":
        """A fresh identity (new nonce, next incarnation) with the same parameters, to rejoin
        after this one was lost. Call `stop(leave=False)` on this one first."""
        return Membership(self.kv, self.settings, previous=self.world or self.previous)

    # ------------------------------------------------------------------------------ reading

    @property
    def group_rank(self) -> int:
        if self.world is None:
            raise RendezvousError("join() has not completed")
        return self.world.group_rank

    def current_generation(self) -> int:
        """The global generation (keys.GENERATION_KEY), identical on every node."""
        raw = self.kv.try_get(GENERATION_KEY)
        return int(raw) if raw else 0

    def leader(self) -> int:
        """The current leader's group rank by the leader rule (see module docstring)."""
        return self.liveness.roster.leader()

    def alive_nodes(self) -> list[int]:
        """Group ranks this agent currently believes alive (itself included)."""
        return sorted(self.liveness.roster.alive())

    def spares(self) -> list[SpareInfo]:
        """The hot spares waiting for a vacancy now (address, pid, local world size)."""
        out = []
        for raw in self.liveness.spares(SPARE_PREFIX):
            try:
                out.append(SpareInfo.from_registration(Registration.from_json(raw)))
            except (ValueError, TypeError, KeyError):
                continue
        return out

    def store_host(self) -> NodeInfo | None:
        """The node whose agent hosts the embedded store (None with etcd or when unknown)."""
        world = self.world or self.previous
        return world.store_host() if world is not None else None

    @property
    def can_elect(self) -> bool:
        """True when the store supports a controller election (etcd)."""
        return isinstance(self.liveness, LeaseLiveness)

    def lost_error(self) -> NodeLostError | None:
        """None while this agent is a member; else what happened, as the error to act on (its
        message is one line for the log). Always: kill the local workers (self-fence), call
        stop(leave=False), then renew().join() to come back as a fresh node."""
        info = self.liveness.roster.lost_info
        if info is None:
            return None
        msg = info.message
        if info.kind == STORE_UNREACHABLE and not self.can_elect:
            msg += (
                f"; the embedded store is at {self._store_address()}: if it does not answer "
                f"within read_timeout={self.rdzv.read_timeout:g}s on rejoin, the job cannot "
                "continue"
            )
        return NodeLostError(msg, info.kind)

    # ------------------------------------------------------------------------------ joining

    def join(self, timeout: float | None = None, stop: threading.Event | None = None) -> NodeWorld:
        """Rendezvous; block until the world is decided, this agent replaced a lost node, or a
        hot spare's wait found a vacancy. Raises JoinInterrupted within waits.SLICE of
        `stop.set()` / `interrupt()` (after leaving), RendezvousGracefulExit when the run ended
        while waiting as a spare, StoreHostLostError when a renewed agent cannot reach the
        embedded store, RendezvousError/StoreTimeout after `timeout` (default join_timeout)."""
        if self.world is not None:
            return self.world
        self._interrupt.follow(stop)
        timeout = self.rdzv.join_timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + timeout
        try:
            if self.previous is not None and not self.can_elect:
                self._probe_store()
            self.liveness.begin()
            world = self._find_world(deadline, timeout)
        except BaseException as exc:
            interrupted = self._interrupt.is_set()
            self._withdraw()
            self.stop(leave=True, reason=LEAVE_SIGNAL if interrupted else LEAVE_DONE)
            if interrupted and not isinstance(exc, JoinInterrupted):
                # stop() from another thread can make a store call fail before the check
                raise JoinInterrupted(f"rendezvous: interrupted (stop requested): {exc}") from exc
            raise
        self.world = world
        self.start_heartbeat()
        log.info(
            "node %d joined run %s: %d nodes, world size %d, leader node %d, generation %d%s",
            world.group_rank,
            self.run_id,
            world.group_world_size,
            world.world_size,
            world.leader_node,
            world.generation,
            " (hot spare)" if world.from_spare else " (replacement)" if world.rejoined else "",
        )
        return world

    def start_heartbeat(self) -> None:
        """Start the liveness thread (lease refresh on etcd, heartbeat counter elsewhere) and
        the self-check. Idempotent; join() starts it. Stopped by stop()."""
        self.liveness.start()

    def watch_nodes(
        self,
        on_dead: Callable[[int], None],
        on_join: Callable[[int], None] | None = None,
        on_leader: Callable[[int], None] | None = None,
        on_lost: Callable[[Lost], None] | None = None,
        on_round: Callable[[int], None] | None = None,
        on_left: Callable[[int, str], None] | None = None,
    ) -> None:
        """Report other nodes' deaths (`on_dead(group_rank)`, once per incarnation, within the
        heartbeat/lease timeout), replacements and spares taking a rank (`on_join`), leader
        changes (`on_leader`), this agent losing its membership (`on_lost(Lost)`: see
        lost_error()), a new rendezvous round being requested (`on_round(round)`: stop the
        workers, then next_round()) and other nodes leaving on purpose (`on_left(group_rank,
        reason)`, the keys.LEAVE_* reason of their left marker). Callbacks run on a
        membership thread: keep them short (queue the work). Call once, after join()."""
        if self.world is None:
            raise RendezvousError("watch_nodes() needs join() first")
        with self._watch_lock:
            if self._watching:
                raise RendezvousError("watch_nodes() was already called")
            self._watching = True
        self.liveness.roster.subscribe(on_dead, on_join, on_leader)
        self.liveness.roster.on_lost(on_lost)
        self.liveness.roster.on_left(on_left)
        self.liveness.watch([n.node_rank for n in self.world.nodes])
        if on_round is not None:
            self.liveness.spawn(lambda: self._watch_round(on_round), "round")

    # ------------------------------------------------------------------------------ leaving

    def interrupt(self) -> None:
        """Ask a running join() to give up (JoinInterrupted). No I/O: safe in a signal
        handler; call leave() afterwards from a normal thread."""
        self._interrupt.set()

    def leave(self, reason: str = LEAVE_SIGNAL) -> None:
        """Leave at once (SIGTERM/SIGINT/SIGHUP): left marker with `reason`, lease revoked, so
        the others see a leave within ~1 s, not a death after the timeout; with a reason other
        than LEAVE_DONE a hot spare may take this node's ranks. Same as stop(True, reason)."""
        self.stop(leave=True, reason=reason)

    def stop(self, leave: bool = True, reason: str = LEAVE_DONE) -> None:
        """Stop every membership thread, watch and election. With `leave`, tell the others
        this node left on purpose (they get no on_dead). A lost agent drops its lease either
        way. Idempotent; does not close the store."""
        self._interrupt.set()
        if self._election is not None:
            self._election.stop(resign=leave)
        self.liveness.stop(leave, reason)

    # ------------------------------------------------------------------------------ fencing

    def checked_set(self, key: str, value: bytes) -> None:
        """Write a control key only while this agent is a member holding its group rank
        (etcd: one transaction guarded by its node record). FencedError when it is stale."""
        self.liveness.fenced_set(key, value)

    def check_member(self, what: str) -> None:
        """Refuse (FencedError, logged) a write described by `what` when this agent is stale:
        lost, declared dead, or its group rank belongs to another agent now. One read; the
        reader of the write must still check the writer (see `stale()`)."""
        self.liveness.check_member(what)

    @property
    def me(self) -> tuple[int, int]:
        """(group rank, incarnation) this agent holds; (-1, 0) before join()."""
        return self.liveness.roster.me

    def stale(self, group_rank: int, incarnation: int) -> str:
        """Why incarnation `incarnation` of node `group_rank` may write nothing any more ("" while
        it is the node's live holder): declared dead, left, or replaced."""
        if self.liveness.gone_for_good(group_rank, incarnation):
            return (
                f"node {group_rank} incarnation {incarnation} was declared dead, left or "
                "was replaced"
            )
        return ""

    def advance_generation(self, expected: int, new: int) -> bool:
        """Move keys.GENERATION_KEY from `expected` to `new` (compare-and-set); False when it
        no longer holds `expected`. FencedError when this agent is stale."""
        want = str(new).encode()
        return (
            self.liveness.fenced_compare_set(GENERATION_KEY, str(expected).encode(), want) == want
        )

    # ------------------------------------------------------------------------------ rounds

    def request_round(self) -> int:
        """Ask for a new rendezvous round that includes the waiting spares (scale_up=restart;
        the controller calls it). Returns the new round number (also when another agent
        requested it first). Every member hears of it through on_round and calls
        next_round(). See rendezvous.nodes.rounds. FencedError when this agent is stale."""
        if self.static or self.world is None:
            raise RendezvousError(
                "a new rendezvous round needs a joined dynamic world "
                "(--nnodes MIN:MAX without --node-rank)"
            )
        raw = self.kv.get(WORLD_KEY, self.rdzv.read_timeout)
        doc = json.loads(raw)
        if not doc.get("retired"):
            expect = min(self.nnodes_max, len(self.alive_nodes()) + len(self.spares()))
            want = rounds.marker(self.world.round + 1, expect, self.nonce)
            got = self.liveness.fenced_compare_set(WORLD_KEY, raw, want)
            doc = json.loads(got)
            if got == want:
                log.info(
                    "node %d asks for rendezvous round %d (%d nodes expected)",
                    self.world.group_rank,
                    doc["round"],
                    expect,
                )
        return int(doc.get("round", 0))

    def next_round(
        self, timeout: float | None = None, stop: threading.Event | None = None
    ) -> "Membership":
        """Leave this round and join the requested one (see rendezvous.nodes.rounds); returns the
        new, joined Membership (this one is stopped). Survivors keep their group ranks when nobody
        was lost. Raises like join()."""
        assert self.world is not None, "next_round() needs join() first"
        doc = rounds.pending(self.kv, self.world.round)
        if doc is None:
            raise RendezvousError(f"no rendezvous round after {self.world.round} was requested")
        me = self.liveness.roster.me
        others = [(gr, inc) for gr, inc in self.liveness.roster.alive().items() if gr != me[0]]
        self.stop(leave=True, reason=LEAVE_ROUND)
        if doc.get("by") == self.nonce:
            waits = Interrupt()
            waits.follow(stop)
            if not rounds.wait_left(
                lambda: all(self.liveness.gone_for_good(g, i) for g, i in others),
                self.rdzv.close_timeout,
                waits.sleep,
            ):
                log.warning(
                    "round %d: not every node left round %d within %gs; going on",
                    doc["round"],
                    self.world.round,
                    self.rdzv.close_timeout,
                )
            rounds.wipe(self.kv, whole_run=False)
        nxt = Membership(
            self.kv,
            self.settings,
            prev_rank=self.world.group_rank,
            expect=int(doc.get("expect", 0)),
        )
        nxt._round_opened = int(doc["round"])
        nxt.join(timeout, stop)
        return nxt

    def _watch_round(self, on_round: Callable[[int], None]) -> None:
        assert self.world is not None
        while not self.liveness.stopping.wait(self.timing.interval):
            try:
                doc = rounds.pending(self.kv, self.world.round)
            except StoreError:
                continue
            if doc is not None:
                log.info(
                    "node %d: rendezvous round %d was requested",
                    self.world.group_rank,
                    doc["round"],
                )
                try:
                    on_round(int(doc["round"]))
                except Exception:  # noqa: BLE001 - a failing callback must not kill the thread
                    log.exception("on_round callback failed")
                return

    # ------------------------------------------------------------------------------ controller

    def elect(
        self,
        on_elected: Callable[[], None],
        on_deposed: Callable[[], None],
        defer: float | None = None,
    ) -> Election:
        """Run for controller (etcd only, after join): `on_elected()` when this agent becomes
        it, `on_deposed()` when it loses the role (its lease expired); all but the leader-rule
        leader first wait `defer` s (default two keep-alive intervals) for it to be elected.
        RendezvousError on the embedded store, where the controller stays with the leader
        rule."""
        if not isinstance(self.liveness, LeaseLiveness):
            raise RendezvousError(
                "controller election needs etcd (--rdzv-backend etcd); with the "
                "embedded store the controller runs on the leader node and "
                "losing the store host ends the job"
            )
        if self.world is None or self._election is not None:
            raise RendezvousError("elect() needs join() first and runs once")
        me = self.world.me
        self._election = Election(
            self.kv,
            self.liveness.lease,
            {
                "group_rank": me.node_rank,
                "incarnation": self.incarnation,
                "host": self.host,
                "nonce": self.nonce,
            },
            self.lost,
            on_elected,
            on_deposed,
            defer=(0.0 if me.node_rank == self.leader() else 2 * self.timing.interval)
            if defer is None
            else defer,
        ).start()
        return self._election

    def why_gone(self, group_rank: int, incarnation: int) -> str:
        """One phrase for how incarnation `incarnation` of node `group_rank` went: the reason of
        its left marker, else its lease expired / heartbeats stopped (crashed or cut off)."""
        try:
            raw = self.kv.try_get(left_key(group_rank, incarnation))
        except StoreError:
            raw = None
        if raw is not None:
            try:
                reason = str(json.loads(raw).get("reason", "")) or "left"
            except (ValueError, AttributeError):
                reason = "left"
            return f"it left ({reason})"
        if self.can_elect:
            return "its lease expired (node crashed or cut off from etcd)"
        return "it stopped heartbeating (node crashed or cut off from the store)"

    def controller(self) -> int | None:
        """The elected controller's group rank (etcd, None while there is none), or the leader
        by the leader rule on the embedded store."""
        if not self.can_elect:
            return self.leader()
        rec = read_controller(self.kv)
        return int(rec["group_rank"]) if rec is not None else None
