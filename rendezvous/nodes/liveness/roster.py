"""What one agent believes about the other nodes, whichever liveness mechanism feeds it.

Owns: `Roster` — the live group ranks (with their incarnations), the dead ones, the leader
rule, this agent's own (group rank, incarnation), the `lost` flag with why it was set (`Lost`:
the others consider this agent dead, or it could not reach the store for the liveness timeout)
and the callbacks (`on_dead`, `on_join`, `on_leader`, `on_lost`) that hear of changes. A `Liveness`
implementation reports what it observes (`joined`, `gone`, `lose`); the roster turns that into
state and callbacks, once per incarnation.

Leader rule (no election): in a static world the leader is group rank 0 (a replacement of node 0
takes the role back); in a dynamic world it is the lowest live group rank.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from rendezvous.errors import DECLARED_DEAD

log = logging.getLogger("ftrun.membership")

NodeCallback = Callable[[int], None]
LeftCallback = Callable[[int, str], None]  # (group rank, the reason in its left marker)


@dataclass(frozen=True)
class Lost:
    """Why and when (monotonic) this agent stopped being a member; kind is one of the
    `rendezvous.errors` kinds (declared-dead, lease-expired, store-unreachable, ...)."""

    kind: str
    message: str
    at: float


class Roster:
    """Thread-safe view of the world's live nodes for one agent. `has_left(gr, inc)` tells
    whether that incarnation left on purpose (then its going is not a death)."""

    def __init__(
        self,
        static: bool,
        has_left: Callable[[int, int], bool],
        left_reason: Callable[[int, int], str] | None = None,
    ) -> None:
        self.static = static
        self._left_reason = left_reason
        self.lost = threading.Event()  # set when the others consider this agent dead
        self.lost_info: Lost | None = None  # why (set before `lost`)
        self._has_left = has_left
        self._lock = threading.Lock()
        self._alive: dict[int, int] = {}  # group rank -> incarnation
        self._dead: set[int] = set()
        self._leader = 0
        self._me = (-1, 0)
        self._closed = threading.Event()
        self._on_dead: NodeCallback | None = None
        self._on_join: NodeCallback | None = None
        self._on_leader: NodeCallback | None = None
        self._on_lost: Callable[[Lost], None] | None = None
        self._on_left: LeftCallback | None = None

    # ---------------------------------------------------------------------------- reading

    @property
    def me(self) -> tuple[int, int]:
        """This agent's (group rank, incarnation); (-1, 0) before it registered."""
        with self._lock:
            return self._me

    def alive(self) -> dict[int, int]:
        """Live group rank -> incarnation (a copy)."""
        with self._lock:
            return dict(self._alive)

    def dead(self) -> set[int]:
        with self._lock:
            return set(self._dead)

    def leader(self) -> int:
        with self._lock:
            return self._leader

    # ---------------------------------------------------------------------------- set-up

    def set_me(self, group_rank: int, incarnation: int) -> None:
        with self._lock:
            self._me = (group_rank, incarnation)

    def reset(self, alive: dict[int, int], ranks: list[int]) -> int:
        """Start from `alive` among the world's `ranks` (the rest are dead); return the leader."""
        with self._lock:
            self._alive = dict(alive)
            self._dead = set(ranks) - set(alive)
            self._leader = self._rule()
            return self._leader

    def subscribe(
        self, on_dead: NodeCallback, on_join: NodeCallback | None, on_leader: NodeCallback | None
    ) -> None:
        with self._lock:
            self._on_dead, self._on_join, self._on_leader = on_dead, on_join, on_leader

    def on_left(self, callback: LeftCallback | None) -> None:
        """Call `callback(group_rank, reason)` when a node leaves on purpose (its left marker's
        reason, e.g. keys.LEAVE_SIGNAL; "" when unknown)."""
        with self._lock:
            self._on_left = callback

    def on_lost(self, callback: Callable[[Lost], None] | None) -> None:
        """Call `callback(Lost)` once when this agent loses its membership (at once if it
        already has)."""
        with self._lock:
            self._on_lost = callback
        info = self.lost_info
        if callback is not None and info is not None and not self._closed.is_set():
            self._safe(callback, info)

    def close(self) -> None:
        """No callback and no `lost` after this (the agent is stopping)."""
        self._closed.set()

    # ---------------------------------------------------------------------------- reports

    def refresh(self, present: dict[int, int]) -> list[tuple[int, int]]:
        """Adopt the incarnations of the `present` ranks silently (a fresh snapshot); return the
        (rank, incarnation) pairs believed alive that the snapshot lacks (report them `gone`)."""
        with self._lock:
            for gr, inc in present.items():
                self._alive[gr] = inc
                self._dead.discard(gr)
            self._leader = self._rule()
            return [(gr, inc) for gr, inc in self._alive.items() if gr not in present]

    def joined(self, gr: int, inc: int) -> None:
        """Incarnation `inc` of node `gr` registered. A newer incarnation of a node believed
        alive means the older one died first: that death is reported before the join."""
        with self._lock:
            prev = self._alive.get(gr)
            if prev is not None and prev >= inc:
                return
            self._alive[gr] = inc
            self._dead.discard(gr)
            old_leader, self._leader = self._leader, self._rule()
            new_leader, mine = self._leader, gr == self._me[0]
        if not mine:
            if prev is not None:
                self._report_gone(gr, prev, left=False)
            log.info("node %d rejoined (incarnation %d)", gr, inc)
            self._call(self._on_join, gr)
        self._leader_changed(old_leader, new_leader)

    def gone(self, gr: int, inc: int | None, left: bool = False) -> None:
        """Node `gr` (incarnation `inc`, or whichever is alive when None) is gone: it died, or
        it left on purpose (`left`, or its left marker is set). Stale reports are ignored."""
        with self._lock:
            cur = self._alive.get(gr)
            if gr == self._me[0] or cur is None or (inc is not None and cur != inc):
                return
            del self._alive[gr]
            self._dead.add(gr)
            old_leader, self._leader = self._leader, self._rule()
            new_leader = self._leader
        self._report_gone(gr, cur, left)
        self._leader_changed(old_leader, new_leader)

    def lose(self, why: str, kind: str = DECLARED_DEAD) -> None:
        """This agent is no longer a member (the others consider it dead, or it cannot tell
        any more): set `lost` (once), say why, call on_lost."""
        with self._lock:
            if self._closed.is_set() or self.lost.is_set():
                return
            gr, inc = self._me
            self.lost_info = info = Lost(
                kind, f"node {gr} (incarnation {inc}): {why}", time.monotonic()
            )
            self.lost.set()
            cb = self._on_lost
        log.error("%s", info.message)
        if cb is not None:
            self._safe(cb, info)

    # ---------------------------------------------------------------------------- helpers

    def _rule(self) -> int:  # caller holds the lock
        return 0 if self.static else min(self._alive, default=0)

    def _report_gone(self, gr: int, inc: int, left: bool) -> None:
        if left or self._left(gr, inc):
            log.info("node %d left", gr)
            cb = self._on_left
            if cb is not None and not self._closed.is_set():
                self._safe(lambda g: cb(g, self._reason(g, inc)), gr)
            return
        log.warning("node %d is dead", gr)
        self._call(self._on_dead, gr)

    def _reason(self, gr: int, inc: int) -> str:
        if self._left_reason is None:
            return ""
        try:
            return self._left_reason(gr, inc)
        except Exception:  # noqa: BLE001 - a store hiccup: the reason is unknown
            return ""

    def _left(self, gr: int, inc: int) -> bool:
        try:
            return self._has_left(gr, inc)
        except Exception as exc:  # noqa: BLE001 - a store hiccup must not stop liveness tracking
            log.warning(
                "cannot tell whether node %d left on purpose (%s): treating it as dead", gr, exc
            )
            return False

    def _leader_changed(self, old: int, new: int) -> None:
        if new != old:
            log.info("node %d is the leader now", new)
            self._call(self._on_leader, new)

    def _call(self, cb: NodeCallback | None, gr: int) -> None:
        if cb is None or self._closed.is_set():
            return
        self._safe(cb, gr)

    @staticmethod
    def _safe(cb: Callable, arg: object) -> None:
        try:
            cb(arg)
        except Exception:  # a failing callback must not stop liveness tracking
            log.exception("membership callback %r failed for %r", cb, arg)
