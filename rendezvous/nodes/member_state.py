"""What a node's membership holds: the typed fields `Membership.__init__` sets.

Owns: `MemberState`, the one declaration of those fields, shared by the parts of `Membership`
that live in their own modules (`Joining`, `Replacing`), so each part is type-checked against
the same state without declaring it again.
"""

from __future__ import annotations

import threading

from rendezvous.kv import KVStore
from rendezvous.nodes.liveness import Liveness, Timing
from rendezvous.nodes.settings import MembershipSettings, RendezvousSettings
from rendezvous.nodes.waits import Interrupt


class MemberState:
    """The fields of a `Membership` (set by `Membership.__init__`, rendezvous.nodes.membership)."""

    kv: KVStore
    settings: MembershipSettings
    rdzv: RendezvousSettings
    timing: Timing
    node_rank: int | None
    nnodes_min: int
    nnodes_max: int
    local_world_size: int
    host: str
    run_id: str
    hosts_store: bool
    prev_rank: int
    expect: int
    static: bool
    nonce: str
    pid: int
    incarnation: int
    liveness: Liveness
    lost: threading.Event
    _interrupt: Interrupt
    _round_opened: int
    _slot: int | None
