"""Heartbeat-based liveness, for stores without leases (the embedded TCP store, LocalKV).

Owns: `HeartbeatLiveness`. Every agent bumps its heartbeat counter (`keys.hb_key`) each interval.
The lowest live group rank (the checker) watches everyone's counter (one request per look);
every other agent watches the checker's (one request per look, `watcher_cadence`: 2 a second at
the defaults whatever the node count), so the store sees at most about `READS_PER_SECOND`
counter reads per second from the checker plus 2 requests per node per second. A counter that
does not move for the heartbeat timeout — by the observer's own clock, so clock skew does not
matter; `check_cadence` sets how often it looks and shortens the quiet time by its own lateness,
so a crash is declared within the timeout — is declared dead exactly once (create-if-absent
marker at `keys.dead_key`) and published on the membership event log (`keys.event_key`),
which every agent follows with blocking waits (of one timeout each on the TCP store, whose
waits stop() can interrupt). Joins of replacements and graceful leaves go through the same log.

Fencing: a heartbeat is a compare-and-set from the value this agent wrote last, so once a newer
incarnation has taken the group rank (and rewritten the counter) the stale agent's heartbeat is
refused and it knows it was superseded. Hot spares refresh the wall time in their record every
interval; a spare record older than two liveness timeouts is not listed (clocks are assumed to
be NTP-synchronised to well under a second).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any

from rendezvous.errors import SUPERSEDED
from rendezvous.kv import StoreError
from rendezvous.nodes.keys import (
    DEAD_PREFIX,
    EVENT_SEQ_KEY,
    LEAVE_DONE,
    Registration,
    dead_key,
    event_key,
    hb_key,
    marker_of,
    node_key,
)
from rendezvous.nodes.liveness.base import Liveness, Timing

log = logging.getLogger("ftrun.membership")


READS_PER_SECOND = 500.0  # the checker's heartbeat reads on the store, at most (many nodes)
JITTER_MARGIN = 0.5  # s a live node's beat may come late (store latency, GC) without a verdict


def check_cadence(timing: Timing, watched: int) -> tuple[float, float]:
    """(period, quiet): how often the checker reads the heartbeats of `watched` nodes, and how
    long a counter must stay unchanged, by the checker's clock, to declare its node dead.

    A crash right after a beat is seen at most one period late and judged at most one period
    after the quiet time is up, so `quiet = timeout - 2 * period` keeps crash-to-verdict within
    the documented timeout. A live node's next beat must still arrive before the verdict:
    `interval + period` (its next beat seen) plus JITTER_MARGIN must fit in `quiet - period`;
    when it does not (a timeout of few intervals and a slow cadence), quiet is the timeout."""
    period = max(timing.interval / 10, watched / READS_PER_SECOND)
    period = min(period, timing.interval / 2)
    return period, quiet_for(timing, period)


def quiet_for(timing: Timing, period: float) -> float:
    """The quiet time of a watcher looking every `period` s (see check_cadence)."""
    quiet = timing.timeout - 2 * period
    if quiet - period < timing.interval + JITTER_MARGIN:
        quiet = timing.timeout
    return quiet


def watcher_cadence(timing: Timing, readers: int) -> tuple[float, float]:
    """(period, quiet) of an agent that reads only the checker's counter (one key per look):
    as slow as keeps a crash's verdict within the timeout (`quiet = timeout - 2 * period`)
    while a live checker's beat may still come twice JITTER_MARGIN late without a verdict
    (`quiet - period >= interval + 2 * JITTER_MARGIN`), never faster than `check_cadence` for
    `readers` and never slower than interval / 2 (as check_cadence at hundreds of nodes). At
    the defaults (1 s, 5 s) that is 2 looks a second at any node count; with a timeout of two
    intervals it is check_cadence's."""
    fastest, _ = check_cadence(timing, readers)
    slowest_safe = (timing.timeout - timing.interval - 2 * JITTER_MARGIN) / 3
    period = min(timing.interval / 2, max(fastest, slowest_safe))
    return period, quiet_for(timing, period)


def watch_plan(me: int, alive: dict[int, int]) -> tuple[list[int], int]:
    """(whose heartbeat counters agent `me` reads, how many reads per look its cadence is set
    for). The checker (lowest live group rank) reads every other node's; every other agent
    reads only the checker's, but they all do, so each sets its cadence as if it read every
    node's: the store's liveness reads stay bounded (`READS_PER_SECOND` from the checker, as
    many from all the others together) instead of growing with the node count."""
    lowest = min(alive) if alive else me
    if lowest == me:
        watch = [gr for gr in alive if gr != me]
        return watch, len(watch)
    return [lowest], len(alive)


class HeartbeatLiveness(Liveness):
    """Liveness through heartbeat counters and an event log (see module docstring)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._event_next = 1  # next event-log sequence number to read (set at registration)
        self._follower: threading.Thread | None = None  # the event log's thread (watch())

    def put(self, key: str, raw: bytes) -> None:
        self.kv.set(key, raw)

    def register_join(self, key: str, raw: bytes, deadline: float) -> bytes | None:
        self.kv.set(key, raw)  # no lease to tell a live holder from a dead one: last one wins
        return None

    def wait_vacant(self, gr: int, patience: float, judge: bool) -> bytes | None:
        old = self.kv.try_get(node_key(gr))
        if old is None:
            return b""
        inc = Registration.from_json(old).incarnation
        if not self._marked(gr, inc):
            # not declared dead yet: a static replacement checks the heartbeat itself (the
            # others may all be gone); a dynamic one waits for the checker's verdict
            if not judge or not self._still([gr], patience):
                return None
            self._declare_dead(gr, inc)
        return old

    def write_node(self, gr: int, raw: bytes, replacing: bytes | None) -> bool:
        if replacing is None:
            self.kv.set(node_key(gr), raw)
            return True
        return self.kv.compare_set(node_key(gr), replacing, raw) == raw

    def registered(self, gr: int, inc: int, record: bytes = b"") -> None:
        super().registered(gr, inc, record)
        self.kv.set(hb_key(gr), f"{inc}:0".encode())
        self._event_next = int(self.kv.try_get(EVENT_SEQ_KEY) or b"0") + 1

    def announce_join(self, gr: int, inc: int) -> None:
        self._publish({"kind": "join", "group_rank": gr, "incarnation": inc})

    def world_is_dead(self, ranks: list[int]) -> bool:
        pending = []
        for gr in ranks:
            raw = self.kv.try_get(node_key(gr))
            if raw is not None and self._marked(gr, Registration.from_json(raw).incarnation):
                continue
            pending.append(gr)
        # undeclared nodes: dead only if none of their heartbeats moves for one timeout
        return not pending or self._still(pending, 0.0)

    def watch(self, ranks: list[int]) -> None:
        self._follower = self._spawn(self._follow_events, "events")
        self._spawn(self._check_loop, "checker")

    def vacancies(self, ranks: list[int]) -> list[int]:
        gone = self._markers(DEAD_PREFIX)
        gone |= {m for m in self._left_markers() if self._left_reason(*m) != LEAVE_DONE}
        out = []
        for gr in sorted({g for g, _ in gone if g in set(ranks)}):
            raw = self.kv.try_get(node_key(gr))
            if raw is None or (gr, Registration.from_json(raw).incarnation) in gone:
                out.append(gr)
        return out

    def put_spare(self, key: str, raw: bytes) -> None:
        rec = json.loads(raw)
        rec["beat"] = time.time()
        self.kv.set(key, json.dumps(rec, sort_keys=True).encode())

    def spares(self, prefix: str) -> list[bytes]:
        out, now = [], time.time()
        for key in self.kv.keys(prefix):
            raw = self.kv.try_get(key)
            if raw is not None and now - Registration.from_json(raw).beat < 2 * self.timing.timeout:
                out.append(raw)
        return out

    # ------------------------------------------------------------------------------ internals

    def _can_beat(self) -> bool:
        return self.roster.me[1] > 0  # heartbeat keys are per group rank

    def _beat(self) -> None:
        gr, inc = self.roster.me
        mine = f"{inc}:".encode()
        last, seq = f"{inc}:0".encode(), 0
        while not self._stop.wait(self.timing.interval) and not self.roster.lost.is_set():
            seq += 1
            new = f"{inc}:{seq}".encode()
            try:
                got = self.kv.compare_set(hb_key(gr), last, new)
            except StoreError as exc:
                self._alive_failed(exc)
                continue
            if got == new or got.startswith(mine):  # ours (a lost reply: adopt what we wrote)
                last = got
                if got == new:
                    self._alive_ok()
                continue
            self.roster.lose(
                f"its heartbeat was refused: node {gr}'s counter holds {got!r}, a "
                "newer incarnation took its place",
                SUPERSEDED,
            )
            return

    def _marked(self, gr: int, inc: int) -> bool:
        return self.kv.try_get(dead_key(gr, inc)) is not None or self._has_left(gr, inc)

    def _markers(self, prefix: str) -> set[tuple[int, int]]:
        out = set()
        for key in self.kv.keys(prefix):
            try:
                out.add(marker_of(key))
            except ValueError:
                continue
        return out

    def _announce_leave(self, gr: int, inc: int, reason: str) -> None:
        super()._announce_leave(gr, inc, reason)
        self._publish({"kind": "leave", "group_rank": gr, "incarnation": inc, "reason": reason})

    def _still(self, ranks: list[int], patience: float) -> bool:
        """True once the heartbeats of `ranks` all stay unchanged for one heartbeat timeout;
        False when that cannot happen within max(patience, timeout) seconds."""
        timeout = self.timing.timeout
        last, since = [self.kv.try_get(hb_key(gr)) for gr in ranks], time.monotonic()
        # the window starts after the first read (a slow read must not eat the quiet time);
        # `since` stays <= end - timeout, so each pass ends by end + one sleep and read
        end = since + max(patience, timeout)
        while True:
            if not self.interrupt.sleep(min(self.timing.interval / 2, 0.25)):
                return False
            cur, now = [self.kv.try_get(hb_key(gr)) for gr in ranks], time.monotonic()
            if cur != last:
                if end - now < timeout:
                    return False  # no full quiet timeout fits any more
                last, since = cur, now
            elif now - since >= timeout:
                return True

    def _publish(self, event: dict) -> None:
        seq = self.kv.add(EVENT_SEQ_KEY, 1)
        self.kv.set(event_key(seq), json.dumps(event, sort_keys=True).encode())

    def _declare_dead(self, gr: int, inc: int) -> None:
        """Mark (gr, inc) dead exactly once across all agents and publish it."""
        if self._has_left(gr, inc):
            return
        token = f"{self.nonce}:{uuid.uuid4().hex}".encode()
        if self.kv.compare_set(dead_key(gr, inc), b"", token) == token:
            log.warning(
                "node %d (incarnation %d) missed heartbeats for %.1fs: declaring it dead",
                gr,
                inc,
                self.timing.timeout,
            )
            self._publish({"kind": "dead", "group_rank": gr, "incarnation": inc})

    def _follow_events(self) -> None:
        """Apply the event log in order. While nothing happens this costs the store one WAIT,
        its CANCEL_WAIT and a read of the sequence counter per wait: a wait of one liveness
        timeout where stop() can interrupt it (the TCP store), else of one interval."""
        stuck_since: float | None = None
        idle_wait = self.timing.timeout if self.kv.interruptible_waits else self.timing.interval
        while not self._stop.is_set():
            key = event_key(self._event_next)
            # a slot allocated but not written yet is looked at every interval until skipped
            wait = idle_wait if stuck_since is None else self.timing.interval
            try:
                if not self.kv.wait([key], wait):
                    seq = int(self.kv.try_get(EVENT_SEQ_KEY) or b"0")
                    if seq >= self._event_next:  # allocated but never written (writer died)
                        stuck_since = stuck_since or time.monotonic()
                        if time.monotonic() - stuck_since > 2 * self.timing.timeout:
                            self._event_next += 1
                            stuck_since = None
                    continue
                raw = self.kv.present([key])[0]
            except StoreError as exc:
                if not self._stop.is_set():
                    self._alive_failed(exc)  # logged once per outage
                    self._stop.wait(self.timing.interval)
                continue
            stuck_since = None
            self._event_next += 1
            if raw is not None:
                self._apply(json.loads(raw))

    def _wake(self) -> None:
        if self._follower is not None:
            self.kv.interrupt_waits(self._follower)

    def _apply(self, ev: dict) -> None:
        gr, inc, kind = int(ev["group_rank"]), int(ev["incarnation"]), ev["kind"]
        if kind == "join":
            self.roster.joined(gr, inc)
            return
        if (gr, inc) == self.roster.me:
            if kind == "dead":
                self.roster.lose("the other nodes declared this agent dead (missed heartbeats)")
            return
        self.roster.gone(gr, inc, left=kind == "leave")

    def _check_loop(self) -> None:
        seen: dict[int, tuple[bytes | None, float]] = {}
        period, quiet = check_cadence(self.timing, 1)
        while not self._stop.wait(period):
            if self.roster.lost.is_set():
                continue  # a lost agent judges nobody (its view is stale)
            alive = self.roster.alive()
            watch, readers = watch_plan(self.roster.me[0], alive)
            checker = not alive or min(alive) == self.roster.me[0]
            cadence = check_cadence if checker else watcher_cadence
            period, quiet = cadence(self.timing, readers)
            now = time.monotonic()
            for gr in list(seen):
                if gr not in watch:
                    del seen[gr]
            try:
                counters = self._read_counters(watch)
            except StoreError as exc:
                self._alive_failed(exc)  # logged once per outage
                seen.clear()  # a silence we could not observe is no evidence
                continue
            for gr, cur in zip(watch, counters):
                last = seen.get(gr)
                if last is None or last[0] != cur:
                    seen[gr] = (cur, now)
                elif now - last[1] >= quiet:
                    try:
                        self._declare_dead(gr, alive[gr])
                    except StoreError as exc:
                        log.warning("could not declare node %d dead: %s", gr, exc)
                        continue
                    seen[gr] = (cur, now)

    def _read_counters(self, ranks: list[int]) -> list[bytes | None]:
        """The heartbeat counters of `ranks` (None: not written): one request on the TCP store
        (MULTI_GET; counters are never empty), for the checker's look at every node as for a
        watcher's look at the checker's counter."""
        return self.kv.present([hb_key(gr) for gr in ranks])
