"""The rendezvous package's error types: what can go wrong in node membership, in one place.

Owns: `RendezvousError` and its kinds, each with a one-line message an agent can print as is:
  * `JoinInterrupted`    join() gave up because a stop was requested (signal, agent shutdown);
  * `RendezvousGracefulExit`  the run ended while this agent waited as a hot spare (exit 0,
                         like torchrun's redundant nodes);
  * `FencedError`        a write from a stale node (an older incarnation, or an agent the others
                         consider dead) was refused; the caller must self-fence;
  * `NodeLostError`      the other nodes consider this agent dead (`kind` says why): kill the
                         local workers and rejoin as a fresh node;
  * `StoreHostLostError` the embedded store (static/c10d) cannot be reached: the job cannot
                         continue without it (only etcd survives the loss of a node).
All derive from `rendezvous.kv.StoreError`, so code that handles store failures sees them too.
"""

from __future__ import annotations

from rendezvous.kv import StoreError


class RendezvousError(StoreError):
    """Rendezvous cannot complete (wrong run, duplicate node rank, no vacancy, timeout)."""


class JoinInterrupted(RendezvousError):
    """join() stopped waiting because a stop was requested."""


class RendezvousGracefulExit(RendezvousError):
    """The run finished while this agent waited as a hot spare: nothing to do, exit 0."""


class FencedError(RendezvousError):
    """A stale node's write was refused (it no longer holds its group rank)."""


# why an agent lost its membership (NodeLostError.kind, Lost.kind)
DECLARED_DEAD = "declared-dead"  # the others declared it dead (missed heartbeats)
LEASE_EXPIRED = "lease-expired"  # etcd: its lease ran out
RECORD_VANISHED = "record-vanished"  # etcd: its node record was deleted
STORE_UNREACHABLE = "store-unreachable"  # it could not reach the store for the liveness timeout
SUPERSEDED = "superseded"  # a newer incarnation took its group rank


class NodeLostError(RendezvousError):
    """This agent is no longer a member: self-fence (kill the local workers), then rejoin as a
    fresh node (`Membership.renew().join()`)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class StoreHostLostError(NodeLostError):
    """The embedded store's host cannot be reached: with the embedded store the job ends."""

    def __init__(self, node: int | None, address: str, detail: str = "") -> None:
        who = f"node {node}, {address}" if node is not None else address
        msg = (
            f"the store host ({who}) is gone; with the embedded store the job cannot "
            "continue; use --rdzv-backend etcd to survive it"
        )
        super().__init__(msg + (f" ({detail})" if detail else ""), STORE_UNREACHABLE)
        self.node = node
        self.address = address
