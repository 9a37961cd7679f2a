"""Interruptible waits for the rendezvous code: every blocking wait ends on a stop request.

Owns: `Interrupt` (a stop request that can be set from any thread or a signal handler, and can
follow an external `threading.Event`), and the sliced waits built on it: `wait_keys` (store keys
appear), `sleep` and `check`. A store wait is cut into slices of at most `SLICE` seconds so a
stop request ends it within one slice, whatever the store (a TCPStore WAIT cannot be woken from
outside; an etcd watch could, but one rule for every store is simpler).
"""

from __future__ import annotations

import threading
import time
from typing import Iterable

from rendezvous.errors import JoinInterrupted
from rendezvous.kv import KVStore

SLICE = 0.25  # seconds: longest a stop request waits for a blocking store call to return


class Interrupt:
    """A stop request for blocking waits. `set()` is safe in a signal handler (no I/O)."""

    def __init__(self) -> None:
        self._own = threading.Event()
        self._external: threading.Event | None = None

    def follow(self, event: threading.Event | None) -> None:
        """Also count `event` (e.g. the agent's shutdown event) as a stop request."""
        self._external = event

    def set(self) -> None:
        self._own.set()

    def is_set(self) -> bool:
        ext = self._external
        return self._own.is_set() or (ext is not None and ext.is_set())

    def check(self, what: str) -> None:
        """Raise JoinInterrupted if a stop was requested."""
        if self.is_set():
            raise JoinInterrupted(f"{what}: interrupted (stop requested)")

    def sleep(self, seconds: float) -> bool:
        """Sleep up to `seconds`; False (early) when a stop was requested."""
        end = time.monotonic() + max(0.0, seconds)
        while True:
            if self.is_set():
                return False
            left = end - time.monotonic()
            if left <= 0:
                return True
            self._own.wait(min(left, SLICE / 2))


def wait_keys(
    kv: KVStore, keys: Iterable[str], deadline: float, stop: Interrupt, what: str
) -> bool:
    """Wait until every key exists (True) or `deadline` (monotonic) passes (False). Raises
    JoinInterrupted within one slice of a stop request."""
    keys = list(keys)
    while True:
        stop.check(what)
        left = deadline - time.monotonic()
        if kv.wait(keys, max(0.0, min(SLICE, left))):
            return True
        if left <= SLICE:
            stop.check(what)
            return False
