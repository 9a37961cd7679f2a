"""Per-rank progress records in the store: what the controller's blame looks at.

Owns: the record each agent publishes for its node under `plan.progress_key(node)` (at most every
`PUBLISH_INTERVAL` s, from its health check): for every live local rank, whether it uses
launcher.runtime, how long it has gone without progress, whether it waits in a collective, how
long its heartbeats have been silent, its process state; and reading every node's records back as
`decision.RankProgress` (idle and silent times aged by the record's age; records older than
`STALE_AFTER` s are skipped: that node's agent is not publishing). One key per node, so the
controller reads O(nodes) keys, and only when it holds a report to blame.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable

from launcher.control.decision import RankProgress
from launcher.protocol import plan as P
from rendezvous.kv import KVStore, StoreError

PUBLISH_INTERVAL = 1.0
STALE_AFTER = 30.0


@dataclass
class ProgressBoard:
    """One agent's publisher (owned by the agent) and the controller's reader."""

    kv: KVStore
    node: int
    interval: float = PUBLISH_INTERVAL
    _last: float = field(default=0.0)
    put: Callable[[str, bytes], None] | None = None  # the agent's: off its loop (loop_store)

    def due(self, now: float) -> bool:
        return now - self._last >= self.interval

    def publish(self, ranks: dict[int, dict], now: float | None = None) -> None:
        """`ranks`: rank -> record (aware, idle_s, waiting, silent_s, state, phase, pid, ...)."""
        now = time.time() if now is None else now
        self._last = now
        body = {"time": now, "node": self.node, "ranks": {str(r): v for r, v in ranks.items()}}
        raw = json.dumps(body).encode()
        if self.put is not None:
            self.put(P.progress_key(self.node), raw)
            return
        try:
            self.kv.set(P.progress_key(self.node), raw)
        except StoreError:
            pass  # the next health check publishes again


def read_progress(kv: KVStore, nnodes: int, now: float | None = None) -> list[RankProgress]:
    """Every node's published records, aged to `now`."""
    now = time.time() if now is None else now
    out: list[RankProgress] = []
    raws = kv.present([P.progress_key(node) for node in range(nnodes)])  # one request (TCP)
    for node, raw in enumerate(raws):
        if raw is None:
            continue
        try:
            body = json.loads(raw)
            age = max(0.0, now - float(body["time"]))
            ranks = body["ranks"]
        except (ValueError, KeyError, TypeError):
            continue
        if age > STALE_AFTER:
            continue
        for r, rec in ranks.items():
            out.append(
                RankProgress(
                    rank=int(r),
                    node=node,
                    aware=bool(rec.get("aware")),
                    idle_s=float(rec.get("idle_s", 0.0)) + age,
                    waiting=bool(rec.get("waiting")),
                    silent_s=float(rec.get("silent_s", 0.0)) + age,
                    state=str(rec.get("state", "")),
                    phase=str(rec.get("phase", "")),
                    pid=rec.get("pid"),
                    local_rank=rec.get("local_rank"),
                    host=str(rec.get("host", "")),
                )
            )
    return out
