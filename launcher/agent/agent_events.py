"""What the agent's event loop reacts to, and the threads that feed it from the store.

Owns: the event types that are not someone else's (`PlanEvent`, `InjectEvent`, `SignalEvent`; worker
exits are `launcher.workers.workers.WorkerExit`, worker messages
`launcher.workers.channel.ChannelMessage`) and `KeyFeed`, a thread that follows a numbered sequence
of store keys (the controller's plans, `ftctl inject` requests) and puts one event per key on the
agent's queue. Each feed is owned by the agent: `start()`, `stop()`.

A feed costs the store one FT_WAIT_VALUES per key it delivers on ftrun's TCP store (the
wake-up carries the value; `KVStore.wait_values`: elsewhere a WAIT and one read), plus a wait
and its CANCEL_WAIT per wait that runs out: on a store whose waits `stop()` can interrupt (the
TCP store) a wait lasts `LONG_WAIT` s (0.4 requests a second per idle feed), elsewhere
`SHORT_WAIT` s (stop() must not block longer). A key's value reaches the queue as soon as it
is written either way.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from launcher.protocol import plan as P
from rendezvous.kv import KVStore, StoreError

LONG_WAIT = 5.0  # s a feed's wait lasts when stop() can interrupt it
SHORT_WAIT = 0.5  # s otherwise (stop() joins within it)


@dataclass
class PlanEvent:
    plan: P.Plan


@dataclass
class InjectEvent:
    injection: P.Injection


@dataclass
class SignalEvent:
    signum: int


class KeyFeed:
    """Waits for key_of(n), key_of(n + 1), ... in turn; each value becomes make(value) on
    `events`."""

    def __init__(
        self,
        name: str,
        kv: KVStore,
        key_of: Callable[[int], str],
        first: int,
        make: Callable[[bytes], object],
        events: "queue.Queue[object]",
    ) -> None:
        self._kv = kv
        self._key_of = key_of
        self._next = first
        self._make = make
        self._events = events
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.wait_s = LONG_WAIT if kv.interruptible_waits else SHORT_WAIT

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._kv.interrupt_waits(self._thread)
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            key = self._key_of(self._next)
            try:
                # one request where the store carries the value in the wake-up, else a wait
                # and one read of the value it found
                got = self._kv.wait_values([key], self.wait_s)
                if got is not None:
                    value = got[0]
                    if not value:
                        continue
                    if self._stop.is_set():
                        # stop() may have given up joining while a call was blocked (the store
                        # unreachable): what it returns now belongs to a world this agent left
                        return
                    self._events.put(self._make(value))
                    self._next += 1
            except StoreError:
                if self._stop.is_set():
                    return
                time.sleep(0.2)


def plan_feed(kv: KVStore, after: int, events: "queue.Queue[object]") -> KeyFeed:
    """The controller's plans for generations after `after`."""
    return KeyFeed(
        "ftrun-plans",
        kv,
        P.plan_key,
        after + 1,
        lambda raw: PlanEvent(P.Plan.from_json(raw)),
        events,
    )


def inject_feed(kv: KVStore, events: "queue.Queue[object]") -> KeyFeed:
    """`ftctl inject` requests made from now on (earlier ones are not replayed)."""
    raw = kv.try_get(P.INJECT_SEQ)
    first = int(raw) + 1 if raw is not None else 1
    return KeyFeed(
        "ftrun-inject",
        kv,
        P.inject_key,
        first,
        lambda raw: InjectEvent(P.Injection.from_json(raw)),
        events,
    )
