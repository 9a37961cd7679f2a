"""Node-level rendezvous on any KVStore: join, group ranks, replacements, the leader.

Owns: `Membership` (one per agent) and the records it returns (`NodeWorld`, `NodeInfo`). Its
store keys and the node record are defined in `rendezvous.keys`; how agents show they are alive
and learn of each other's deaths is `rendezvous.liveness` (one mechanism per store, chosen here
once: leases on etcd, heartbeats elsewhere).

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

The leader is group rank 0 in a static world and the lowest live group rank in a dynamic one
(see `rendezvous.liveness.roster`); there is no election.

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
from dataclasses import dataclass
from typing import Any, Callable

from rendezvous.keys import (GENERATION_KEY, JOIN_SEQ_KEY, RUN_ID_KEY, WORLD_KEY, Registration,
                             incarnation_key, join_key, static_join_key)
from rendezvous.kv import KVStore, StoreError, StoreTimeout
from rendezvous.liveness import Timing, liveness_for

log = logging.getLogger("ftrun.membership")


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

    generation: int  # global generation when this agent joined (keys.GENERATION_KEY)
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


def _check_args(node_rank: int | None, nnodes_min: int, nnodes_max: int, local_world_size: int,
                run_id: str, seconds: dict[str, float]) -> None:
    """ValueError naming the first bad constructor argument."""
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
    for name, v in seconds.items():
        if not (isinstance(v, (int, float)) and v > 0):
            raise ValueError(f"{name}={v!r} must be a number of seconds > 0")
    if seconds["heartbeat_timeout"] <= seconds["heartbeat_interval"]:
        raise ValueError(f"heartbeat_timeout={seconds['heartbeat_timeout']} must exceed "
                         f"heartbeat_interval={seconds['heartbeat_interval']}")


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
        _check_args(node_rank, nnodes_min, nnodes_max, local_world_size, run_id,
                    {"join_timeout": join_timeout, "last_call_timeout": last_call_timeout,
                     "heartbeat_interval": heartbeat_interval,
                     "heartbeat_timeout": heartbeat_timeout})
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
        self.nonce = uuid.uuid4().hex
        self.pid = os.getpid()
        self.world: NodeWorld | None = None
        self.incarnation = 0
        self.liveness = liveness_for(kv, Timing(self.heartbeat_interval, self.heartbeat_timeout),
                                     self.static, self.nonce)
        self.lost = self.liveness.roster.lost  # set when the others consider this agent dead
        self._watch_lock = threading.Lock()
        self._watching = False

    # ------------------------------------------------------------------------------ public API

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
        """The current leader's group rank (see module docstring)."""
        return self.liveness.roster.leader()

    def alive_nodes(self) -> list[int]:
        """Group ranks this agent currently believes alive (itself included)."""
        return sorted(self.liveness.roster.alive())

    def join(self, timeout: float | None = None) -> NodeWorld:
        """Rendezvous; block until the world is decided (or this agent replaced a dead node).
        Raises RendezvousError/StoreTimeout after `timeout` (default join_timeout) seconds."""
        if self.world is not None:
            return self.world
        timeout = self.join_timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + timeout
        try:
            self.liveness.begin()
            world = self._find_world(deadline, timeout)
        except BaseException:
            self.stop(leave=True)  # our registrations disappear (or are marked left)
            raise
        self.world = world
        self.start_heartbeat()
        log.info("node %d joined run %s: %d nodes, world size %d, leader node %d, generation %d%s",
                 world.group_rank, self.run_id, world.group_world_size, world.world_size,
                 world.leader_node, world.generation, " (replacement)" if world.rejoined else "")
        return world

    def start_heartbeat(self) -> None:
        """Start the liveness thread (lease refresh on etcd, heartbeat counter elsewhere).
        Idempotent; join() starts it. Stopped by stop()."""
        self.liveness.start()

    def watch_nodes(self, on_dead: Callable[[int], None],
                    on_join: Callable[[int], None] | None = None,
                    on_leader: Callable[[int], None] | None = None) -> None:
        """Report other nodes' deaths (`on_dead(group_rank)`, once per incarnation, within the
        heartbeat/lease timeout), replacements joining (`on_join(group_rank)`) and leader
        changes (`on_leader(group_rank)`). Callbacks run on a membership thread: keep them
        short (queue the work). Call once, after join()."""
        if self.world is None:
            raise RendezvousError("watch_nodes() needs join() first")
        with self._watch_lock:
            if self._watching:
                raise RendezvousError("watch_nodes() was already called")
            self._watching = True
        self.liveness.roster.subscribe(on_dead, on_join, on_leader)
        self.liveness.watch([n.node_rank for n in self.world.nodes])

    def stop(self, leave: bool = True) -> None:
        """Stop every membership thread and watch. With `leave`, tell the others this node
        left on purpose (they get no on_dead). Idempotent; does not close the store."""
        self.liveness.stop(leave)

    # ------------------------------------------------------------------------------ rendezvous

    def _find_world(self, deadline: float, timeout: float) -> NodeWorld:
        """Join the run's world: a new one, or the running one as a replacement."""
        while True:
            self._check_run_id()
            raw = self.kv.try_get(WORLD_KEY)
            if raw is None:
                return (self._join_static(deadline, timeout) if self.static
                        else self._join_dynamic(deadline, timeout))
            old = json.loads(raw)
            if old.get("retired"):
                self._wait_wiped(deadline)
            elif self.liveness.world_is_dead([n["node_rank"] for n in old["nodes"]]):
                self._retire(raw, deadline)
            else:
                return self._rejoin(old, deadline)

    def _check_run_id(self) -> None:
        got = self.kv.compare_set(RUN_ID_KEY, b"", self.run_id.encode())
        if got != self.run_id.encode():
            raise RendezvousError(f"this store belongs to run {got.decode(errors='replace')!r}, "
                                  f"not {self.run_id!r} (use another --rdzv-id or store root)")

    def _record(self, **kw: Any) -> Registration:
        return Registration(nonce=self.nonce, host=self.host, pid=self.pid,
                            local_world_size=self.local_world_size, node_rank=self.node_rank, **kw)

    def _join_static(self, deadline: float, timeout: float) -> NodeWorld:
        assert self.node_rank is not None
        other = self.liveness.register_join(static_join_key(self.node_rank),
                                            self._record().to_json(), deadline)
        if other is not None:
            o = Registration.from_json(other)
            raise RendezvousError(f"node rank {self.node_rank} is already registered by {o.host} "
                                  f"pid {o.pid} (two agents with the same --node-rank?)")
        keys = [static_join_key(r) for r in range(self.nnodes_max)]
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
                raw = self._close([Registration.from_json(r) for r in recs if r is not None])
            return self._enter(json.loads(raw), deadline)

    def _join_dynamic(self, deadline: float, timeout: float) -> NodeWorld:
        slot = self.kv.add(JOIN_SEQ_KEY, 1) - 1
        if slot >= self.nnodes_max:
            log.info("rendezvous already has %d nodes; waiting to replace a dead one",
                     self.nnodes_max)
            if not self.kv.wait([WORLD_KEY], max(0.0, deadline - time.monotonic())):
                raise StoreTimeout(f"rendezvous: the world did not close within {timeout:g}s")
            return self._rejoin(json.loads(self.kv.get(WORLD_KEY, 1.0)), deadline)
        self.liveness.put(join_key(slot), self._record(slot=slot).to_json())
        log.info("joined rendezvous in slot %d (nnodes %d:%d)", slot, self.nnodes_min,
                 self.nnodes_max)
        if slot == self.nnodes_max - 1:
            raw = self.kv.try_get(WORLD_KEY) or self._close_dynamic(self.nnodes_max)
            return self._enter(json.loads(raw), deadline)
        if slot + 1 < self.nnodes_min:
            if not self.kv.wait([join_key(self.nnodes_min - 1)],
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
        keys = [join_key(s) for s in range(count)]
        self.kv.wait(keys, 5.0)  # slots are written right after they are taken
        members = []
        for k in keys:
            raw = self.kv.try_get(k)
            if raw is not None:  # missing: that agent died between taking and writing its slot
                members.append(Registration.from_json(raw))
        return self._close(members)

    def _close(self, members: list[Registration]) -> bytes:
        """Write the world (first writer wins); return the world that won."""
        if self.static:
            members.sort(key=lambda r: r.node_rank if r.node_rank is not None else -1)
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
        self.liveness.roster.reset({n.node_rank: n.incarnation for n in nw.nodes},
                                   [n.node_rank for n in nw.nodes])
        return nw

    def _register(self, gr: int, replacing: bytes | None = None) -> bool:
        """Write our node record for group rank `gr` (new incarnation). With `replacing` (from
        `Liveness.wait_vacant`), replace exactly that record; False if someone else did."""
        inc = self.kv.add(incarnation_key(gr), 1)
        rec = self._record(incarnation=inc, group_rank=gr).to_json()
        if not self.liveness.write_node(gr, rec, replacing):
            return False
        self.incarnation = inc
        self.liveness.registered(gr, inc)
        return True

    # ------------------------------------------------------------------------------ stale runs

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
        if self.static:
            assert self.node_rank is not None
            if self.node_rank >= n:
                raise RendezvousError(f"node_rank {self.node_rank} is not in the running "
                                      f"world of {n} nodes")
        candidates = [self.node_rank] if self.node_rank is not None else list(range(n))
        while True:
            for gr in candidates:
                if self._try_claim(gr, deadline, judge=self.static):
                    return self._replaced(world, gr)
            if time.monotonic() >= deadline:
                break
            time.sleep(min(self.heartbeat_interval, max(0.0, deadline - time.monotonic())))
        who = f"node rank {self.node_rank} is" if self.static else f"all {n} nodes are"
        raise RendezvousError(f"cannot join run {self.run_id}: {who} still alive (the job is "
                              "full; a replacement only joins in place of a dead node)")

    def _try_claim(self, gr: int, deadline: float, judge: bool) -> bool:
        """Take over group rank `gr` if its current holder is dead. With `judge`, give the
        holder up to one heartbeat timeout to be found dead."""
        patience = min(max(0.0, deadline - time.monotonic()),
                       self.heartbeat_timeout + 2 * self.heartbeat_interval) if judge else 0.0
        replacing = self.liveness.wait_vacant(gr, patience, judge)
        return replacing is not None and self._register(gr, replacing)

    def _replaced(self, world: dict, gr: int) -> NodeWorld:
        nw = self._world_from(world, gr, rejoined=True)
        me = nw.me
        me.host, me.pid, me.incarnation = self.host, self.pid, self.incarnation
        nw.generation = self.current_generation()
        ranks = [node.node_rank for node in nw.nodes]
        alive = self.liveness.survey(ranks, gr)
        nw.leader_node = self.liveness.roster.reset(alive, ranks)
        self.liveness.announce_join(gr, self.incarnation)
        log.info("replacement agent took node %d (incarnation %d)", gr, self.incarnation)
        return nw
