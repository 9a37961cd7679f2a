"""The liveness interface: how an agent stays alive in the others' eyes and learns who died.

Owns: `Liveness` (the abstract base both mechanisms implement), `Timing` (heartbeat interval and
timeout), and what the two mechanisms share: the owned thread list, the left marker written on a
graceful leave, the survey of live node records a replacement starts from, and stop.

Membership drives one `Liveness` through an agent's life:
  begin()                       before the agent writes any record (lease: grant and refresh it)
  put / register_join           join records that must vanish or be superseded with the agent
  wait_vacant + write_node      take a group rank (first registration or replacing a dead node)
  registered(gr, inc)           the agent holds group rank gr as incarnation inc
  announce_join(gr, inc)        tell the others a replacement joined
  start()                       keep showing this agent alive (idempotent)
  watch(ranks)                  report the others' deaths and joins to `roster`
  stop(leave)                   stop every thread and watch; with leave, a graceful goodbye
"""
from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

from rendezvous.keys import Registration, left_key, node_key
from rendezvous.kv import KVStore, StoreError
from rendezvous.liveness.roster import Roster

log = logging.getLogger("ftrun.membership")


@dataclass(frozen=True)
class Timing:
    """interval: how often an agent shows it is alive; timeout: silence that means dead."""

    interval: float
    timeout: float


class Liveness(ABC):
    """One agent's liveness on one store. Owns its threads and watches; `stop()` ends them."""

    def __init__(self, kv: KVStore, timing: Timing, static: bool, nonce: str) -> None:
        self.kv = kv
        self.timing = timing
        self.nonce = nonce
        self.roster = Roster(static, self._has_left)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._beating = False
        self._threads: list[threading.Thread] = []
        self._watches: list[Any] = []

    # ------------------------------------------------------------------------- registration

    def begin(self) -> None:
        """Called before this agent writes any record."""

    @abstractmethod
    def put(self, key: str, raw: bytes) -> None:
        """Write a join record that belongs to this agent's life."""

    @abstractmethod
    def register_join(self, key: str, raw: bytes, deadline: float) -> bytes | None:
        """Write this agent's static join record at `key`; if a live agent holds it (and does
        not go before `deadline`), write nothing and return that agent's record."""

    @abstractmethod
    def wait_vacant(self, gr: int, patience: float, judge: bool) -> bytes | None:
        """Wait up to `patience` s for group rank `gr` to have no live holder. Returns None while
        it has one, else the bytes `write_node` must replace (b"" for none). With `judge`,
        decide on the holder's death here instead of waiting for the others' verdict."""

    @abstractmethod
    def write_node(self, gr: int, raw: bytes, replacing: bytes | None) -> bool:
        """Write this agent's node record for `gr`. With `replacing` (from `wait_vacant`),
        replace exactly that record; False when another agent got there first."""

    def registered(self, gr: int, inc: int) -> None:
        """This agent now holds group rank `gr` as incarnation `inc`."""
        self.roster.set_me(gr, inc)

    def announce_join(self, gr: int, inc: int) -> None:
        """Tell the others that this replacement joined (when the node record does not)."""

    def survey(self, ranks: list[int], me: int) -> dict[int, int]:
        """Group rank -> incarnation of the `ranks` whose holder is alive now (`me` always)."""
        alive = {}
        for gr in ranks:
            raw = self.kv.try_get(node_key(gr))
            if raw is None:
                continue
            inc = Registration.from_json(raw).incarnation
            if gr == me or not self._marked(gr, inc):
                alive[gr] = inc
        return alive

    @abstractmethod
    def world_is_dead(self, ranks: list[int]) -> bool:
        """True when no holder of the world's `ranks` is alive any more."""

    # ------------------------------------------------------------------------- running

    def start(self) -> None:
        """Start the thread that shows this agent alive. Idempotent; stopped by stop()."""
        with self._lock:
            if self._beating or self._stop.is_set() or not self._can_beat():
                return
            self._beating = True
        self._spawn(self._beat, "heartbeat")

    @abstractmethod
    def watch(self, ranks: list[int]) -> None:
        """Report the other nodes' deaths and joins to `roster` from now on."""

    def stop(self, leave: bool) -> None:
        """Stop every thread and watch. With `leave`, tell the others this agent left on
        purpose (no on_dead for it). Idempotent; does not close the store."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.roster.close()
        gr, inc = self.roster.me
        if leave and inc:
            try:
                self._announce_leave(gr, inc)
            except StoreError as exc:
                log.warning("node %d could not announce its leave: %s", gr, exc)
        for h in self._watches:
            try:
                h.cancel()
            except StoreError:
                pass
        self._watches.clear()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=max(2.0, 2 * self.timing.interval))
        if leave:
            self._release()

    # ------------------------------------------------------------------------- for subclasses

    @abstractmethod
    def _can_beat(self) -> bool:
        """True once `_beat` has what it needs."""

    @abstractmethod
    def _beat(self) -> None:
        """Thread body: show this agent alive every interval until stop."""

    def _announce_leave(self, gr: int, inc: int) -> None:
        self.kv.set(left_key(gr, inc), b"1")

    def _release(self) -> None:
        """After a graceful stop: drop what keeps this agent's records alive."""

    def _has_left(self, gr: int, inc: int) -> bool:
        return self.kv.try_get(left_key(gr, inc)) is not None

    def _marked(self, gr: int, inc: int) -> bool:
        """True when incarnation `inc` of `gr` is known to be gone (left, or declared dead)."""
        return self._has_left(gr, inc)

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=f"ftrun-membership-{name}", daemon=True)
        with self._lock:
            self._threads.append(t)
        t.start()
