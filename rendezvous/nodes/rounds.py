"""Rendezvous rounds: closing the current world so that a new dynamic rendezvous can include
agents waiting to get in (`--rdzv-conf scale_up=restart`, torchrun's behaviour), and retiring
the world of an earlier run whose nodes are all gone. The launcher uses a new round for
scale-up and to shrink the world when a lost node is not taken over (launcher.control.controller).

Owns: the "retired" marker that replaces the world under `keys.WORLD_KEY`, and wiping what a
retired world leaves behind. Nothing here decides *when* a round is needed (the controller
does) nor joins one (`Membership.next_round`).

A new round (round r -> r+1):
  1. the controller's agent calls `Membership.request_round()`: one compare-and-set replaces
     the world of round r by a marker {"retired": true, "round": r+1, "expect": N, "by": nonce}
     (N = live members + waiting spares, at most MAX); only one request wins;
  2. every member hears of it (`watch_nodes(on_round=...)`), stops its workers and calls
     `next_round()`: it leaves round r (left marker, lease revoked) and joins round r+1 as a
     fresh dynamic rendezvous; waiting spares leave their wait and join it too;
  3. the requester waits (up to close_timeout) until every live member of round r has left,
     then wipes round r's rendezvous keys and node records (not the generation, not the
     launcher's keys) and the workers' keys (every key outside keys.ROOT: every worker restarts
     in the new world and must not read a previous world's keys) and deletes the marker: the
     new rendezvous starts;
  4. the new world orders survivors by their old group rank, then newcomers by arrival, so
     surviving nodes keep their group ranks when nobody was lost; it closes as soon as N agents
     arrived (or after last_call_timeout with at least MIN).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Callable

from rendezvous.kv import KVStore
from rendezvous.nodes.keys import GENERATION_KEY, NODE_PREFIX, RDZV, ROOT, RUN_ID_KEY, WORLD_KEY

log = logging.getLogger("ftrun.membership")


def marker(round_: int, expect: int, by: str) -> bytes:
    """The retired marker that opens round `round_` (0: an earlier run was retired)."""
    return json.dumps(
        {"retired": True, "round": round_, "expect": expect, "by": by}, sort_keys=True
    ).encode()


def read(raw: bytes | None) -> dict | None:
    """The world or marker JSON under WORLD_KEY (None when absent)."""
    return json.loads(raw) if raw else None


def pending(kv: KVStore, current_round: int) -> dict | None:
    """The marker of a round newer than `current_round`, if one was requested."""
    doc = read(kv.try_get(WORLD_KEY))
    if doc is not None and doc.get("retired") and int(doc.get("round", 0)) > current_round:
        return doc
    return None


def wipe(kv: KVStore, whole_run: bool) -> int:
    """Delete a retired world's keys, the marker last. `whole_run` (an earlier run): every key;
    otherwise (a new round) the rendezvous keys, the node records and the workers' keys (outside
    ROOT), keeping the run id, the generation and the launcher's keys."""
    n = 0
    if whole_run:
        doomed = [k for k in kv.keys("") if k != WORLD_KEY]
    else:
        doomed = [
            k
            for k in kv.keys("")
            if (k.startswith((RDZV + "/", NODE_PREFIX)) or not k.startswith(ROOT + "/"))
            and k not in (WORLD_KEY, RUN_ID_KEY, GENERATION_KEY)
        ]
    for key in doomed:
        n += bool(kv.delete(key))
    kv.delete(WORLD_KEY)
    return n


def wait_left(
    everyone_left: Callable[[], bool], timeout: float, sleep: Callable[[float], bool]
) -> bool:
    """Poll `everyone_left()` until True or `timeout`; False when some member did not leave
    (it is then treated as gone: its records are wiped with the round)."""
    end = time.monotonic() + timeout
    while not everyone_left():
        if time.monotonic() >= end or not sleep(0.05):
            return False
    return True
