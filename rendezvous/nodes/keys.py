"""The rendezvous package's store vocabulary: key names and the node record written under them.

Owns: the control-plane root (`ROOT`), the global recovery generation key (`GENERATION_KEY`,
written by the controller, initialised by membership), the per-node records (`node_key`), every
key under `ftrun/rdzv/` that membership and liveness use, and `Registration`, the JSON record an
agent writes when it joins and as its node record. Nothing here talks to a store.

`launcher.protocol.plan` re-exports ROOT, GENERATION_KEY and node_key: the launcher builds its own
control keys on the same root, and imports run launcher -> rendezvous, never back.

Keys (logical, see `rendezvous.kv`):
  ftrun/generation                     global recovery generation (decimal)
  ftrun/node/<group rank>              `Registration` of the agent holding that group rank
  ftrun/rdzv/run_id                    the run id that owns this store (first writer wins)
  ftrun/rdzv/world                     the closed world (JSON), or a "retired" marker
  ftrun/rdzv/join_seq, join/<slot>     dynamic arrivals: slot counter and one record per slot
  ftrun/rdzv/join/n<node rank>         static arrivals: one record per node rank
  ftrun/rdzv/incarnation/<gr>          counter: incarnations of a group rank (1 = first agent)
  ftrun/rdzv/left/<gr>/<inc>           that incarnation left on purpose (not a death)
  ftrun/rdzv/hb/<gr>                   heartbeat counter "<inc>:<seq>" (heartbeat liveness)
  ftrun/rdzv/dead/<gr>/<inc>           that incarnation was declared dead (heartbeat liveness)
  ftrun/rdzv/event_seq, event/<seq>    membership event log (heartbeat liveness)
  ftrun/rdzv/spare/<nonce>             `Registration` of a hot spare waiting for a vacancy
  ftrun/rdzv/controller                the elected controller (etcd election, lease-bound)

The left marker's value says why the agent left (`LEAVE_DONE`: the job is over for it; any
other reason, e.g. `LEAVE_SIGNAL`, leaves a vacancy a hot spare may take).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

ROOT = "ftrun"
GENERATION_KEY = f"{ROOT}/generation"
NODE_PREFIX = f"{ROOT}/node/"

RDZV = f"{ROOT}/rdzv"
RUN_ID_KEY = f"{RDZV}/run_id"
WORLD_KEY = f"{RDZV}/world"
JOIN_PREFIX = f"{RDZV}/join/"
JOIN_SEQ_KEY = f"{RDZV}/join_seq"
EVENT_SEQ_KEY = f"{RDZV}/event_seq"
SPARE_PREFIX = f"{RDZV}/spare/"
DEAD_PREFIX = f"{RDZV}/dead/"
LEFT_PREFIX = f"{RDZV}/left/"
CONTROLLER_KEY = f"{RDZV}/controller"

LEAVE_DONE = "done"  # finished: no vacancy
LEAVE_SIGNAL = "signal"  # stopped by a signal (preemption): its ranks need a new home
LEAVE_ROUND = "round"  # moved on to the next rendezvous round (scale_up=restart)


def node_key(node_rank: int) -> str:
    return f"{NODE_PREFIX}{node_rank}"


def node_rank_of(key: str) -> int:
    """The group rank in a `node_key`; ValueError for any other key."""
    if not key.startswith(NODE_PREFIX):
        raise ValueError(f"{key!r} is not a node key")
    return int(key[len(NODE_PREFIX) :])


def join_key(slot: int) -> str:
    return f"{JOIN_PREFIX}{slot}"


def static_join_key(node_rank: int) -> str:
    return f"{JOIN_PREFIX}n{node_rank}"


def incarnation_key(group_rank: int) -> str:
    return f"{RDZV}/incarnation/{group_rank}"


def left_key(group_rank: int, incarnation: int) -> str:
    return f"{LEFT_PREFIX}{group_rank}/{incarnation}"


def marker_of(key: str) -> tuple[int, int]:
    """(group rank, incarnation) of a `left_key` or `dead_key`; ValueError otherwise."""
    for prefix in (LEFT_PREFIX, DEAD_PREFIX):
        if key.startswith(prefix):
            gr, _, inc = key[len(prefix) :].partition("/")
            return int(gr), int(inc)
    raise ValueError(f"{key!r} is not a left or dead marker")


def spare_key(nonce: str) -> str:
    return f"{SPARE_PREFIX}{nonce}"


def hb_key(group_rank: int) -> str:
    return f"{RDZV}/hb/{group_rank}"


def dead_key(group_rank: int, incarnation: int) -> str:
    return f"{DEAD_PREFIX}{group_rank}/{incarnation}"


def event_key(seq: int) -> str:
    return f"{RDZV}/event/{seq}"


@dataclass
class Registration:
    """Who an agent is: written at join (join keys) and as its node record (`node_key`)."""

    nonce: str
    host: str
    pid: int
    local_world_size: int
    node_rank: int | None = None
    slot: int = -1
    incarnation: int = 0
    group_rank: int = -1
    hosts_store: bool = False  # this agent hosts the embedded store
    beat: float = 0.0  # hot spares on stores without leases: wall time of the last refresh
    prev_rank: int = -1  # a new round: this agent's group rank in the previous one (-1: new)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Registration":
        d = json.loads(raw)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
