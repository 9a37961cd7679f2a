"""Node-level rendezvous on any KVStore: join, group ranks, liveness, leader, barriers.

Owns: `Membership` (one per agent) and the records it returns (`NodeWorld`, `NodeInfo`), plus
every store key under `ftrun/rdzv/` and the per-node records at `plan.node_key(group_rank)`.

Rendezvous (once per run; the world is written once under WORLD_KEY and read by everyone):
  * static (node_rank given, nnodes fixed): each agent registers under its node rank; the
    first agent that sees all nnodes registrations writes the world (create-if-absent).
    group_rank == node_rank.
  * dynamic (node_rank None, --nnodes MIN:MAX): agents take arrival slots from a counter; the
    agent taking slot MAX-1 closes the world at once; once MIN have arrived every agent starts a
    `last_call_timeout` timer and the first timer to fire closes the world with whoever has
    arrived (at most MAX). Group ranks follow arrival slots.
  * an agent that arrives after the world is closed is a replacement: static agents take their
    node rank back once its previous holder is dead; dynamic agents take the lowest dead group
    rank. They register again (new incarnation) and the others see it through `on_join`.

Liveness:
  * on etcd (`EtcdKV`): the node record is attached to a lease with TTL = heartbeat_timeout
    that the heartbeat thread refreshes; when the agent dies the lease expires, etcd deletes
    the record and every agent's watch reports it. The leader holds a leased key too; when it
    goes, the lowest live group rank takes it with a create-if-absent transaction.
  * on other stores: agents write a heartbeat counter; the lowest live group rank (the
    checker) watches everyone's counter, every other agent watches the checker; a counter that
    does not move for heartbeat_timeout (by the observer's own clock, so clock skew does not
    matter) is declared dead once (create-if-absent marker) and published on an event log
    that every agent follows with blocking waits.

A store that still holds the world of an earlier run with the same run id whose nodes are all
gone (finished or crashed) is detected at join: one agent retires that world, clears the run's
keys and everyone starts a fresh rendezvous (generation 0).

The global recovery generation lives at `plan.GENERATION_KEY` (written by the controller);
membership initialises it to 0 and reads it for `current_generation()`.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from rendezvous.keys import (EVENT_SEQ_KEY, GENERATION_KEY, JOIN_PREFIX, JOIN_SEQ_KEY, NODE_PREFIX,
                             RDZV, RUN_ID_KEY, WORLD_KEY, Registration as _Record)
from rendezvous.keys import dead_key as _dead_key
from rendezvous.keys import event_key as _event_key
from rendezvous.keys import hb_key as _hb_key
from rendezvous.keys import incarnation_key as _incarnation_key
from rendezvous.keys import join_key as _join_key
from rendezvous.keys import left_key as _left_key
from rendezvous.keys import node_key
from rendezvous.keys import static_join_key as _static_join_key
from rendezvous.kv import KVStore, StoreError, StoreTimeout

log = logging.getLogger("ftrun.membership")

LEADER_KEY = f"{RDZV}/leader"


def _barrier_key(name: str) -> str:
    return f"{RDZV}/barrier/{name}"


class RendezvousError(StoreError):
    """Rendezvous cannot complete (wrong run, duplicate node rank, no vacancy, timeout)."""


@dataclass
class NodeInfo:
    """One node of the world. node_rank is its group rank; ranks [rank_base,
    rank_base + local_world_size) run on it."""

    node_rank: int
    host: str
    pid: int
    local_world_size: int
    rank_base: int = 0
    incarnation: int = 0


@dataclass
class NodeWorld:
    """The result of rendezvous as seen by one agent."""

    generation: int  # global generation when this agent joined (plan.GENERATION_KEY)
    group_rank: int
    group_world_size: int
    nodes: list[NodeInfo]
    world_size: int
    leader_node: int
    rejoined: bool = False  # True for a replacement agent that joined a running job
    run_id: str = ""

    @property
    def me(self) -> NodeInfo:
        return self.nodes[self.group_rank]


@dataclass
class _State:
    """What this agent knows about the others (guarded by Membership._lock)."""

    alive: dict[int, int] = field(default_factory=dict)  # group rank -> incarnation
    dead: set[int] = field(default_factory=set)
    leader: int = 0


class Membership:
    """Node-level rendezvous and liveness for one agent.

    Typical use by an agent:
        m = Membership(kv, node_rank, nnodes_min, nnodes_max, local_world_size, host, run_id)
        world = m.join()                  # blocks until the world is decided
        m.start_heartbeat()               # (already running after join; idempotent)
        m.watch_nodes(on_dead, on_join)   # callbacks on a membership thread
        ...
        m.stop()                          # graceful leave: others get no on_dead
    """

    def __init__(self, kv: KVStore, node_rank: int | None, nnodes_min: int, nnodes_max: int,
                 local_world_size: int, host: str, run_id: str, join_timeout: float = 600.0,
                 last_call_timeout: float = 30.0, heartbeat_interval: float = 1.0,
                 heartbeat_timeout: float = 5.0) -> None:
        if not 1 <= nnodes_min <= nnodes_max:
            raise ValueError(f"nnodes {nnodes_min}:{nnodes_max}: need 1 <= MIN <= MAX")
        if node_rank is not None:
            if nnodes_min != nnodes_max:
                raise ValueError(f"node_rank={node_rank} needs a fixed node count, got "
                                 f"nnodes {nnodes_min}:{nnodes_max} (omit node_rank for MIN:MAX)")
            if not 0 <= node_rank < nnodes_max:
                raise ValueError(f"node_rank={node_rank} must be in 0..{nnodes_max - 1}")
        if local_world_size < 1:
            raise ValueError(f"local_world_size={local_world_size} must be >= 1")
        if not run_id or "/" in run_id:
            raise ValueError(f"run_id={run_id!r} must be a non-empty name without '/'")
        for name, v in (("join_timeout", join_timeout), ("last_call_timeout", last_call_timeout),
                        ("heartbeat_interval", heartbeat_interval),
                        ("heartbeat_timeout", heartbeat_timeout)):
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"{name}={v!r} must be a number of seconds > 0")
        if heartbeat_timeout <= heartbeat_interval:
            raise ValueError(f"heartbeat_timeout={heartbeat_timeout} must exceed "
                             f"heartbeat_interval={heartbeat_interval}")
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
        self.static = node_rank is not None
        self.uses_leases = hasattr(kv, "grant_lease") and hasattr(kv, "watch_prefix")
        self.nonce = uuid.uuid4().hex
        self.pid = os.getpid()
        self.world: NodeWorld | None = None
        self.incarnation = 0
        self.lost = threading.Event()  # set when the others consider this agent dead
        self._lease: Any = None
        self._lock = threading.Lock()
        self._state = _State()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._heartbeat: threading.Thread | None = None
        self._watches: list[Any] = []
        self._watching = False
        self._on_dead: Callable[[int], None] | None = None
        self._on_join: Callable[[int], None] | None = None
        self._on_leader: Callable[[int], None] | None = None
        self._event_next = 1

    # ------------------------------------------------------------------------------ public API

    @property
    def group_rank(self) -> int:
        if self.world is None:
            raise RendezvousError("join() has not completed")
        return self.world.group_rank

    def current_generation(self) -> int:
        """The global generation (plan.GENERATION_KEY), identical on every node."""
        raw = self.kv.try_get(GENERATION_KEY)
        return int(raw) if raw else 0

    def leader(self) -> int:
        """The current leader's group rank (see module docstring)."""
        with self._lock:
            return self._state.leader

    def alive_nodes(self) -> list[int]:
        """Group ranks this agent currently believes alive (itself included)."""
        with self._lock:
            return sorted(self._state.alive)

    def join(self, timeout: float | None = None) -> NodeWorld:
        """Rendezvous; block until the world is decided (or this agent replaced a dead node).
        Raises RendezvousError/StoreTimeout after `timeout` (default join_timeout) seconds."""
        if self.world is not None:
            return self.world
        timeout = self.join_timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + timeout
        if self.uses_leases:
            self._lease = self.kv.grant_lease(self.heartbeat_timeout)  # type: ignore[attr-defined]
            self.start_heartbeat()
        try:
            while True:
                self._check_run_id()
                raw = self.kv.try_get(WORLD_KEY)
                if raw is None:
                    world = (self._join_static(deadline, timeout) if self.static
                             else self._join_dynamic(deadline, timeout))
                    break
                old = json.loads(raw)
                if old.get("retired"):
                    self._wait_wiped(deadline)
                elif self._world_is_dead(old):
                    self._retire(raw, deadline)
                else:
                    world = self._rejoin(old, deadline)
                    break
        except BaseException:
            self.stop(leave=True)  # revokes the lease: our registration disappears
            raise
        self.world = world
        self.start_heartbeat()
        log.info("node %d joined run %s: %d nodes, world size %d, leader node %d, generation %d%s",
                 world.group_rank, self.run_id, world.group_world_size, world.world_size,
                 world.leader_node, world.generation, " (replacement)" if world.rejoined else "")
        return world

    def rejoin(self, timeout: float | None = None) -> NodeWorld:
        """Join a running job as the replacement of a dead node (what join() does on its own
        when the world already exists)."""
        return self.join(timeout)

    def start_heartbeat(self) -> None:
        """Start the liveness thread (lease refresh on etcd, heartbeat counter elsewhere).
        Idempotent; join() starts it. Stopped by stop()."""
        with self._lock:
            if self._heartbeat is not None or self._stop.is_set():
                return
            if not self.uses_leases and self.world is None:
                return  # heartbeat keys are per group rank: started again after join
            target = self._lease_loop if self.uses_leases else self._beat_loop
            t = threading.Thread(target=target, name="ftrun-membership-heartbeat", daemon=True)
            self._heartbeat = t
            self._threads.append(t)
        t.start()

    def watch_nodes(self, on_dead: Callable[[int], None],
                    on_join: Callable[[int], None] | None = None,
                    on_leader: Callable[[int], None] | None = None) -> None:
        """Report other nodes' deaths (`on_dead(group_rank)`, once per incarnation, within the
        heartbeat/lease timeout), replacements joining (`on_join(group_rank)`) and leader
        changes (`on_leader(group_rank)`). Callbacks run on a membership thread: keep them
        short (queue the work). Call once, after join()."""
        if self.world is None:
            raise RendezvousError("watch_nodes() needs join() first")
        with self._lock:
            if self._watching:
                raise RendezvousError("watch_nodes() was already called")
            self._watching = True
            self._on_dead, self._on_join, self._on_leader = on_dead, on_join, on_leader
        if self.uses_leases:
            self._watch_etcd()
        else:
            self._watch_heartbeats()

    def barrier(self, name: str, n: int, timeout: float) -> None:
        """Block until `n` callers have entered barrier `name` (use a fresh name per use, e.g.
        with the generation in it). Raises StoreTimeout after `timeout` seconds."""
        if n < 1:
            raise ValueError(f"barrier {name!r}: n={n} must be >= 1")
        key = _barrier_key(name)
        arrived = self.kv.add(f"{key}/count", 1)
        if arrived > n:
            raise RendezvousError(f"barrier {name!r}: {arrived} arrivals for {n} participants "
                                  "(barrier name reused?)")
        if arrived == n:
            self.kv.set(f"{key}/done", b"1")
        if not self.kv.wait([f"{key}/done"], timeout):
            now = self.kv.try_get(f"{key}/count") or b"?"
            raise StoreTimeout(f"barrier {name!r}: only {now.decode()} of {n} arrived within "
                               f"{timeout:g}s")

    def stop(self, leave: bool = True) -> None:
        """Stop every membership thread and watch. With `leave`, tell the others this node
        left on purpose (they get no on_dead). Idempotent; does not close the store."""
        if self._stop.is_set():
            return
        self._stop.set()
        world = self.world
        if leave and world is not None and self.incarnation:
            try:
                self.kv.set(_left_key(world.group_rank, self.incarnation), b"1")
                if not self.uses_leases:
                    self._publish({"kind": "leave", "group_rank": world.group_rank,
                                   "incarnation": self.incarnation})
            except StoreError as exc:
                log.warning("node %d could not announce its leave: %s", world.group_rank, exc)
        for h in self._watches:
            try:
                h.cancel()
            except StoreError:
                pass
        self._watches.clear()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=max(2.0, 2 * self.heartbeat_interval))
        if self.uses_leases and self._lease is not None and leave:
            try:
                self.kv.revoke_lease(self._lease)  # type: ignore[attr-defined]
            except StoreError as exc:
                log.warning("could not revoke the membership lease: %s", exc)

    # ------------------------------------------------------------------------------ rendezvous

    def _check_run_id(self) -> None:
        got = self.kv.compare_set(RUN_ID_KEY, b"", self.run_id.encode())
        if got != self.run_id.encode():
            raise RendezvousError(f"this store belongs to run {got.decode(errors='replace')!r}, "
                                  f"not {self.run_id!r} (use another --rdzv-id or store root)")

    def _record(self, **kw: Any) -> _Record:
        return _Record(nonce=self.nonce, host=self.host, pid=self.pid,
                       local_world_size=self.local_world_size, node_rank=self.node_rank, **kw)

    def _put_mine(self, key: str, rec: _Record) -> None:
        if self.uses_leases:
            self.kv.put_with_lease(key, rec.to_json(), self._lease)  # type: ignore[attr-defined]
        else:
            self.kv.set(key, rec.to_json())

    def _join_static(self, deadline: float, timeout: float) -> NodeWorld:
        assert self.node_rank is not None
        key = _static_join_key(self.node_rank)
        rec = self._record()
        if self.uses_leases:
            while not self.kv.create(key, rec.to_json(), self._lease):  # type: ignore[attr-defined]
                other = self.kv.try_get(key)
                wait = min(deadline - time.monotonic(), self.heartbeat_timeout + 2.0)
                gone = other is None or self.kv.wait_deleted(  # type: ignore[attr-defined]
                    key, max(0.0, wait))
                if not gone:
                    o = _Record.from_json(other)
                    raise RendezvousError(
                        f"node rank {self.node_rank} is already registered by {o.host} pid "
                        f"{o.pid} (two agents with the same --node-rank?)")
        else:
            self.kv.set(key, rec.to_json())
        keys = [_static_join_key(r) for r in range(self.nnodes_max)]
        log.info("node %d registered; waiting for %d nodes", self.node_rank, self.nnodes_max)
        while True:
            complete = self.kv.wait(keys, max(0.0, deadline - time.monotonic()))
            raw = self.kv.try_get(WORLD_KEY)
            if raw is None:
                if not complete:
                    have = sum(self.kv.try_get(k) is not None for k in keys)
                    raise StoreTimeout(f"rendezvous: {have} of {self.nnodes_max} nodes joined "
                                       f"within {timeout:g}s")
                recs = [self.kv.try_get(k) for k in keys]
                if any(r is None for r in recs):
                    continue  # one vanished (dead agent's lease); wait for its replacement
                raw = self._close([_Record.from_json(r) for r in recs])  # type: ignore[arg-type]
            return self._enter(json.loads(raw), deadline)

    def _join_dynamic(self, deadline: float, timeout: float) -> NodeWorld:
        slot = self.kv.add(JOIN_SEQ_KEY, 1) - 1
        if slot >= self.nnodes_max:
            log.info("rendezvous already has %d nodes; waiting to replace a dead one",
                     self.nnodes_max)
            if not self.kv.wait([WORLD_KEY], max(0.0, deadline - time.monotonic())):
                raise StoreTimeout(f"rendezvous: the world did not close within {timeout:g}s")
            return self._rejoin(json.loads(self.kv.get(WORLD_KEY, 1.0)), deadline)
        self._put_mine(_join_key(slot), self._record(slot=slot))
        log.info("joined rendezvous in slot %d (nnodes %d:%d)", slot, self.nnodes_min,
                 self.nnodes_max)
        if slot == self.nnodes_max - 1:
            raw = self.kv.try_get(WORLD_KEY) or self._close_dynamic(self.nnodes_max)
            return self._enter(json.loads(raw), deadline)
        if slot + 1 < self.nnodes_min:
            if not self.kv.wait([_join_key(self.nnodes_min - 1)],
                                max(0.0, deadline - time.monotonic())):
                have = int(self.kv.try_get(JOIN_SEQ_KEY) or b"0")
                raise StoreTimeout(f"rendezvous: {have} of at least {self.nnodes_min} nodes "
                                   f"joined within {timeout:g}s")
        last_call = time.monotonic() + self.last_call_timeout
        if not self.kv.wait([WORLD_KEY], max(0.0, min(last_call, deadline) - time.monotonic())):
            count = min(int(self.kv.try_get(JOIN_SEQ_KEY) or b"0"), self.nnodes_max)
            self._close_dynamic(count)
        return self._enter(json.loads(self.kv.get(WORLD_KEY, 5.0)), deadline)

    def _close_dynamic(self, count: int) -> bytes:
        keys = [_join_key(s) for s in range(count)]
        self.kv.wait(keys, 5.0)  # slots are written right after they are taken
        members = []
        for k in keys:
            raw = self.kv.try_get(k)
            if raw is not None:  # missing: that agent died between taking and writing its slot
                members.append(_Record.from_json(raw))
        return self._close(members)

    def _close(self, members: list[_Record]) -> bytes:
        """Write the world (first writer wins); return the world that won."""
        if self.static:
            members.sort(key=lambda r: r.node_rank)
        else:
            members.sort(key=lambda r: r.slot)
        nodes, base = [], 0
        for gr, r in enumerate(members):
            nodes.append({"node_rank": gr, "host": r.host, "pid": r.pid,
                          "local_world_size": r.local_world_size, "rank_base": base,
                          "incarnation": 1, "nonce": r.nonce})
            base += r.local_world_size
        world = {"run_id": self.run_id, "static": self.static, "nodes": nodes,
                 "world_size": base, "leader_node": 0}
        raw = json.dumps(world, sort_keys=True).encode()
        won = self.kv.compare_set(WORLD_KEY, b"", raw)
        if won == raw:
            log.info("rendezvous closed: %d nodes, world size %d", len(nodes), base)
        return won

    def _world_from(self, world: dict, group_rank: int, rejoined: bool) -> NodeWorld:
        nodes = [NodeInfo(n["node_rank"], n["host"], n["pid"], n["local_world_size"],
                          n["rank_base"], n.get("incarnation", 1)) for n in world["nodes"]]
        return NodeWorld(generation=0, group_rank=group_rank, group_world_size=len(nodes),
                         nodes=nodes, world_size=world["world_size"],
                         leader_node=world["leader_node"], rejoined=rejoined,
                         run_id=world.get("run_id", self.run_id))

    def _enter(self, world: dict, deadline: float) -> NodeWorld:
        """Take our place in a freshly closed world (or become a replacement if not in it)."""
        mine = [n for n in world["nodes"] if n.get("nonce") == self.nonce]
        if not mine:
            log.info("the world closed without this agent; trying to replace a dead node")
            return self._rejoin(world, deadline)
        gr = mine[0]["node_rank"]
        self._register(gr)
        self.kv.compare_set(GENERATION_KEY, b"", b"0")
        nw = self._world_from(world, gr, rejoined=False)
        nw.generation = self.current_generation()
        nw.me.incarnation = self.incarnation
        with self._lock:
            self._state.alive = {n.node_rank: n.incarnation for n in nw.nodes}
            self._state.leader = nw.leader_node
        if not self.uses_leases:
            self._event_next = int(self.kv.try_get(EVENT_SEQ_KEY) or b"0") + 1
        if self.uses_leases and gr == nw.leader_node:
            self.kv.create(LEADER_KEY, str(gr).encode(), self._lease)  # type: ignore[attr-defined]
        return nw

    def _register(self, gr: int, claim_from: bytes | None = None) -> bool:
        """Write our node record for group rank `gr` (new incarnation). With `claim_from`
        (generic stores), replace exactly that old record; False if someone else did."""
        inc = self.kv.add(_incarnation_key(gr), 1)
        rec = self._record(incarnation=inc, group_rank=gr).to_json()
        if self.uses_leases:
            if not self.kv.create(node_key(gr), rec, self._lease):  # type: ignore[attr-defined]
                return False
        elif claim_from is not None:
            if self.kv.compare_set(node_key(gr), claim_from, rec) != rec:
                return False
        else:
            self.kv.set(node_key(gr), rec)
        self.incarnation = inc
        if not self.uses_leases:
            self.kv.set(_hb_key(gr), f"{inc}:0".encode())
        return True

    # ------------------------------------------------------------------------------ stale runs

    def _world_is_dead(self, world: dict) -> bool:
        """True when no node of a closed world is alive any more: the store holds a finished
        or crashed earlier run with this run id, and a new rendezvous must start."""
        ranks = [n["node_rank"] for n in world["nodes"]]
        if self.uses_leases:  # live agents hold leased join and node records
            return not self.kv.keys(NODE_PREFIX) and not self.kv.keys(JOIN_PREFIX)
        pending = []
        for gr in ranks:
            raw = self.kv.try_get(node_key(gr))
            if raw is not None:
                inc = _Record.from_json(raw).incarnation
                if self.kv.try_get(_dead_key(gr, inc)) or self.kv.try_get(_left_key(gr, inc)):
                    continue
            pending.append(gr)
        if not pending:
            return True
        # undeclared nodes: dead only if none of their heartbeats moves for one timeout
        last = {gr: self.kv.try_get(_hb_key(gr)) for gr in pending}
        end = time.monotonic() + self.heartbeat_timeout
        while time.monotonic() < end:
            time.sleep(min(self.heartbeat_interval / 2, 0.25))
            if any(self.kv.try_get(_hb_key(gr)) != v for gr, v in last.items()):
                return False
        return True

    def _retire(self, old_raw: bytes, deadline: float) -> None:
        """Replace a dead world by a 'retired' marker (one agent wins), wipe the run's keys
        (world last), and let every arriving agent start a fresh rendezvous."""
        marker = json.dumps({"retired": True, "by": self.nonce}).encode()
        if self.kv.compare_set(WORLD_KEY, old_raw, marker) == marker:
            log.warning("run %s: every node of the earlier rendezvous in this store is gone; "
                        "clearing its keys and starting a new rendezvous", self.run_id)
            for key in self.kv.keys(""):
                if key != WORLD_KEY:
                    self.kv.delete(key)
            self.kv.delete(WORLD_KEY)
        else:
            self._wait_wiped(deadline)

    def _wait_wiped(self, deadline: float) -> None:
        """Wait until another agent has finished wiping a retired world (rare: polls)."""
        while True:
            raw = self.kv.try_get(WORLD_KEY)
            if raw is None or not json.loads(raw).get("retired"):
                return
            if time.monotonic() >= deadline:
                raise StoreTimeout("rendezvous: an earlier run's keys were still being cleared "
                                   "when the join timeout ran out")
            time.sleep(0.05)

    # ------------------------------------------------------------------------------ replacement

    def _rejoin(self, world: dict, deadline: float) -> NodeWorld:
        if world.get("run_id", self.run_id) != self.run_id:
            raise RendezvousError(f"store holds the world of run {world.get('run_id')!r}")
        n = len(world["nodes"])
        while True:
            if self.static:
                assert self.node_rank is not None
                if self.node_rank >= n:
                    raise RendezvousError(f"node_rank {self.node_rank} is not in the running "
                                          f"world of {n} nodes")
                candidates = [self.node_rank]
            else:
                candidates = list(range(n))
            for gr in candidates:
                if self._try_claim(gr, deadline, wait=self.static):
                    return self._replaced(world, gr)
            if time.monotonic() >= deadline:
                break
            time.sleep(min(self.heartbeat_interval, max(0.0, deadline - time.monotonic())))
        who = f"node rank {self.node_rank} is" if self.static else f"all {n} nodes are"
        raise RendezvousError(f"cannot join run {self.run_id}: {who} still alive (the job is "
                              "full; a replacement only joins in place of a dead node)")

    def _try_claim(self, gr: int, deadline: float, wait: bool) -> bool:
        """Take over group rank `gr` if its current holder is dead. With `wait`, give the
        holder up to one heartbeat timeout to be found dead."""
        patience = min(max(0.0, deadline - time.monotonic()),
                       self.heartbeat_timeout + 2 * self.heartbeat_interval) if wait else 0.0
        if self.uses_leases:
            if not self.kv.wait_deleted(node_key(gr), patience):  # type: ignore[attr-defined]
                return False
            return self._register(gr)
        old = self.kv.try_get(node_key(gr))
        if old is None:
            return self._register(gr, claim_from=b"")
        inc = _Record.from_json(old).incarnation
        if self.kv.try_get(_dead_key(gr, inc)) is None and \
                self.kv.try_get(_left_key(gr, inc)) is None:
            # not declared dead yet: a static replacement checks the heartbeat itself (the
            # others may all be gone); a dynamic one waits for the checker's verdict
            if not wait or not self._heartbeat_stale(gr, patience):
                return False
            self._declare_dead(gr, inc)
        return self._register(gr, claim_from=old)

    def _heartbeat_stale(self, gr: int, patience: float) -> bool:
        """True when gr's heartbeat does not move for heartbeat_timeout within `patience`."""
        end = time.monotonic() + max(patience, self.heartbeat_timeout)
        last, since = self.kv.try_get(_hb_key(gr)), time.monotonic()
        while time.monotonic() < end:
            time.sleep(min(self.heartbeat_interval / 2, 0.25))
            cur = self.kv.try_get(_hb_key(gr))
            if cur != last:
                last, since = cur, time.monotonic()
            elif time.monotonic() - since >= self.heartbeat_timeout:
                return True
        return False

    def _replaced(self, world: dict, gr: int) -> NodeWorld:
        nw = self._world_from(world, gr, rejoined=True)
        me = nw.me
        me.host, me.pid, me.incarnation = self.host, self.pid, self.incarnation
        nw.generation = self.current_generation()
        alive = {}
        for node in nw.nodes:
            raw = self.kv.try_get(node_key(node.node_rank))
            if raw is None:
                continue
            r = _Record.from_json(raw)
            if node.node_rank != gr and (self.kv.try_get(_dead_key(node.node_rank, r.incarnation))
                                         or self.kv.try_get(_left_key(node.node_rank,
                                                                      r.incarnation))):
                continue
            alive[node.node_rank] = r.incarnation
        with self._lock:
            self._state.alive = alive
            self._state.dead = {n.node_rank for n in nw.nodes} - set(alive)
            self._state.leader = self._current_leader(alive)
            nw.leader_node = self._state.leader
        if not self.uses_leases:
            self._event_next = int(self.kv.try_get(EVENT_SEQ_KEY) or b"0") + 1
            self._publish({"kind": "join", "group_rank": gr, "incarnation": self.incarnation})
        log.info("replacement agent took node %d (incarnation %d)", gr, self.incarnation)
        return nw

    def _current_leader(self, alive: dict[int, int]) -> int:
        if self.uses_leases:
            raw = self.kv.try_get(LEADER_KEY)
            if raw is not None:
                return int(raw)
        if self.static and not self.uses_leases:
            return 0
        return min(alive) if alive else 0

    # ------------------------------------------------------------------------------ etcd liveness

    def _lease_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            try:
                self.kv.refresh_lease(self._lease)  # type: ignore[attr-defined]
            except StoreError as exc:
                if type(exc).__name__ == "LeaseExpiredError":
                    self.lost.set()
                    log.error("this agent's lease expired: the other nodes consider it dead")
                    return
                log.warning("lease refresh failed (will retry): %s", exc)

    def _watch_etcd(self) -> None:
        kv: Any = self.kv
        assert self.world is not None
        # members register right after the world closes; give slow ones one lease TTL
        kv.wait([node_key(n.node_rank) for n in self.world.nodes], self.heartbeat_timeout)
        snap, rev = kv.get_prefix(NODE_PREFIX)
        present: dict[int, int] = {}
        for key, raw in snap.items():
            present[int(key[len(NODE_PREFIX):])] = _Record.from_json(raw).incarnation
        assert self.world is not None
        gone = []
        with self._lock:
            for gr in list(self._state.alive):
                if gr not in present:
                    del self._state.alive[gr]
                    self._state.dead.add(gr)
                    gone.append(gr)
            for gr, inc in present.items():
                self._state.alive[gr] = inc
                self._state.dead.discard(gr)
        self._watches.append(kv.watch_prefix(NODE_PREFIX, self._on_node_event, rev + 1))
        self._watches.append(kv.watch_key(LEADER_KEY, self._on_leader_event, rev + 1))
        for gr in gone:
            self._node_died(gr, None)
        self._elect()

    def _on_node_event(self, ev: Any) -> None:
        try:
            gr = int(ev.key[len(NODE_PREFIX):])
        except ValueError:
            return
        if ev.kind == "put":
            inc = _Record.from_json(ev.value).incarnation
            with self._lock:
                new = self._state.alive.get(gr) != inc
                was_dead = gr in self._state.dead
                self._state.alive[gr] = inc
                self._state.dead.discard(gr)
            if new and (was_dead or inc > 1) and gr != self._my_rank():
                log.info("node %d rejoined (incarnation %d)", gr, inc)
                self._call(self._on_join, gr)
        else:
            with self._lock:
                inc = self._state.alive.pop(gr, None)
                if inc is None:
                    return
                self._state.dead.add(gr)
            self._node_died(gr, inc)
            self._elect()

    def _on_leader_event(self, ev: Any) -> None:
        if ev.kind == "put":
            leader = int(ev.value)
            with self._lock:
                changed, self._state.leader = self._state.leader != leader, leader
            if changed:
                log.info("node %d is the leader now", leader)
                self._call(self._on_leader, leader)
        else:
            self._elect()

    def _elect(self) -> None:
        """If there is no leader and this is the lowest live node, take the leader key."""
        if self._stop.is_set() or self.lost.is_set():
            return
        kv: Any = self.kv
        try:
            if kv.try_get(LEADER_KEY) is not None:
                return
            live = sorted(int(k[len(NODE_PREFIX):]) for k in kv.keys(NODE_PREFIX))
            me = self._my_rank()
            if live and live[0] == me and kv.create(LEADER_KEY, str(me).encode(), self._lease):
                log.info("node %d took over as leader", me)
        except StoreError as exc:
            log.warning("leader election failed: %s", exc)

    # ------------------------------------------------------------------------ heartbeat liveness

    def _beat_loop(self) -> None:
        seq = 0
        gr = self._my_rank()
        while not self._stop.wait(self.heartbeat_interval):
            seq += 1
            try:
                self.kv.set(_hb_key(gr), f"{self.incarnation}:{seq}".encode())
            except StoreError as exc:
                log.warning("heartbeat write failed (will retry): %s", exc)

    def _watch_heartbeats(self) -> None:
        for target, name in ((self._follow_events, "events"), (self._check_loop, "checker")):
            t = threading.Thread(target=target, name=f"ftrun-membership-{name}", daemon=True)
            self._threads.append(t)
            t.start()

    def _publish(self, event: dict) -> None:
        seq = self.kv.add(EVENT_SEQ_KEY, 1)
        self.kv.set(_event_key(seq), json.dumps(event, sort_keys=True).encode())

    def _declare_dead(self, gr: int, inc: int) -> None:
        """Mark (gr, inc) dead exactly once across all agents and publish it."""
        if self.kv.try_get(_left_key(gr, inc)) is not None:
            return
        token = f"{self.nonce}:{uuid.uuid4().hex}".encode()
        if self.kv.compare_set(_dead_key(gr, inc), b"", token) == token:
            log.warning("node %d (incarnation %d) missed heartbeats for %.1fs: declaring it dead",
                        gr, inc, self.heartbeat_timeout)
            self._publish({"kind": "dead", "group_rank": gr, "incarnation": inc})

    def _follow_events(self) -> None:
        stuck_since: float | None = None
        while not self._stop.is_set():
            key = _event_key(self._event_next)
            try:
                if not self.kv.wait([key], min(0.5, self.heartbeat_interval)):
                    seq = int(self.kv.try_get(EVENT_SEQ_KEY) or b"0")
                    if seq >= self._event_next:  # allocated but never written (writer died)
                        stuck_since = stuck_since or time.monotonic()
                        if time.monotonic() - stuck_since > 2 * self.heartbeat_timeout:
                            self._event_next += 1
                            stuck_since = None
                    continue
                raw = self.kv.try_get(key)
            except StoreError as exc:
                if not self._stop.is_set():
                    log.warning("membership event read failed (will retry): %s", exc)
                    self._stop.wait(self.heartbeat_interval)
                continue
            stuck_since = None
            self._event_next += 1
            if raw is not None:
                self._apply_event(json.loads(raw))

    def _apply_event(self, ev: dict) -> None:
        gr, inc, kind = int(ev["group_rank"]), int(ev["incarnation"]), ev["kind"]
        me = self._my_rank()
        if kind == "join":
            with self._lock:
                prev = self._state.alive.get(gr)
                if prev is not None and prev >= inc:
                    return
                self._state.alive[gr] = inc
                self._state.dead.discard(gr)
                self._state.leader = self._current_leader(self._state.alive)
            if gr != me:
                if prev is not None:  # its death is published after the join: report it first
                    self._node_died(gr, prev)
                log.info("node %d rejoined (incarnation %d)", gr, inc)
                self._call(self._on_join, gr)
            return
        if gr == me and inc == self.incarnation:
            if kind == "dead":
                self.lost.set()
                log.error("the other nodes declared this agent dead (missed heartbeats)")
            return
        with self._lock:
            if self._state.alive.get(gr) != inc:
                return  # an older incarnation, or already handled
            del self._state.alive[gr]
            self._state.dead.add(gr)
            old_leader = self._state.leader
            self._state.leader = self._current_leader(self._state.alive)
            new_leader = self._state.leader
        if kind == "dead":
            self._node_died(gr, inc)
        else:
            log.info("node %d left", gr)
        if new_leader != old_leader:
            log.info("node %d is the leader now", new_leader)
            self._call(self._on_leader, new_leader)

    def _check_loop(self) -> None:
        seen: dict[int, tuple[bytes | None, float]] = {}
        while not self._stop.wait(self.heartbeat_interval / 2):
            me = self._my_rank()
            with self._lock:
                alive = dict(self._state.alive)
            lowest = min(alive) if alive else me
            watch = [gr for gr in alive if gr != me] if lowest == me else [lowest]
            now = time.monotonic()
            for gr in list(seen):
                if gr not in watch:
                    del seen[gr]
            for gr in watch:
                try:
                    cur = self.kv.try_get(_hb_key(gr))
                except StoreError as exc:
                    log.warning("heartbeat read failed: %s", exc)
                    break
                last = seen.get(gr)
                if last is None or last[0] != cur:
                    seen[gr] = (cur, now)
                elif now - last[1] >= self.heartbeat_timeout:
                    inc = alive[gr]
                    try:
                        self._declare_dead(gr, inc)
                    except StoreError as exc:
                        log.warning("could not declare node %d dead: %s", gr, exc)
                        continue
                    seen[gr] = (cur, now)

    # ------------------------------------------------------------------------------ helpers

    def _my_rank(self) -> int:
        return self.world.group_rank if self.world is not None else -1

    def _node_died(self, gr: int, inc: int | None) -> None:
        if gr == self._my_rank():
            if not self._stop.is_set():
                self.lost.set()
                log.error("this agent's node record vanished: the other nodes consider it dead")
            return
        if inc is not None and self.kv.try_get(_left_key(gr, inc)) is not None:
            log.info("node %d left", gr)
            return
        log.warning("node %d is dead", gr)
        self._call(self._on_dead, gr)

    def _call(self, cb: Callable[[int], None] | None, gr: int) -> None:
        if cb is None or self._stop.is_set():
            return
        try:
            cb(gr)
        except Exception:  # a failing callback must not stop liveness tracking
            log.exception("membership callback %r failed for node %d", cb, gr)
