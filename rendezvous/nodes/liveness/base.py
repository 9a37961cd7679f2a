"""The liveness interface: how an agent stays alive in the others' eyes and learns who died.

Owns: `Liveness` (the abstract base both mechanisms implement), `Timing` (heartbeat interval and
timeout), and what the two mechanisms share: the owned thread list, the left marker written on a
graceful leave (with its reason), the survey of live node records a replacement starts from, the
vacancies a hot spare may take, the self-check that notices on its own when this agent could not
show itself alive for the liveness timeout (cut off from the store), fenced writes, and stop.

Membership drives one `Liveness` through an agent's life:
  begin()                       before the agent writes any record (lease: grant and refresh it)
  put / register_join           join records that must vanish or be superseded with the agent
  wait_vacant + write_node      take a group rank (first registration or replacing a dead node)
  registered(gr, inc)           the agent holds group rank gr as incarnation inc
  announce_join(gr, inc)        tell the others a replacement joined
  start()                       keep showing this agent alive (idempotent)
  watch(ranks)                  report the others' deaths and joins to `roster`
  stop(leave, reason)           stop every thread and watch; with leave, a graceful goodbye
                                (left marker, then the lease is revoked) before any thread join

Self-fencing: the thread that shows this agent alive records its last success; a self-check
thread sets `roster.lost` (kind store-unreachable) once that is older than the silence the
others need to declare it dead (`_silence_limit`), even while a store call hangs. Once lost,
the agent stops showing itself alive, and `stop(leave=False)` drops its lease, so a fresh agent
(`Membership.renew()`) can take the group rank back.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

from rendezvous.errors import STORE_UNREACHABLE, FencedError
from rendezvous.kv import KVStore, StoreError
from rendezvous.nodes.keys import (
    LEAVE_DONE,
    LEFT_PREFIX,
    Registration,
    incarnation_key,
    left_key,
    marker_of,
    node_key,
)
from rendezvous.nodes.liveness.roster import Roster
from rendezvous.nodes.waits import Interrupt

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
        self.roster = Roster(static, self._has_left, self._left_reason)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._beating = False
        self._threads: list[threading.Thread] = []
        self._watches: list[Any] = []
        self.interrupt = Interrupt()  # membership shares its own: join waits end on it
        self.record: bytes = b""  # this agent's node record as written (for fenced writes)
        self._last_ok = time.monotonic()  # last time this agent showed itself alive
        self._outage = False  # a failure was logged and no success since

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

    def registered(self, gr: int, inc: int, record: bytes = b"") -> None:
        """This agent now holds group rank `gr` as incarnation `inc` (node record `record`)."""
        self.record = record
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

    # ------------------------------------------------------------------------- hot spares

    @abstractmethod
    def vacancies(self, ranks: list[int]) -> list[int]:
        """The `ranks` whose holder is gone and not finished (dead, or left for a reason other
        than LEAVE_DONE): a hot spare may claim them. Cheap enough to poll every interval."""

    def all_done(self, ranks: list[int]) -> bool:
        """True when the current holder of every rank left with LEAVE_DONE (the run is over)."""
        done = self._left_markers(LEAVE_DONE)
        for gr in ranks:
            raw = self.kv.try_get(node_key(gr))
            if raw is not None:
                inc = Registration.from_json(raw).incarnation
            else:  # etcd: the record went with the lease; the counter names the last holder
                inc = int(self.kv.try_get(incarnation_key(gr)) or b"0")
            if (gr, inc) not in done:
                return False
        return True

    @abstractmethod
    def put_spare(self, key: str, raw: bytes) -> None:
        """Write (or refresh) this agent's hot-spare record; it must vanish or go stale when
        the agent dies."""

    @abstractmethod
    def spares(self, prefix: str) -> list[bytes]:
        """The records of the live hot spares under `prefix`."""

    # ------------------------------------------------------------------------- fencing

    def fenced_set(self, key: str, value: bytes) -> None:
        """Write `key` only while this agent still holds its group rank; FencedError (logged)
        otherwise. Atomic on stores with transactions; elsewhere one read then the write."""
        self._check_member(key)
        self.kv.set(key, value)

    def fenced_compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """compare_set that is refused (FencedError) when this agent is stale."""
        self._check_member(key)
        return self.kv.compare_set(key, expected, desired)

    def check_member(self, key: str) -> None:
        """FencedError (logged) when this agent may not write `key` any more (see fenced_set)."""
        self._check_member(key)

    def _check_member(self, key: str) -> None:
        gr, inc = self.roster.me
        why = ""
        if inc == 0:
            why = "it holds no group rank"
        elif self.roster.lost.is_set():
            why = "it is no longer a member (lost)"
        elif self.kv.try_get(node_key(gr)) != self.record:
            why = f"node {gr}'s record belongs to another agent now"
        elif self._marked(gr, inc):
            why = "it was declared dead or left"
        if why:
            self._refuse(key, why)

    def _refuse(self, key: str, why: str) -> None:
        gr, inc = self.roster.me
        msg = f"node {gr} (incarnation {inc}) is stale: write to {key!r} refused ({why})"
        log.error("%s", msg)
        raise FencedError(msg)

    # ------------------------------------------------------------------------- running

    def start(self) -> None:
        """Start the thread that shows this agent alive and the self-check. Idempotent;
        stopped by stop()."""
        with self._lock:
            if self._beating or self._stop.is_set() or not self._can_beat():
                return
            self._beating = True
            self._last_ok = time.monotonic()
        self._spawn(self._beat, "heartbeat")
        self._spawn(self._selfcheck, "selfcheck")

    @abstractmethod
    def watch(self, ranks: list[int]) -> None:
        """Report the other nodes' deaths and joins to `roster` from now on."""

    def stop(self, leave: bool, reason: str = LEAVE_DONE) -> None:
        """Stop every thread and watch. With `leave`, tell the others at once that this agent
        left on purpose (`reason`, see keys.LEAVE_*; no on_dead for it). A lost agent drops
        its lease either way. Idempotent; does not close the store."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.interrupt.set()
        self._wake()
        lost = self.roster.lost.is_set()
        self.roster.close()
        if leave or lost:
            self._goodbye(leave and not lost, reason)
        for h in self._watches:
            try:
                h.cancel()
            except StoreError:
                pass
        self._watches.clear()
        end = time.monotonic() + max(1.0, 2 * self.timing.interval)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=max(0.0, end - time.monotonic()))

    # ------------------------------------------------------------------------- for subclasses

    def _wake(self) -> None:
        """(stop()) End the blocking store waits of this liveness's threads at once. Default:
        none waits longer than stop() joins."""

    @abstractmethod
    def _can_beat(self) -> bool:
        """True once `_beat` has what it needs."""

    @abstractmethod
    def _beat(self) -> None:
        """Thread body: show this agent alive every interval until stop."""

    def _goodbye(self, announce: bool, reason: str) -> None:
        """Left marker (when `announce`), then drop the lease: at once, but bounded, since the
        store may be unreachable (the thread is left to finish on its own then)."""
        gr, inc = self.roster.me

        def run() -> None:
            if announce and inc:
                try:
                    self._announce_leave(gr, inc, reason)
                except StoreError as exc:
                    log.warning("node %d could not announce its leave: %s", gr, exc)
            self._release()

        t = threading.Thread(target=run, name="ftrun-membership-leave", daemon=True)
        t.start()
        t.join(max(1.0, 2 * self.timing.interval))
        if t.is_alive():
            log.warning(
                "node %d: the store did not take its leave within %.1fs",
                gr,
                max(1.0, 2 * self.timing.interval),
            )

    def _announce_leave(self, gr: int, inc: int, reason: str) -> None:
        self.kv.set(left_key(gr, inc), json.dumps({"reason": reason}).encode())

    def _release(self) -> None:
        """After a graceful stop (or once lost): drop what keeps this agent's records alive."""

    def _left_reason(self, gr: int, inc: int) -> str:
        """The reason in the left marker of incarnation `inc` of `gr` ("" without one)."""
        return _reason(self.kv.try_get(left_key(gr, inc)))

    def _has_left(self, gr: int, inc: int) -> bool:
        return self.kv.try_get(left_key(gr, inc)) is not None

    def _left_markers(self, reason: str | None = None) -> set[tuple[int, int]]:
        """(group rank, incarnation) of every left marker (with `reason`, when given)."""
        out = set()
        for key in self.kv.keys(LEFT_PREFIX):
            try:
                mark = marker_of(key)
            except ValueError:
                continue
            if reason is not None and _reason(self.kv.try_get(key)) != reason:
                continue
            out.add(mark)
        return out

    # -- self-check: notice on our own that the others consider us dead ----------------------

    def _alive_ok(self) -> None:
        """The beat thread showed this agent alive just now."""
        self._last_ok = time.monotonic()
        if self._outage:
            self._outage = False
            log.info("node %d reaches the store again", self.roster.me[0])

    def _alive_failed(self, exc: BaseException) -> None:
        if not self._outage and not self._stop.is_set():
            self._outage = True
            log.warning(
                "node %d cannot show itself alive (will retry for %.1fs): %s",
                self.roster.me[0],
                self._silence_limit(),
                exc,
            )

    def _silence_limit(self) -> float:
        """Seconds without showing itself alive after which the others declare it dead."""
        return self.timing.timeout

    def _selfcheck(self) -> None:
        while not self._stop.wait(min(0.1, self.timing.interval / 2)):
            if self.roster.lost.is_set():
                return
            silent, limit = time.monotonic() - self._last_ok, self._silence_limit()
            if silent > limit:
                self.roster.lose(
                    f"could not reach the store for {silent:.1f}s (longer than the "
                    f"liveness timeout {limit:g}s): the other nodes consider it "
                    "dead; stop the local workers and rejoin as a fresh node",
                    STORE_UNREACHABLE,
                )
                return

    def _marked(self, gr: int, inc: int) -> bool:
        """True when incarnation `inc` of `gr` is known to be gone (left, or declared dead)."""
        return self._has_left(gr, inc)

    @property
    def stopping(self) -> threading.Event:
        """Set by stop(): threads that membership runs with `spawn` end on it."""
        return self._stop

    def spawn(self, target: Callable[[], None], name: str) -> None:
        """Run `target` on a thread this liveness owns (stop() joins it)."""
        self._spawn(target, name)

    def gone_for_good(self, gr: int, inc: int) -> bool:
        """True when incarnation `inc` of `gr` no longer holds the rank or is marked gone."""
        raw = self.kv.try_get(node_key(gr))
        if raw is None or Registration.from_json(raw).incarnation != inc:
            return True
        return self._marked(gr, inc)

    def _spawn(self, target: Callable[[], None], name: str) -> threading.Thread:
        t = threading.Thread(target=target, name=f"ftrun-membership-{name}", daemon=True)
        with self._lock:
            self._threads.append(t)
        t.start()
        return t


def _reason(raw: bytes | None) -> str:
    """The reason in a left marker ("" when it has none: markers of older versions)."""
    if not raw:
        return ""
    try:
        return str(json.loads(raw).get("reason", ""))
    except (ValueError, AttributeError):
        return ""
