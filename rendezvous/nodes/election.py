"""Controller election on a store with leases (etcd): who runs the controller, and who takes
over when its node is lost.

Owns: `Election`, one agent's candidacy for the controller role, and `read_controller`.

Protocol (one key, `keys.CONTROLLER_KEY`):
  * a candidate creates the key (create-if-absent; all but the preferred one, group rank 0,
    first wait up to `defer` s for it, so the controller starts where the leader rule puts it)
    bound to its membership lease, with its candidacy record (group rank, incarnation, host,
    nonce) as value; whoever created it is the controller, and `on_elected()` runs once;
  * the key disappears when the controller's lease expires (node crashed or cut off), when it
    is revoked (the agent left) or when it resigns; every other candidate waits for that
    deletion (sliced watches, so `stop()` ends the wait within `waits.SLICE`) and tries again;
    the first create wins;
  * the controller also waits for the key's deletion: if the key goes while it still believes
    it leads (its lease expired while it was cut off), or its membership is lost, it is deposed
    and `on_deposed()` runs once; a deposed candidate does not run again (its agent rejoins as
    a fresh node and starts a new `Election`).
Because the key is lease-bound, a deposed controller can write nothing under its old lease, and
fenced writes (`Liveness.fenced_set`) refuse its other control writes.

There is no election on the embedded store (static/c10d): the controller stays with the leader
rule of `rendezvous.nodes.liveness.roster`, and losing the store host ends the job
(`errors.StoreHostLostError`).

`Election.previous` is the last controller record this candidate saw hold the key (None when it
never saw one): who it took over from, for the log line of a handoff.

Callbacks run on the election thread: keep them short (queue the work).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable

from rendezvous.kv import StoreError
from rendezvous.nodes.keys import CONTROLLER_KEY
from rendezvous.nodes.waits import SLICE

log = logging.getLogger("ftrun.membership")


def read_controller(kv: Any, key: str = CONTROLLER_KEY) -> dict | None:
    """The current controller's candidacy record (group_rank, incarnation, host, nonce), or
    None while there is none."""
    raw = kv.try_get(key)
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


class Election:
    """One candidacy (see module docstring). `start()` campaigns on a thread; `stop()` ends it
    (resigning when elected)."""

    def __init__(
        self,
        kv: Any,
        lease: Any,
        candidate: dict,
        lost: threading.Event,
        on_elected: Callable[[], None],
        on_deposed: Callable[[], None],
        key: str = CONTROLLER_KEY,
        defer: float = 0.0,
    ) -> None:
        if lease is None:
            raise ValueError("an election needs the membership lease (join() first)")
        self.kv = kv
        self.lease = lease
        self.key = key
        self.value = json.dumps(candidate, sort_keys=True).encode()
        self.candidate = candidate
        self._lost = lost
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._stop = threading.Event()
        self._leading = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self.previous: dict | None = None  # the last other controller seen (see module doc)
        self._defer = max(0.0, float(defer))  # first campaign only: let the preferred win

    @property
    def leading(self) -> bool:
        """True while this candidate is the controller."""
        return self._leading.is_set()

    def start(self) -> "Election":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ftrun-election", daemon=True)
            self._thread.start()
        return self

    def stop(self, resign: bool = True) -> None:
        """End the candidacy; when elected and `resign`, delete the key so another candidate
        takes over at once. Idempotent."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2 * SLICE + 1.0)
        if resign and self._leading.is_set():
            self._leading.clear()
            try:
                self.kv.delete_if(self.key, self.value)
            except StoreError as exc:
                log.warning("could not resign as controller: %s", exc)

    # ------------------------------------------------------------------------------ internals

    def _run(self) -> None:
        self._wait_for_preferred()
        while not self._stop.is_set():
            if self._lost.is_set():
                self._depose("this agent lost its membership")
                return
            try:
                if not self._leading.is_set():
                    self._campaign()
                elif self.kv.wait_deleted(self.key, SLICE):
                    self._depose("the controller key vanished (its lease expired)")
                    return
                self._failing = False
            except StoreError as exc:
                if not self._failing:
                    self._failing = True
                    log.warning("controller election: store call failed (will retry): %s", exc)
                self._stop.wait(SLICE)

    def _wait_for_preferred(self) -> None:
        """Before the first campaign, up to `defer` s for another candidate to be elected (the
        preferred one, group rank 0, runs at once), in slices so stop() ends it."""
        end = time.monotonic() + self._defer
        while not self._stop.is_set() and time.monotonic() < end:
            try:
                if self.kv.wait([self.key], min(SLICE, max(0.0, end - time.monotonic()))):
                    return
            except StoreError:
                return

    def _campaign(self) -> None:
        if self.kv.create(self.key, self.value, self.lease):
            self._leading.set()
            log.debug("node %s is the controller now (elected)", self.candidate.get("group_rank"))
            self._call(self._on_elected)
            return
        holder = read_controller(self.kv, self.key)
        if holder is not None and holder.get("nonce") != self.candidate.get("nonce"):
            self.previous = holder
        self.kv.wait_deleted(self.key, SLICE)

    def _depose(self, why: str) -> None:
        if self._leading.is_set():
            self._leading.clear()
            log.error(
                "node %s is no longer the controller: %s", self.candidate.get("group_rank"), why
            )
            self._call(self._on_deposed)

    @staticmethod
    def _call(cb: Callable[[], None]) -> None:
        try:
            cb()
        except Exception:  # a failing callback must not stop the election
            log.exception("election callback %r failed", cb)
