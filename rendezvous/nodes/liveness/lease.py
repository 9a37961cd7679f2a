"""Lease-based liveness, for stores with leases and watches (etcd).

Owns: `LeaseStore` (what a store must offer for this mechanism) and `LeaseLiveness`. The agent's
join and node records are attached to one lease with TTL = heartbeat timeout, refreshed every
heartbeat interval. When the agent dies the lease expires, the store deletes its records and
every agent's watch on the node records reports it; a replacement's new record is a join.
Create-if-absent on the lease makes a second agent with the same static node rank fail fast.

Fencing: every record of the agent is bound to its lease, so once the lease has expired etcd
refuses its writes; `fenced_set` is one transaction guarded by the agent's own node record. The
agent notices on its own that it is lost when a refresh reports the lease gone or when no
refresh succeeded for one lease TTL (cut off from etcd). Hot-spare records are leased too.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol, runtime_checkable

from rendezvous.errors import LEASE_EXPIRED, RECORD_VANISHED
from rendezvous.kv import StoreError
from rendezvous.nodes.keys import (
    JOIN_PREFIX,
    LEAVE_DONE,
    NODE_PREFIX,
    Registration,
    incarnation_key,
    node_key,
    node_rank_of,
)
from rendezvous.nodes.liveness.base import Liveness
from rendezvous.nodes.waits import SLICE

log = logging.getLogger("ftrun.membership")


@runtime_checkable
class LeaseStore(Protocol):
    """The store operations lease liveness needs beyond `KVStore` (see rendezvous.store.etcd)."""

    def grant_lease(self, ttl: float) -> Any: ...

    def refresh_lease(self, lease: Any) -> int: ...

    def revoke_lease(self, lease: Any) -> None: ...

    def put_with_lease(self, key: str, value: bytes, lease: Any) -> None: ...

    def create(self, key: str, value: bytes, lease: Any = None) -> bool: ...

    def put_if(self, key: str, value: bytes, guard_key: str, guard_value: bytes) -> bool: ...

    def compare_set_if(
        self, key: str, expected: bytes, desired: bytes, guard_key: str, guard_value: bytes
    ) -> bytes | None: ...

    def wait_deleted(self, key: str, timeout: float) -> bool: ...

    def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]: ...

    def watch_prefix(
        self, prefix: str, callback: Callable[[Any], None], start_revision: int = 0
    ) -> Any: ...


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
            if other is not None and not self._wait_deleted(key, max(0.0, wait)):
                return other
        return None

    def wait_vacant(self, gr: int, patience: float, judge: bool) -> bytes | None:
        # the store deletes a dead holder's record when its lease expires: nothing to judge
        return b"" if self._wait_deleted(node_key(gr), patience) else None

    def vacancies(self, ranks: list[int]) -> list[int]:
        present = set()
        for key in self.kv.keys(NODE_PREFIX):
            try:
                present.add(node_rank_of(key))
            except ValueError:
                continue
        done = self._left_markers(LEAVE_DONE)
        out = []
        for gr in ranks:
            if gr in present:
                continue
            inc = int(self.kv.try_get(incarnation_key(gr)) or b"0")
            if (gr, inc) not in done:
                out.append(gr)
        return out

    def put_spare(self, key: str, raw: bytes) -> None:
        self.kv.put_with_lease(key, raw, self._lease)

    def spares(self, prefix: str) -> list[bytes]:
        snap, _ = self.kv.get_prefix(prefix)
        return [snap[k] for k in sorted(snap)]

    def fenced_set(self, key: str, value: bytes) -> None:
        gr, _ = self.roster.me
        if self.roster.lost.is_set() or not self.record:
            self._refuse(key, "it is no longer a member (lost)")
        if not self.kv.put_if(key, value, node_key(gr), self.record):
            self._refuse(key, f"node {gr}'s record is gone or belongs to another agent")

    def fenced_compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        gr, _ = self.roster.me
        if self.roster.lost.is_set() or not self.record:
            self._refuse(key, "it is no longer a member (lost)")
        got = self.kv.compare_set_if(key, expected, desired, node_key(gr), self.record)
        if got is None:
            self._refuse(key, f"node {gr}'s record is gone or belongs to another agent")
        return got  # type: ignore[return-value]

    @property
    def lease(self) -> Any:
        """This agent's lease (None before begin()): records bound to it die with the agent."""
        return self._lease

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

    def _wait_deleted(self, key: str, timeout: float) -> bool:
        """wait_deleted in slices, so a stop request ends it (JoinInterrupted)."""
        end = time.monotonic() + max(0.0, timeout)
        while True:
            self.interrupt.check("rendezvous")
            left = end - time.monotonic()
            if self.kv.wait_deleted(key, max(0.0, min(SLICE, left))):
                return True
            if left <= SLICE:
                return False

    def _can_beat(self) -> bool:
        return self._lease is not None

    def _silence_limit(self) -> float:
        return float(max(self.timing.timeout, getattr(self._lease, "ttl", 0) or 0))

    def _beat(self) -> None:
        from rendezvous.store.etcd import LeaseExpiredError  # loaded already: kv is an EtcdKV

        while not self._stop.wait(self.timing.interval) and not self.roster.lost.is_set():
            try:
                self.kv.refresh_lease(self._lease)
            except LeaseExpiredError:
                self.roster.lose(
                    "its lease expired: the other nodes consider it dead", LEASE_EXPIRED
                )
                return
            except StoreError as exc:
                self._alive_failed(exc)
                continue
            self._alive_ok()

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
                self.roster.lose(
                    "its node record vanished: the other nodes consider it dead", RECORD_VANISHED
                )
            return
        self.roster.gone(gr, inc)

    def _release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is None:
            return
        try:
            self.kv.revoke_lease(lease)
        except StoreError as exc:
            log.warning("could not revoke the membership lease: %s", exc)
