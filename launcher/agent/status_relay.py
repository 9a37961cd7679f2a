"""The agent speaking for its ranks in a recovery round: one status record per node.

Owns: `StatusRelay`. Once the agent carried out a process-level plan (stops sent, replacements
spawned: `plan_executor`), `follow(g, ranks)` starts a thread that waits for the `RankStatus`
of every local rank of the round (`P.status_key`, written by the ranks themselves through the
node's proxy) and posts them together as one `P.NodeStatuses` under
`P.node_statuses_key(g, node)`. The controller waits on one key per node instead of one per
rank (`launcher.control.status_collection`). A newer round's `follow` ends the older one's
thread, `stop()` ends the current one, and each ends by itself after `timeout` s (a rank that
never reports, the store unreachable): a record that is late or never comes costs the round
nothing but time, the controller then reads that node's ranks' own keys.
"""

from __future__ import annotations

import json
import threading
import time

from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from rendezvous.kv import KVStore, StoreError

WAIT_SLICE = 0.5  # s per WAIT: a stop or a newer round is seen within this
READ_TIMEOUT = 5.0  # s: reading keys a WAIT just found


class StatusRelay:
    """One node's relay (owned by its plan executor: `follow`, `stop`)."""

    def __init__(
        self,
        kv: KVStore,
        node: int,
        log: AgentLog,
        timeout: float = 600.0,
        halt: threading.Event | None = None,
    ) -> None:
        self.kv, self.node, self.log, self.timeout = kv, node, log, timeout
        self.halt = halt or threading.Event()  # the agent's own stop (a signal): every relay ends
        self._cancel: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def follow(self, generation: int, ranks: list[int]) -> None:
        """Relay generation `generation`'s statuses of the local `ranks` (ends the previous
        round's relay)."""
        self.stop(join=0.0)
        if not ranks:
            return
        cancel = threading.Event()
        t = threading.Thread(
            target=self._run,
            args=(generation, sorted(ranks), cancel),
            name=f"ftrun-status-relay-g{generation}",
            daemon=True,
        )
        self._cancel, self._thread = cancel, t
        t.start()

    def stop(self, join: float = 1.0) -> None:
        if self._cancel is not None:
            self._cancel.set()
        if self._thread is not None and join > 0:
            self._thread.join(join)

    def _run(self, g: int, ranks: list[int], cancel: threading.Event) -> None:
        keys = [P.status_key(g, r) for r in ranks]
        deadline = time.monotonic() + self.timeout
        while not cancel.is_set() and not self.halt.is_set() and time.monotonic() < deadline:
            try:
                if self.kv.wait(keys, WAIT_SLICE):
                    self._post(g, self.kv.multi_get(keys, READ_TIMEOUT), cancel)
                    return
            except StoreError as e:
                if cancel.is_set():
                    return
                self.log.warning(
                    "status-relay",
                    f"generation {g}: relaying the statuses of ranks {ranks} failed ({e}); "
                    "the controller reads them from the ranks' own keys",
                    generation=g,
                    ranks=ranks,
                )
                return

    def _post(self, g: int, raws: list[bytes], cancel: threading.Event) -> None:
        if cancel.is_set():
            return  # a newer round began meanwhile: this one's record is of no use
        statuses = [json.loads(raw) for raw in raws]
        rec = P.NodeStatuses(generation=g, node=self.node, statuses=statuses)
        self.kv.set(P.node_statuses_key(g, self.node), rec.to_json())
