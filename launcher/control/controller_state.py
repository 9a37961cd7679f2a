"""The controller's own state in the store, so a controller elected on another node goes on
from where the lost one stopped.

Owns: `ControllerState` (the job's generation, the next fault to read and the restart budget, read
back from their own keys, `ControllerState.read`), and `SavedState` and its record under
`STATE_KEY`: the fault history of the failure summary (each fault, the strategies tried, its
outcome), the lost nodes still waiting for a hot spare or a replacement agent (when they were lost,
wall clock, and their `node-lost` fault, so the successor neither reports them again nor restarts
their node_replace_timeout), and the agent incarnation of each node the controller has accounted for
(a node held by a newer incarnation was taken over, and its arrival must start a round), the
ranks live shrinks removed from the world (elastic-training: a successor knows the world is
shrunk, and grows it back), the pause of a live grow back in progress (a successor ends it:
the grow is taken up, or tried again) and the hot switch in progress with its pause (a
successor ends the pause: the switch round is taken up, or the switch abandoned). The round
in progress itself is not kept here: the latest plan (`plan.plan_key`) and its phase keys (repair
plan, go) say how far it got.

Fencing: every controller takes a term (`TERM_KEY`, a counter) when it is built, and writes the
record only by compare-and-set over a record whose term is not newer than its own; a deposed
controller that still runs (cut off, then back) gets `FencedError` instead of overwriting its
successor's state. The record's generation is the job's generation when it was written; its
world round is the rendezvous round of the world it describes (after the world shrank or grew in
a new round, node ranks are renumbered: the lost nodes and incarnations of the old world mean
nothing in the new one, only the history carries over).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from launcher.control.decision import Budget
from launcher.protocol import plan as P
from rendezvous.errors import FencedError
from rendezvous.kv import KVStore, StoreError
from rendezvous.nodes.keys import ROOT

STATE_KEY = f"{ROOT}/controller/state"
TERM_KEY = f"{ROOT}/controller/term"
ATTEMPTS = 20  # compare-and-set attempts while another writer keeps changing the record


@dataclass
class ControllerState:
    """What a controller goes on from, each under a key of its own (any controller writes them):
    the job's generation, the next fault to read and the restart budget."""

    generation: int = 0
    next_fault: int = 1
    budget: Budget = field(default_factory=lambda: Budget(0, 0))
    # GENERATION_KEY names an older generation than the latest plan (`read`): its write is owed
    generation_key_behind: bool = False

    @classmethod
    def read(cls, kv: KVStore, max_restarts: int) -> "ControllerState":
        """From the store: where the earlier controllers of the job left them. The generation
        is that of the latest published plan: a controller that died between writing a plan and
        setting `GENERATION_KEY` (`PlanPublisher.publish`) left a round the agents act on."""
        raw, used, seq, nxt = (
            kv.try_get(k)
            for k in (P.GENERATION_KEY, P.RESTARTS_USED_KEY, P.FAULT_SEQ, P.FAULT_NEXT_KEY)
        )
        known = g = int(raw) if raw is not None else 0
        while kv.try_get(P.plan_key(g + 1)) is not None:  # at most one: plans are written in turn
            g += 1
        return cls(
            generation=g,
            generation_key_behind=g > known,
            next_fault=int(nxt) if nxt is not None else (int(seq) + 1 if seq is not None else 1),
            budget=Budget(int(used) if used is not None else 0, max_restarts),
        )


@dataclass
class SavedState:
    term: int
    generation: int
    history: list[dict] = field(default_factory=list)
    lost: dict[int, dict] = field(default_factory=dict)  # node -> {"at": unix time, "fault": json}
    known: dict[int, int] = field(default_factory=dict)  # node -> incarnation accounted for
    world_round: int = 0  # the rendezvous round of the world the lost nodes and known refer to
    dropped: list[int] = field(default_factory=list)  # ranks live shrinks removed from the world
    grow_pause: int = 0  # the pause (its seq) a live grow back in progress halted the world with
    switch_seq: int = 0  # the hot switch in progress (its request's seq; 0: none)
    switch_pause: int = 0  # the pause (its seq) that switch halted the world with (0: not yet)

    def to_json(self) -> bytes:
        d = asdict(self)
        d["lost"] = {str(k): v for k, v in self.lost.items()}
        d["known"] = {str(k): v for k, v in self.known.items()}
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "SavedState":
        d = json.loads(raw)
        return cls(
            term=int(d["term"]),
            generation=int(d["generation"]),
            history=list(d.get("history") or []),
            lost={int(k): dict(v) for k, v in (d.get("lost") or {}).items()},
            known={int(k): int(v) for k, v in (d.get("known") or {}).items()},
            world_round=int(d.get("world_round", 0)),
            dropped=sorted(int(r) for r in d.get("dropped") or []),
            grow_pause=int(d.get("grow_pause") or 0),
            switch_seq=int(d.get("switch_seq") or 0),
            switch_pause=int(d.get("switch_pause") or 0),
        )


def take_term(kv: KVStore) -> int:
    """A new controller's term: newer than every earlier controller's."""
    return kv.add(TERM_KEY, 1)


def _read_state(kv: KVStore) -> bytes | None:
    """The saved record's bytes, None when there is none. One request on ftrun's store
    (`present`: a MULTI_GET; `try_get` is a CHECK and a GET) — the record is JSON, never
    empty, so both read it the same. It is read before every plan (`check_term`) and every
    save, on a fault's path."""
    return kv.present([STATE_KEY])[0]


def load(kv: KVStore) -> SavedState | None:
    """The last saved state, None when no controller saved one (or it is unreadable)."""
    raw = _read_state(kv)
    if raw is None:
        return None
    try:
        return SavedState.from_json(raw)
    except (ValueError, KeyError, TypeError):
        return None


def _term_of(raw: bytes) -> int:
    try:
        return int(json.loads(raw)["term"])
    except (ValueError, KeyError, TypeError):
        return 0  # unreadable: it fences nobody


def check_term(kv: KVStore, term: int, what: str) -> None:
    """FencedError when a controller of a newer term than `term` saved its state: the
    controller of `term` was superseded and may not write `what`."""
    raw = _read_state(kv)
    newer = _term_of(raw) if raw is not None else 0
    if newer > term:
        raise FencedError(
            f"controller of term {term} was superseded by the controller of term "
            f"{newer}; write to {what!r} refused"
        )


def save(kv: KVStore, state: SavedState) -> None:
    """Write `state` unless a controller of a newer term wrote the record (FencedError)."""
    new = state.to_json()
    for _ in range(ATTEMPTS):
        raw = _read_state(kv)
        if raw is not None and _term_of(raw) > state.term:
            raise FencedError(
                f"controller of term {state.term} was superseded by the controller "
                f"of term {_term_of(raw)}; write to {STATE_KEY!r} refused"
            )
        if kv.compare_set(STATE_KEY, raw if raw is not None else b"", new) == new:
            return
    raise StoreError(f"{STATE_KEY!r} kept changing; the controller's state was not saved")
