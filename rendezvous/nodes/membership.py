"""Node-level rendezvous on any KVStore: join, group ranks, hot spares, replacements, leaving,
self-fencing and the controller role.

Owns: `Membership` (one per agent). The records it returns are in `rendezvous.nodes.world`
(`NodeWorld`, `NodeInfo`, `SpareInfo`), its store keys and node record in `rendezvous.nodes.keys`,
its errors in `rendezvous.errors`, its settings (torchrun's `--rdzv-conf` names) in
`rendezvous.nodes.settings`. How agents show they are alive and learn of each other's deaths is
`rendezvous.nodes.liveness` (leases on etcd, heartbeats elsewhere); the etcd controller election is
`rendezvous.nodes.election`.

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
    m = Membership.from_settings(kv, node_rank, nmin, nmax, lws, addr, run_id, settings,
                                 hosts_store=...)
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
import socket
import threading
import time
import uuid
from typing import Any, Callable

from rendezvous.errors import (
    STORE_UNREACHABLE,
    FencedError,
    JoinInterrupted,  # noqa: F401
    NodeLostError,
    RendezvousError,
    RendezvousGracefulExit,
    StoreHostLostError,
)
from rendezvous.kv import KVStore, StoreError, StoreTimeout
from rendezvous.nodes import rounds
from rendezvous.nodes.election import Election, read_controller
from rendezvous.nodes.keys import (
    GENERATION_KEY,
    JOIN_SEQ_KEY,
    LEAVE_DONE,
    LEAVE_ROUND,
    LEAVE_SIGNAL,
    RUN_ID_KEY,
    SPARE_PREFIX,
    WORLD_KEY,
    Registration,
    incarnation_key,
    join_key,
    left_key,
    spare_key,
    static_join_key,
)
from rendezvous.nodes.liveness import LeaseLiveness, Lost, Timing, liveness_for
from rendezvous.nodes.settings import RendezvousSettings
from rendezvous.nodes.waits import Interrupt, wait_keys
from rendezvous.nodes.world import NodeInfo, NodeWorld, SpareInfo, build_world, node_world

__all__ = [
    "FencedError",
    "JoinInterrupted",
    "Lost",
    "Membership",
    "NodeInfo",
    "NodeLostError",
    "NodeWorld",
    "RendezvousError",
    "RendezvousGracefulExit",
    "SpareInfo",
    "StoreHostLostError",
]

log = logging.getLogger("ftrun.membership")


def _check_args(
    node_rank: int | None,
    nnodes_min: int,
    nnodes_max: int,
    local_world_size: int,
    run_id: str,
    seconds: dict[str, float | None],
) -> None:
    """ValueError naming the first bad constructor argument."""
    if not 1 <= nnodes_min <= nnodes_max:
        raise ValueError(f"nnodes {nnodes_min}:{nnodes_max}: need 1 <= MIN <= MAX")
    if node_rank is not None:
        if nnodes_min != nnodes_max:
            raise ValueError(
                f"node_rank={node_rank} needs a fixed node count, got "
                f"nnodes {nnodes_min}:{nnodes_max} (omit node_rank for MIN:MAX)"
            )
        if not 0 <= node_rank < nnodes_max:
            raise ValueError(f"node_rank={node_rank} must be in 0..{nnodes_max - 1}")
    if local_world_size < 1:
        raise ValueError(f"local_world_size={local_world_size} must be >= 1")
    if not run_id or "/" in run_id:
        raise ValueError(f"run_id={run_id!r} must be a non-empty name without '/'")
    for name, v in seconds.items():
        if v is None and name == "spare_timeout":
            continue
        if not (isinstance(v, (int, float)) and v > 0):
            raise ValueError(f"{name}={v!r} must be a number of seconds > 0")
    if seconds["heartbeat_timeout"] <= seconds["heartbeat_interval"]:  # type: ignore[operator]
        raise ValueError(
            f"heartbeat_timeout={seconds['heartbeat_timeout']} must exceed "
            f"heartbeat_interval={seconds['heartbeat_interval']}"
        )


class Membership:
    """Node-level rendezvous and liveness for one agent (API: see the module docstring)."""

    def __init__(
        self,
        kv: KVStore,
        node_rank: int | None,
        nnodes_min: int,
        nnodes_max: int,
        local_world_size: int,
        host: str,
        run_id: str,
        join_timeout: float = 600.0,
        last_call_timeout: float = 30.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        *,
        close_timeout: float = 30.0,
        read_timeout: float = 60.0,
        spare_timeout: float | None = None,
        scale_up: str = "spare",
        hosts_store: bool = False,
        previous: NodeWorld | None = None,
        prev_rank: int = -1,
        expect: int = 0,
    ) -> None:
        _check_args(
            node_rank,
            nnodes_min,
            nnodes_max,
            local_world_size,
            run_id,
            {
                "join_timeout": join_timeout,
                "last_call_timeout": last_call_timeout,
                "heartbeat_interval": heartbeat_interval,
                "heartbeat_timeout": heartbeat_timeout,
                "close_timeout": close_timeout,
                "read_timeout": read_timeout,
                "spare_timeout": spare_timeout,
            },
        )
        if scale_up not in ("spare", "restart"):
            raise ValueError(
                f"scale_up={scale_up!r}: must be spare (a late node waits as a hot "
                "spare) or restart (a new rendezvous round includes it)"
            )
        self._args: dict[str, Any] = dict(
            node_rank=node_rank,
            nnodes_min=nnodes_min,
            nnodes_max=nnodes_max,
            local_world_size=local_world_size,
            host=host,
            run_id=run_id,
            join_timeout=join_timeout,
            last_call_timeout=last_call_timeout,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
            close_timeout=close_timeout,
            read_timeout=read_timeout,
            spare_timeout=spare_timeout,
            scale_up=scale_up,
            hosts_store=hosts_store,
        )
        self.kv = kv
        self.node_rank = node_rank
        self.nnodes_min, self.nnodes_max = nnodes_min, nnodes_max
        self.local_world_size = local_world_size
        self.host = host
        self.run_id = run_id
        self.join_timeout = float(join_timeout)
        self.last_call_timeout = float(last_call_timeout)
        self.heartbeat_interval = float(heartbeat_interval)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.close_timeout = float(close_timeout)
        self.read_timeout = float(read_timeout)
        self.spare_timeout = None if spare_timeout is None else float(spare_timeout)
        self.hosts_store = hosts_store
        self.scale_up = scale_up
        self.prev_rank = prev_rank  # next_round(): group rank in the previous round
        self.expect = expect  # next_round(): close as soon as this many arrived
        self.previous = previous  # the world of the lost agent this one renews (renew())
        self.static = node_rank is not None
        self.nonce = uuid.uuid4().hex
        self.pid = os.getpid()
        self.world: NodeWorld | None = None
        self.incarnation = 0
        self._interrupt = Interrupt()
        self.liveness = liveness_for(
            kv, Timing(self.heartbeat_interval, self.heartbeat_timeout), self.static, self.nonce
        )
        self.liveness.interrupt = self._interrupt
        self.lost = self.liveness.roster.lost  # set when this agent is no longer a member
        self._watch_lock = threading.Lock()
        self._watching = False
        self._election: Election | None = None
        self._round_opened = 0  # the round a retired marker seen at join opened
        self._slot: int | None = None  # dynamic arrival slot while the world is not closed

    @classmethod
    def from_settings(
        cls,
        kv: KVStore,
        node_rank: int | None,
        nnodes_min: int,
        nnodes_max: int,
        local_world_size: int,
        host: str,
        run_id: str,
        settings: RendezvousSettings | None = None,
        hosts_store: bool = False,
    ) -> "Membership":
        """A Membership with torchrun-named settings (`RendezvousSettings.from_rdzv_conf`)."""
        s = settings or RendezvousSettings()
        return cls(
            kv,
            node_rank,
            nnodes_min,
            nnodes_max,
            local_world_size,
            host,
            run_id,
            join_timeout=s.join_timeout,
            last_call_timeout=s.last_call_timeout,
            heartbeat_interval=s.keep_alive_interval,
            heartbeat_timeout=s.liveness_timeout,
            close_timeout=s.close_timeout,
            read_timeout=s.read_timeout,
            spare_timeout=s.spare_timeout,
            scale_up=s.scale_up,
            hosts_store=hosts_store,
        )

    def renew(self) -> "Membership":
        """A fresh identity (new nonce, next incarnation) with the same parameters, to rejoin
        after this one was lost. Call `stop(leave=False)` on this one first."""
        return Membership(self.kv, **self._args, previous=self.world or self.previous)

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
                f"within read_timeout={self.read_timeout:g}s on rejoin, the job cannot "
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
        timeout = self.join_timeout if timeout is None else float(timeout)
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
        reason)`, the keys.LEAVE_* reason of their left marker). Callbacks run on a membership thread: keep them short
        (queue the work). Call once, after join()."""
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
        raw = self.kv.get(WORLD_KEY, self.read_timeout)
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
        """Leave this round and join the requested one (see rendezvous.nodes.rounds); returns the new,
        joined Membership (this one is stopped). Survivors keep their group ranks when nobody
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
                self.close_timeout,
                waits.sleep,
            ):
                log.warning(
                    "round %d: not every node left round %d within %gs; going on",
                    doc["round"],
                    self.world.round,
                    self.close_timeout,
                )
            rounds.wipe(self.kv, whole_run=False)
        nxt = Membership(
            self.kv, **self._args, prev_rank=self.world.group_rank, expect=int(doc.get("expect", 0))
        )
        nxt._round_opened = int(doc["round"])
        nxt.join(timeout, stop)
        return nxt

    def _watch_round(self, on_round: Callable[[int], None]) -> None:
        assert self.world is not None
        while not self.liveness.stopping.wait(self.heartbeat_interval):
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
            defer=(0.0 if me.node_rank == self.leader() else 2 * self.heartbeat_interval)
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

    # ------------------------------------------------------------------------------ rendezvous

    def _find_world(self, deadline: float, timeout: float) -> NodeWorld:
        """Join the run's world: a new one, or the running one as a replacement or spare."""
        while True:
            self._interrupt.check("rendezvous")
            self._check_run_id()
            raw = self.kv.try_get(WORLD_KEY)
            if raw is None:
                return (
                    self._join_static(deadline, timeout)
                    if self.static
                    else self._join_dynamic(deadline, timeout)
                )
            old = json.loads(raw)
            if old.get("retired"):
                self._round_opened = max(self._round_opened, int(old.get("round", 0)))
                self._wait_wiped(deadline)
            elif self.liveness.world_is_dead([n["node_rank"] for n in old["nodes"]]):
                self._retire(raw, deadline)
            else:
                return self._rejoin(old, deadline)

    def _check_run_id(self) -> None:
        got = self.kv.compare_set(RUN_ID_KEY, b"", self.run_id.encode())
        if got != self.run_id.encode():
            raise RendezvousError(
                f"this store belongs to run {got.decode(errors='replace')!r}, "
                f"not {self.run_id!r} (use another --rdzv-id or store root)"
            )

    def _record(self, **kw: Any) -> Registration:
        return Registration(
            nonce=self.nonce,
            host=self.host,
            pid=self.pid,
            local_world_size=self.local_world_size,
            node_rank=self.node_rank,
            hosts_store=self.hosts_store,
            prev_rank=self.prev_rank,
            **kw,
        )

    def _join_static(self, deadline: float, timeout: float) -> NodeWorld:
        assert self.node_rank is not None
        other = self.liveness.register_join(
            static_join_key(self.node_rank), self._record().to_json(), deadline
        )
        if other is not None:
            o = Registration.from_json(other)
            raise RendezvousError(
                f"node rank {self.node_rank} is already registered by {o.host} "
                f"pid {o.pid} (two agents with the same --node-rank?)"
            )
        keys = [static_join_key(r) for r in range(self.nnodes_max)]
        log.info("node %d registered; waiting for %d nodes", self.node_rank, self.nnodes_max)
        while True:
            complete = wait_keys(self.kv, keys, deadline, self._interrupt, "rendezvous")
            raw = self.kv.try_get(WORLD_KEY)
            if raw is None:
                if not complete:
                    have = sum(self.kv.try_get(k) is not None for k in keys)
                    raise StoreTimeout(
                        f"rendezvous: {have} of {self.nnodes_max} nodes joined within {timeout:g}s"
                    )
                recs = [self.kv.try_get(k) for k in keys]
                if any(r is None for r in recs):
                    continue  # one vanished (dead agent's lease); wait for its replacement
                raw = self._close([Registration.from_json(r) for r in recs if r is not None])
            return self._enter(json.loads(raw), deadline)

    def _join_dynamic(self, deadline: float, timeout: float) -> NodeWorld:
        slot = self.kv.add(JOIN_SEQ_KEY, 1) - 1
        target = min(self.nnodes_max, self.expect) if self.expect > 0 else self.nnodes_max
        if slot >= self.nnodes_max:
            log.info(
                "rendezvous already has %d nodes; waiting for the world to close", self.nnodes_max
            )
            if not wait_keys(self.kv, [WORLD_KEY], deadline, self._interrupt, "rendezvous"):
                raise StoreTimeout(f"rendezvous: the world did not close within {timeout:g}s")
            return self._rejoin(json.loads(self.kv.get(WORLD_KEY, self.read_timeout)), deadline)
        self.liveness.put(join_key(slot), self._record(slot=slot).to_json())
        self._slot = slot
        log.info(
            "joined rendezvous in slot %d (nnodes %d:%d)", slot, self.nnodes_min, self.nnodes_max
        )
        if slot == target - 1:
            raw = self.kv.try_get(WORLD_KEY) or self._close_dynamic(slot + 1)
            return self._enter(json.loads(raw), deadline)
        if slot + 1 < self.nnodes_min:
            if not wait_keys(
                self.kv, [join_key(self.nnodes_min - 1)], deadline, self._interrupt, "rendezvous"
            ):
                have = int(self.kv.try_get(JOIN_SEQ_KEY) or b"0")
                raise StoreTimeout(
                    f"rendezvous: {have} of at least {self.nnodes_min} nodes "
                    f"joined within {timeout:g}s"
                )
        last_call = min(time.monotonic() + self.last_call_timeout, deadline)
        if not wait_keys(self.kv, [WORLD_KEY], last_call, self._interrupt, "rendezvous"):
            count = min(int(self.kv.try_get(JOIN_SEQ_KEY) or b"0"), self.nnodes_max)
            self._close_dynamic(count)
        return self._enter(json.loads(self.kv.get(WORLD_KEY, self.read_timeout)), deadline)

    def _withdraw(self) -> None:
        """A join that fails before the world closes takes back its arrival slot, so the world
        does not close with a node that is gone (etcd: leased, it goes with the lease)."""
        if self._slot is None or self.can_elect:
            return
        try:
            if self.kv.try_get(WORLD_KEY) is None:
                self.kv.delete(join_key(self._slot))
        except StoreError:
            pass

    def _close_dynamic(self, count: int) -> bytes:
        keys = [join_key(s) for s in range(count)]
        # slots are written right after they are taken; close_timeout bounds a slow writer
        wait_keys(
            self.kv, keys, time.monotonic() + self.close_timeout, self._interrupt, "rendezvous"
        )
        members = []
        for k in keys:
            raw = self.kv.try_get(k)
            if raw is not None:  # missing: that agent died between taking and writing its slot
                members.append(Registration.from_json(raw))
        return self._close(members)

    def _close(self, members: list[Registration]) -> bytes:
        """Write the world (first writer wins); return the world that won."""
        world = build_world(members, self.static, self.run_id, self._round_opened)
        raw = json.dumps(world, sort_keys=True).encode()
        won = self.kv.compare_set(WORLD_KEY, b"", raw)
        if won == raw:
            log.info(
                "rendezvous closed: %d nodes, world size %d",
                len(world["nodes"]),
                world["world_size"],
            )
        return won

    def _enter(self, world: dict, deadline: float) -> NodeWorld:
        """Take our place in a freshly closed world (or become a replacement if not in it)."""
        mine = [n for n in world["nodes"] if n.get("nonce") == self.nonce]
        if not mine:
            log.info("the world closed without this agent; trying to replace a lost node")
            return self._rejoin(world, deadline)
        gr = mine[0]["node_rank"]
        self._register(gr)
        self.kv.compare_set(GENERATION_KEY, b"", b"0")
        nw = node_world(world, gr, False, self.run_id)
        nw.generation = self.current_generation()
        nw.me.incarnation = self.incarnation
        self.liveness.roster.reset(
            {n.node_rank: n.incarnation for n in nw.nodes}, [n.node_rank for n in nw.nodes]
        )
        return nw

    def _register(self, gr: int, replacing: bytes | None = None) -> bool:
        """Write our node record for group rank `gr` (new incarnation). With `replacing` (from
        `Liveness.wait_vacant`), replace exactly that record; False if someone else did."""
        inc = self.kv.add(incarnation_key(gr), 1)
        rec = self._record(incarnation=inc, group_rank=gr).to_json()
        if not self.liveness.write_node(gr, rec, replacing):
            return False
        self.incarnation = inc
        self.liveness.registered(gr, inc, rec)
        return True

    # ------------------------------------------------------------------------------ stale runs

    def _retire(self, old_raw: bytes, deadline: float) -> None:
        """Replace a dead world by a 'retired' marker (one agent wins), wipe the run's keys
        (world last), and let every arriving agent start a fresh rendezvous."""
        marker = rounds.marker(0, 0, self.nonce)
        if self.kv.compare_set(WORLD_KEY, old_raw, marker) == marker:
            log.warning(
                "run %s: every node of the earlier rendezvous in this store is gone; "
                "clearing its keys and starting a new rendezvous",
                self.run_id,
            )
            rounds.wipe(self.kv, whole_run=True)
        else:
            self._wait_wiped(deadline)

    def _wait_wiped(self, deadline: float) -> None:
        """Wait until another agent has finished wiping a retired world (rare: polls)."""
        while True:
            raw = self.kv.try_get(WORLD_KEY)
            if raw is None or not json.loads(raw).get("retired"):
                return
            if time.monotonic() >= deadline:
                raise StoreTimeout(
                    "rendezvous: an earlier run's keys were still being cleared "
                    "when the join timeout ran out"
                )
            if not self._interrupt.sleep(0.05):
                self._interrupt.check("rendezvous")

    # ------------------------------------------------------------------------------ replacement

    def _rejoin(self, world: dict, deadline: float) -> NodeWorld:
        if world.get("run_id", self.run_id) != self.run_id:
            raise RendezvousError(f"store holds the world of run {world.get('run_id')!r}")
        n = len(world["nodes"])
        if not self.static:
            for gr in self._vacancies(n):
                if self._try_claim(gr, deadline, judge=False):
                    return self._replaced(world, gr)
            return self._wait_as_spare(world)
        assert self.node_rank is not None
        if self.node_rank >= n:
            raise RendezvousError(
                f"node_rank {self.node_rank} is not in the running world of {n} nodes"
            )
        while True:
            if self._try_claim(self.node_rank, deadline, judge=True):
                return self._replaced(world, self.node_rank)
            if time.monotonic() >= deadline:
                break
            self._interrupt.sleep(
                min(self.heartbeat_interval, max(0.0, deadline - time.monotonic()))
            )
            self._interrupt.check("rendezvous")
        raise RendezvousError(
            f"cannot join run {self.run_id}: node rank {self.node_rank} is "
            "still alive (a replacement only joins in place of a lost node)"
        )

    def _wait_as_spare(self, world: dict) -> NodeWorld:
        """No vacancy: wait as a hot spare, visible under keys.spare_key, until a node is lost
        (claim its rank), the run finishes, stop, or spare_timeout."""
        ranks = list(range(len(world["nodes"])))
        key, rec = spare_key(self.nonce), self._record().to_json()
        self.liveness.put_spare(key, rec)
        log.info(
            "run %s is running with %d nodes: %s waits as a hot spare %s",
            self.run_id,
            len(ranks),
            self.host,
            "for the next lost node"
            if self.scale_up == "spare"
            else "for a new rendezvous round (scale_up=restart)",
        )
        end = None if self.spare_timeout is None else time.monotonic() + self.spare_timeout
        try:
            while True:
                self._interrupt.check("waiting as a hot spare")
                if self.lost.is_set():
                    raise self.lost_error() or NodeLostError("lost while a spare", "")
                for gr in self._vacancies(len(ranks)):
                    if self._try_claim(gr, 0.0, judge=False):
                        log.info("hot spare %s takes over node %d", self.host, gr)
                        return self._replaced(world, gr, from_spare=True)
                doc = rounds.pending(self.kv, int(world.get("round", 0)))
                if doc is not None:
                    log.info("%s joins rendezvous round %d", self.host, doc["round"])
                    self._round_opened = int(doc["round"])
                    return self._find_world(time.monotonic() + self.join_timeout, self.join_timeout)
                if self.liveness.all_done(ranks):
                    raise RendezvousGracefulExit(
                        f"run {self.run_id} finished while this agent waited as a hot spare"
                    )
                if end is not None and time.monotonic() >= end:
                    raise RendezvousError(
                        f"no node of run {self.run_id} was lost within "
                        f"spare_timeout={self.spare_timeout:g}s; this hot "
                        "spare gives up"
                    )
                if not self.can_elect:
                    self.liveness.put_spare(key, rec)  # refresh its time (no lease here)
                self._interrupt.sleep(self.heartbeat_interval)
        finally:
            try:
                self.kv.delete(key)
            except StoreError:
                pass  # leased on etcd: it goes with the lease

    def _vacancies(self, n: int) -> list[int]:
        """Ranks a late dynamic agent may claim: none with scale_up=restart (it waits for a
        new round instead)."""
        return self.liveness.vacancies(list(range(n))) if self.scale_up == "spare" else []

    def _try_claim(self, gr: int, deadline: float, judge: bool) -> bool:
        """Take over group rank `gr` if its current holder is dead. With `judge`, give the
        holder up to one heartbeat timeout to be found dead."""
        patience = (
            min(
                max(0.0, deadline - time.monotonic()),
                self.heartbeat_timeout + 2 * self.heartbeat_interval,
            )
            if judge
            else 0.0
        )
        replacing = self.liveness.wait_vacant(gr, patience, judge)
        return replacing is not None and self._register(gr, replacing)

    def _replaced(self, world: dict, gr: int, from_spare: bool = False) -> NodeWorld:
        nw = node_world(world, gr, True, self.run_id)
        nw.from_spare = from_spare
        me = nw.me
        me.host, me.pid, me.incarnation = self.host, self.pid, self.incarnation
        me.hosts_store = self.hosts_store
        nw.generation = self.current_generation()
        ranks = [node.node_rank for node in nw.nodes]
        alive = self.liveness.survey(ranks, gr)
        nw.leader_node = self.liveness.roster.reset(alive, ranks)
        self.liveness.announce_join(gr, self.incarnation)
        log.info(
            "%s took node %d (incarnation %d)",
            "hot spare" if from_spare else "replacement agent",
            gr,
            self.incarnation,
        )
        return nw

    # ------------------------------------------------------------------------------ store host

    def _store_address(self) -> str:
        node = self.store_host()
        addr = f"{getattr(self.kv, 'host', '?')}:{getattr(self.kv, 'port', '?')}"
        return f"{addr} (node {node.node_rank})" if node is not None else addr

    def _probe_store(self) -> None:
        """A renewed agent on the embedded store: the store must accept a connection within
        read_timeout, else StoreHostLostError (the job cannot continue without it)."""
        host, port = getattr(self.kv, "host", None), getattr(self.kv, "port", None)
        if not isinstance(host, str) or not isinstance(port, int):
            return  # an in-process store (LocalKV): nothing to reach
        end = time.monotonic() + self.read_timeout
        last = ""
        while time.monotonic() < end:
            self._interrupt.check("rejoin")
            try:
                socket.create_connection((host, port), timeout=min(1.0, self.read_timeout)).close()
                return
            except OSError as exc:
                last = exc.strerror or type(exc).__name__
                self._interrupt.sleep(min(0.2, max(0.0, end - time.monotonic())))
        node = self.store_host()
        raise StoreHostLostError(
            node.node_rank if node is not None else None,
            f"{host}:{port}",
            f"no answer for {self.read_timeout:g}s: {last}",
        )
