"""The store calls of the agent's event loop, made off it.

Owns: `LoopStore`, one thread that makes the store writes the agent's loop asks for, and
`Call`, a store call on its own thread that the loop waits for only as long as it chooses. A
store that does not answer (this node cut off: a call then blocks until read_timeout, 60 s by
default, or etcd's request_timeout) must never hold up the loop, because the loop is what
self-fences when the membership is lost (it must kill its workers within the liveness timeout
+ 1 s). So the loop hands its writes here and goes on:
  * `put(key, value)`: the latest value per key is written (a newer progress record replaces
    one not written yet); retried while the store does not answer, dropped at `stop()`;
  * `add(key, amount, then)`: a counter, in order, once (an add is not idempotent: a failed one
    is logged, not retried); `then(new_value)` runs on this thread (e.g. the restart barrier's
    "all stopped" key);
and reads the loop needs go through `Call.start(fn)` + `wait(timeout)` (at most one call per
purpose in flight: the caller keeps it until it ends). Fault reports have their own thread
(`launcher.agent.fault_reports`), with staleness checks.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

from launcher.observe.logs import AgentLog
from rendezvous.kv import KVStore, StoreError

RETRY = 0.2  # s between attempts of a put while the store does not answer


class Call:
    """`fn()` on its own daemon thread; `wait(timeout)` -> True once it ended (`value` or
    `error` set)."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._fn = fn
        threading.Thread(target=self._run, name=f"ftrun-call-{name}", daemon=True).start()

    @classmethod
    def start(cls, fn: Callable[[], Any], name: str = "store") -> "Call":
        return cls(fn, name)

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _run(self) -> None:
        try:
            self.value = self._fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            self.error = e
        finally:
            self._done.set()


class LoopStore:
    """See the module docstring. `stop()` ends the thread (unwritten puts are dropped)."""

    def __init__(self, kv: KVStore, log: AgentLog) -> None:
        self.kv = kv
        self.log = log
        self._cv = threading.Condition()
        self._latest: dict[str, bytes] = {}  # put: key -> newest value not written yet
        self._order: collections.deque[tuple[str, Any]] = collections.deque()
        self._busy = False
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="ftrun-loop-store", daemon=True)
        self._thread.start()

    def put(self, key: str, value: bytes) -> None:
        with self._cv:
            if key not in self._latest:
                self._order.append(("put", key))
            self._latest[key] = value
            self._cv.notify()

    def add(self, key: str, amount: int, then: Callable[[int], None] | None = None) -> None:
        with self._cv:
            self._order.append(("add", (key, amount, then)))
            self._cv.notify()

    def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` s until everything queued was written (or failed)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._order and not self._busy, timeout)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(2.0)

    # ------------------------------------------------------------------------------ internals
    def _run(self) -> None:
        while True:
            with self._cv:
                self._busy = False
                self._cv.notify_all()
                self._cv.wait_for(lambda: self._order or self._stopped)
                if self._stopped:
                    return
                kind, arg = self._order.popleft()
                value = self._latest.pop(arg) if kind == "put" else None
                self._busy = True
            if kind == "put":
                self._put(arg, value)
            else:
                self._add(*arg)

    def _put(self, key: str, value: bytes | None) -> None:
        failing = False
        while value is not None:
            try:
                self.kv.set(key, value)
                return
            except StoreError as e:
                if not failing:
                    failing = True
                    self.log.warning(
                        "store-write-retry",
                        f"store write of {key} not done yet ({e}); retrying off the agent's loop",
                        key=key,
                    )
            with self._cv:
                if self._stopped:
                    return
                if key in self._latest:  # a newer value came meanwhile: that one is written
                    return
                self._cv.wait(RETRY)

    def _add(self, key: str, amount: int, then: Callable[[int], None] | None) -> None:
        try:
            n = self.kv.add(key, amount)
            if then is not None:
                then(n)
        except StoreError as e:
            self.log.error("store-write-failed", f"store counter {key} not updated: {e}", key=key)
