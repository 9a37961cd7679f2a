"""Where a job's hot switch in progress stands, read from its store (`ftctl status`).

Owns: `SwitchState` and `switch_state(kv)`: the hot switch (`ftctl migrate`, a sub-health file)
not answered yet, in its stage: `requested` (the request is written, the controller has not
taken it: a round in progress, or another switch first), `starting` (the controller's
`plan.SwitchOrder` is out: the new processes start; how many posted their status), `halting`
(they are ready: the controller's pause halts every rank at one step boundary), `switching`
(the switch round is published: the drained processes stop, the new ones receive their state);
`describe` is its one line. A switch that ended (done, refused, abandoned) is in the world
history and `ftctl migrate`'s answer, not here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from launcher.observe.pause_state import pause_state
from launcher.protocol import plan as P

REQUESTED, STARTING, HALTING, SWITCHING = "requested", "starting", "halting", "switching"
LOOKBACK = 16  # older requests looked at for one not answered yet


@dataclass(frozen=True)
class SwitchState:
    seq: int
    stage: str  # REQUESTED, STARTING, HALTING or SWITCHING
    requested: float  # epoch seconds
    source: str  # "ftctl" or "subhealth"
    ranks: list[int]  # the ranks that move ([] while only a node is named)
    node: int | None = None
    generation: int = 0  # the switch round's (0: not taken yet)
    ready: int = 0  # new processes that posted their status
    halt_step: int | None = None  # the step every rank halts after (agreed)
    waiting: int = 0  # later requests queued behind this one

    def describe(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        age = f"{max(0.0, now - self.requested):.1f}s ago"
        what = f"ranks {self.ranks}" if self.ranks else f"node {self.node}"
        head = f"hot switch #{self.seq} ({self.source}, {what}, requested {age})"
        if self.stage == REQUESTED:
            out = f"{head}: requested, not taken yet (a round or another switch first)"
        elif self.stage == STARTING:
            out = (
                f"{head}: waiting for the new processes ({self.ready} of {len(self.ranks)} "
                "ready; the ranks keep training)"
            )
        elif self.stage == HALTING:
            after = "" if self.halt_step is None else f" (after step {self.halt_step})"
            out = f"{head}: new processes ready; halting every rank at a step boundary{after}"
        else:
            after = "" if self.halt_step is None else f" after step {self.halt_step}"
            out = (
                f"{head}: switching in generation {self.generation}: halted{after}, the new "
                "processes receive their state"
            )
        return out + (f"; {self.waiting} more request(s) queued" if self.waiting else "")


def _open_requests(kv: Any) -> list[P.MigrateRequest]:
    """The latest requests not answered yet, oldest first."""
    raw = kv.try_get(P.MIGRATE_SEQ)
    last = int(raw) if raw else 0
    out: list[P.MigrateRequest] = []
    for seq in range(last, max(0, last - LOOKBACK), -1):
        if kv.try_get(P.migrate_outcome_key(seq)) is not None:
            continue
        req = kv.try_get(P.migrate_key(seq))
        if req is not None:
            out.append(P.MigrateRequest.from_json(req))
    return out[::-1]


def switch_state(kv: Any) -> SwitchState | None:
    """The hot switch in progress in the job of store `kv` (a KVStore), None when none is."""
    open_ = _open_requests(kv)
    if not open_:
        return None
    raw = kv.try_get(P.SWITCH_KEY)
    order = P.SwitchOrder.from_json(raw) if raw is not None else None
    req = next((r for r in open_ if order is not None and r.seq == order.seq), open_[0])
    queued = len(open_) - 1
    base = dict(seq=req.seq, requested=req.time, source=req.source, node=req.node, waiting=queued)
    if order is None or order.seq != req.seq:
        return SwitchState(stage=REQUESTED, ranks=list(req.ranks), **base)
    g, ranks = order.generation, list(order.ranks)
    plan_raw = kv.try_get(P.plan_key(g))
    pause = pause_state(kv)
    ours = pause if pause is not None and pause.requested >= req.time else None
    step = ours.halt_step if ours is not None else None
    if plan_raw is not None and P.Plan.from_json(plan_raw).strategy == P.SWITCH:
        return SwitchState(stage=SWITCHING, ranks=ranks, generation=g, halt_step=step, **base)
    if ours is not None and ours.in_effect:
        return SwitchState(stage=HALTING, ranks=ranks, generation=g, halt_step=step, **base)
    ready = sum(1 for r in ranks if kv.try_get(P.status_key(g, r)) is not None)
    return SwitchState(stage=STARTING, ranks=ranks, generation=g, ready=ready, **base)
