"""The agent speaking for its ranks in a recovery round: one status record per node.

Owns: `StatusRelay`. Once the agent carried out a process-level plan (stops sent, replacements
spawned: `plan_executor`), `follow(g, ranks)` starts a thread that waits for the `RankStatus`
of every local rank of the round (`P.status_key`, written by the ranks themselves through the
node's proxy) and posts them together as one `P.NodeStatuses` under
`P.node_statuses_key(g, node)`. The controller waits on one key per node instead of one per
rank (`launcher.control.status_collection`). A newer round's `follow` ends the older one's
relay, `stop()` ends the current one, and each ends by itself after `timeout` s (a rank that
never reports, the store unreachable): a record that is late or never comes costs the round
nothing but time, the controller then reads that node's ranks' own keys. One thread serves
every round; it ends with the agent's halt, or after `IDLE_S` s without a round.
"""

from __future__ import annotations

import json
import threading
import time

from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from rendezvous.kv import KVStore, StoreError

WAIT_SLICE = 0.5  # s per WAIT: a stop or a newer round is seen within this
# ... within FAST_SLICE for a round's first FAST_FOR s: a rank killed during a round leaves
# that round's keys incomplete, and the newer round's record must not wait out the slice
FAST_SLICE, FAST_FOR = 0.02, 1.0
READ_TIMEOUT = 5.0  # s: reading keys a WAIT just found
IDLE_S = 600.0  # s without a round after which the relay's thread ends (the next round starts one)


class StatusRelay:
    """One node's relay (owned by its plan executor: `follow`, `stop`; the agent's `halt`
    ends it). One thread for every round, not one per round: the store client keeps one
    connection per thread, and a thread per round would open one per round and node."""

    def __init__(
        self,
        kv: KVStore,
        node: int,
        log: AgentLog,
        timeout: float = 600.0,
        halt: threading.Event | None = None,
        idle: float = IDLE_S,
    ) -> None:
        self.kv, self.node, self.log, self.timeout, self.idle = kv, node, log, timeout, idle
        self.halt = halt or threading.Event()  # the agent's own stop (a signal): every relay ends
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._target: tuple[int, list[int], int] | None = None  # generation, ranks, serial
        self._serial = 0  # changes with every follow and stop: a round in hand is stale then
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def follow(self, generation: int, ranks: list[int]) -> None:
        """Relay generation `generation`'s statuses of the local `ranks` (ends the previous
        round's relay)."""
        with self._lock:
            self._serial += 1
            self._target = (generation, sorted(ranks), self._serial) if ranks else None
            if self._target is not None and not self.running:
                self._thread = threading.Thread(
                    target=self._run, name=f"ftrun-status-relay-{self.node}", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def stop(self, join: float = 0.0) -> None:
        """End the current round's relay (the thread waits for the next round, or ends after
        `idle` s); with `join` > 0 the thread is ended too (the agent's halt must be set)."""
        with self._lock:
            self._serial += 1
            self._target = None
        self._wake.set()
        t = self._thread
        if join > 0 and t is not None and self.halt.is_set():
            t.join(join)

    def _stale(self, serial: int) -> bool:
        return self.halt.is_set() or self._serial != serial

    def _run(self) -> None:
        while not self.halt.is_set():
            self._wake.clear()
            with self._lock:
                target = self._target
            if target is None:
                if not self._wake.wait(self.idle):
                    with self._lock:
                        if self._target is None:  # idle: ends; the next follow starts another
                            self._thread = None
                            self.kv.release_thread()  # its store connection goes with it
                            return
                continue
            self._relay(*target)
            with self._lock:
                if self._target is target:
                    self._target = None

    def _relay(self, g: int, ranks: list[int], serial: int) -> None:
        keys = [P.status_key(g, r) for r in ranks]
        start = time.monotonic()
        deadline = start + self.timeout
        while not self._stale(serial) and time.monotonic() < deadline:
            fast = time.monotonic() - start < FAST_FOR
            try:
                if self.kv.wait(keys, FAST_SLICE if fast else WAIT_SLICE):
                    self._post(g, self._read_found(keys), serial)
                    return
            except StoreError as e:
                if self._stale(serial):
                    return
                self.log.warning(
                    "status-relay",
                    f"generation {g}: relaying the statuses of ranks {ranks} failed ({e}); "
                    "the controller reads them from the ranks' own keys",
                    generation=g,
                    ranks=ranks,
                )
                return

    def _read_found(self, keys: list[str]) -> list[bytes]:
        """The statuses a wait just found, in one request (a `multi_get` would wait for them
        again first: one more round trip through the node's proxy on the round's path); a
        status gone meanwhile is waited for as before."""
        raws = self.kv.present(keys)
        if any(raw is None for raw in raws):
            return self.kv.multi_get(keys, READ_TIMEOUT)
        return [raw for raw in raws if raw is not None]

    def _post(self, g: int, raws: list[bytes], serial: int) -> None:
        if self._stale(serial):
            return  # a newer round began meanwhile: this one's record is of no use
        statuses = [json.loads(raw) for raw in raws]
        rec = P.NodeStatuses(generation=g, node=self.node, statuses=statuses)
        self.kv.set(P.node_statuses_key(g, self.node), rec.to_json())
