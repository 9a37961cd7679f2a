"""Building a `Membership` in tests: the node's identity positionally (kv, node_rank, nnodes_min,
nnodes_max, local_world_size, host, run_id), `hosts_store`, and any `RendezvousSettings` field
by its torchrun name (keep_alive_interval, heartbeat_timeout, join_timeout, ...)."""

from __future__ import annotations

from rendezvous.kv import KVStore
from rendezvous.nodes.membership import Membership
from rendezvous.nodes.settings import MembershipSettings, RendezvousSettings


def member(
    kv: KVStore,
    node_rank: int | None,
    nnodes_min: int,
    nnodes_max: int,
    local_world_size: int,
    host: str,
    run_id: str,
    *,
    hosts_store: bool = False,
    **rdzv: object,
) -> Membership:
    """A Membership of `kv` for this node, with `rdzv` as its RendezvousSettings."""
    settings = MembershipSettings(
        node_rank,
        nnodes_min,
        nnodes_max,
        local_world_size,
        host,
        run_id,
        rdzv=RendezvousSettings(**rdzv),  # type: ignore[arg-type]
        hosts_store=hosts_store,
    )
    return Membership(kv, settings)
