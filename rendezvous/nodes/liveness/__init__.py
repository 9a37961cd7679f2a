"""Node liveness: how an agent shows it is alive and learns which other agents are.

Owns: the choice of mechanism for a store (`liveness_for`), made once when membership is built:
  * `LeaseLiveness` (lease.py) on stores with leases and watches (`LeaseStore`: etcd) — records
    attached to a lease vanish when the agent dies, and a watch reports it;
  * `HeartbeatLiveness` (heartbeat.py) on every other store (embedded TCP store, LocalKV) —
    heartbeat counters, a checker that declares silent nodes dead once, and an event log.
Both implement `Liveness` (base.py) and report to a `Roster` (roster.py), which holds what the
agent believes about the others and calls the membership callbacks.
"""

from __future__ import annotations

from rendezvous.kv import KVStore
from rendezvous.nodes.liveness.base import Liveness, Timing
from rendezvous.nodes.liveness.heartbeat import HeartbeatLiveness
from rendezvous.nodes.liveness.lease import LeaseLiveness, LeaseStore
from rendezvous.nodes.liveness.roster import Lost, Roster

__all__ = [
    "HeartbeatLiveness",
    "LeaseLiveness",
    "LeaseStore",
    "Liveness",
    "Lost",
    "Roster",
    "Timing",
    "liveness_for",
]


def liveness_for(kv: KVStore, timing: Timing, static: bool, nonce: str) -> Liveness:
    """Lease liveness when `kv` offers leases and watches, heartbeat liveness otherwise."""
    cls = LeaseLiveness if isinstance(kv, LeaseStore) else HeartbeatLiveness
    return cls(kv, timing, static, nonce)
