"""Joining the run's world: the static and dynamic rendezvous, closing and entering the world,
and retiring the world of an earlier run whose nodes are all gone.

Owns: `Joining`, the part of `rendezvous.nodes.membership.Membership` that `join()` runs until
this agent has a group rank or must take one over: check the store belongs to this run, find
the world (`_find_world`: none yet -> `_join_static` / `_join_dynamic`; retired -> wait for it
to be wiped; every node gone -> `_retire`; running -> `Replacing._rejoin`), write this agent's
join and node records (`_record`, `_register`), close the world (`_close`, first writer wins)
and enter it (`_enter`); a join that fails takes its arrival slot back (`_withdraw`). A renewed
agent on the embedded store first checks the store still answers (`_probe_store`).
"""

from __future__ import annotations

import json
import logging
import socket
import time
from typing import Any

from rendezvous.errors import RendezvousError, StoreHostLostError
from rendezvous.kv import StoreError, StoreTimeout
from rendezvous.nodes import rounds
from rendezvous.nodes.keys import (
    GENERATION_KEY,
    JOIN_SEQ_KEY,
    RUN_ID_KEY,
    WORLD_KEY,
    Registration,
    incarnation_key,
    join_key,
    static_join_key,
)
from rendezvous.nodes.member_state import MemberState
from rendezvous.nodes.waits import wait_keys
from rendezvous.nodes.world import NodeWorld, build_world, node_world

log = logging.getLogger("ftrun.membership")


class Joining(MemberState):
    """Finding, closing and entering the run's world (see the module docstring). A mixin of
    `Membership`, whose state it uses and whose `current_generation`, `store_host` and
    `can_elect` it calls; `_rejoin` comes from `Replacing`."""

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
            return self._rejoin(
                json.loads(self.kv.get(WORLD_KEY, self.rdzv.read_timeout)), deadline
            )
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
        last_call = min(time.monotonic() + self.rdzv.last_call_timeout, deadline)
        if not wait_keys(self.kv, [WORLD_KEY], last_call, self._interrupt, "rendezvous"):
            count = min(int(self.kv.try_get(JOIN_SEQ_KEY) or b"0"), self.nnodes_max)
            self._close_dynamic(count)
        return self._enter(json.loads(self.kv.get(WORLD_KEY, self.rdzv.read_timeout)), deadline)

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
            self.kv, keys, time.monotonic() + self.rdzv.close_timeout, self._interrupt, "rendezvous"
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

    def _probe_store(self) -> None:
        """A renewed agent on the embedded store: the store must accept a connection within
        read_timeout, else StoreHostLostError (the job cannot continue without it)."""
        host, port = getattr(self.kv, "host", None), getattr(self.kv, "port", None)
        if not isinstance(host, str) or not isinstance(port, int):
            return  # an in-process store (LocalKV): nothing to reach
        end = time.monotonic() + self.rdzv.read_timeout
        last = ""
        while time.monotonic() < end:
            self._interrupt.check("rejoin")
            try:
                socket.create_connection(
                    (host, port), timeout=min(1.0, self.rdzv.read_timeout)
                ).close()
                return
            except OSError as exc:
                last = exc.strerror or type(exc).__name__
                self._interrupt.sleep(min(0.2, max(0.0, end - time.monotonic())))
        node = self.store_host()
        raise StoreHostLostError(
            node.node_rank if node is not None else None,
            f"{host}:{port}",
            f"no answer for {self.rdzv.read_timeout:g}s: {last}",
        )

    def _store_address(self) -> str:
        node = self.store_host()
        addr = f"{getattr(self.kv, 'host', '?')}:{getattr(self.kv, 'port', '?')}"
        return f"{addr} (node {node.node_rank})" if node is not None else addr
