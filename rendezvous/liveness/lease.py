"""Lease-based liveness, for stores with leases and watches (etcd).

Owns: `LeaseStore` (what a store must offer for this mechanism) and `LeaseLiveness`. The agent's
join and node records are attached to one lease with TTL = heartbeat timeout, refreshed every
heartbeat interval. When the agent dies the lease expires, the store deletes its records and
every agent's watch on the node records reports it; a replacement's new record is a join.
Create-if-absent on the lease makes a second agent with the same static node rank fail fast.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol, runtime_checkable

from rendezvous.keys import JOIN_PREFIX, NODE_PREFIX, Registration, node_key, node_rank_of
from rendezvous.kv import StoreError
from rendezvous.liveness.base import Liveness

log = logging.getLogger("ftrun.membership")


@runtime_checkable
class LeaseStore(Protocol):
    """The store operations lease liveness needs beyond `KVStore` (see rendezvous.etcd)."""

    def grant_lease(self, ttl: float) -> Any: ...

    def refresh_lease(self, lease: Any) -> int: ...

    def revoke_lease(self, lease: Any) -> None: ...

    def put_with_lease(self, key: str, value: bytes, lease: Any) -> None: ...

    def create(self, key: str, value: bytes, lease: Any = None) -> bool: ...

    def wait_deleted(self, key: str, timeout: float) -> bool: ...

    def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]: ...

    def watch_prefix(self, prefix: str, callback: Callable[[Any], None],
                     start_revision: int = 0) -> Any: ...


class LeaseLiveness(Liveness):
    """Liveness through one store lease per agent (see module docstring)."""

    kv: Any  # a KVStore that is also a LeaseStore

    def __init__(self, kv: Any, *args: Any) -> None:
        super().__init__(kv, *args)
        self._lease: Any = None

    def begin(self) -> None:
        if self._lease is None:
            self._lease = self.kv.grant_lease(self.timing.timeout)
        self.start()

    def put(self, key: str, raw: bytes) -> None:
        self.kv.put_with_lease(key, raw, self._lease)

    def register_join(self, key: str, raw: bytes, deadline: float) -> bytes | None:
        while not self.kv.create(key, raw, self._lease):
            other = self.kv.try_get(key)
            wait = min(deadline - time.monotonic(), self.timing.timeout + 2.0)
            if other is not None and not self.kv.wait_deleted(key, max(0.0, wait)):
                return other
        return None

    def wait_vacant(self, gr: int, patience: float, judge: bool) -> bytes | None:
        # the store deletes a dead holder's record when its lease expires: nothing to judge
        return b"" if self.kv.wait_deleted(node_key(gr), patience) else None

    def write_node(self, gr: int, raw: bytes, replacing: bytes | None) -> bool:
        return bool(self.kv.create(node_key(gr), raw, self._lease))

    def world_is_dead(self, ranks: list[int]) -> bool:
        # live agents hold leased join and node records
        return not self.kv.keys(NODE_PREFIX) and not self.kv.keys(JOIN_PREFIX)

    def watch(self, ranks: list[int]) -> None:
        # members register right after the world closes; give slow ones one lease TTL
        self.kv.wait([node_key(gr) for gr in ranks], self.timing.timeout)
        snap, rev = self.kv.get_prefix(NODE_PREFIX)
        present = {}
        for key, raw in snap.items():
            try:
                present[node_rank_of(key)] = Registration.from_json(raw).incarnation
            except ValueError:
                continue
        missing = self.roster.refresh(present)
        self._watches.append(self.kv.watch_prefix(NODE_PREFIX, self._on_event, rev + 1))
        for gr, inc in missing:
            self._vanished(gr, inc)

    # ------------------------------------------------------------------------------ internals

    def _can_beat(self) -> bool:
        return self._lease is not None

    def _beat(self) -> None:
        from rendezvous.etcd import LeaseExpiredError  # loaded already: kv is an EtcdKV

        while not self._stop.wait(self.timing.interval):
            try:
                self.kv.refresh_lease(self._lease)
            except LeaseExpiredError:
                self.roster.lose("this agent's lease expired: the other nodes consider it dead")
                return
            except StoreError as exc:
                log.warning("lease refresh failed (will retry): %s", exc)

    def _on_event(self, ev: Any) -> None:
        try:
            gr = node_rank_of(ev.key)
        except ValueError:
            return
        if ev.kind == "put":
            self.roster.joined(gr, Registration.from_json(ev.value).incarnation)
        else:
            self._vanished(gr, None)

    def _vanished(self, gr: int, inc: int | None) -> None:
        if gr == self.roster.me[0]:
            if not self._stop.is_set():
                self.roster.lose("this agent's node record vanished: the other nodes consider "
                                 "it dead")
            return
        self.roster.gone(gr, inc)

    def _release(self) -> None:
        if self._lease is None:
            return
        try:
            self.kv.revoke_lease(self._lease)
        except StoreError as exc:
            log.warning("could not revoke the membership lease: %s", exc)
