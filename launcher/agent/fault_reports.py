"""Fault reports from this agent to the controller, posted off the agent's event loop.

Owns: `FaultReporter`, one queue and one thread that posts each `Fault` to the store in order,
stamped with the reporting agent's node and incarnation (`Fault.by_node`, `by_incarnation`:
the identity that observed the fault). While the store does not answer, a report is retried;
before each attempt the agent's membership is checked, and a report of an agent that is stale
(cut off longer than the liveness timeout, declared dead, replaced, or rejoined since as a newer
incarnation) is refused and logged (`stale-write-refused`) instead of reaching the job's newer
generation. A post already in flight when the agent is fenced lands late; the controller
refuses it by its stamp (`launcher.control.controller`). The loop never waits for the store
here, so a report made while the node is cut off cannot hold up its self-fencing.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from rendezvous.errors import FencedError
from rendezvous.kv import KVStore, StoreError

RETRY = 0.2  # s between attempts while the store does not answer


class FaultReporter:
    """`report(fault)` from any thread; `stop()` ends the thread (pending reports are dropped,
    with one line)."""

    def __init__(
        self,
        kv: KVStore,
        log: AgentLog,
        me: Callable[[], tuple[int | None, int]],
        check: Callable[[str], None],
    ) -> None:
        self.kv = kv
        self.log = log
        self._me = me  # (group rank, incarnation) of this agent now
        self._check = check  # raises FencedError when this agent may not write
        self._q: "queue.SimpleQueue[P.Fault | None]" = queue.SimpleQueue()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="ftrun-fault-reports", daemon=True)
        self._thread.start()

    def report(self, fault: P.Fault) -> None:
        """Queue `fault`, stamped with who reports it (this agent's identity now)."""
        node, inc = self._me()
        if fault.by_node is None:
            fault.by_node, fault.by_incarnation = node, inc
        self._idle.clear()
        self._q.put(fault)

    def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` s until every queued report was posted or refused."""
        return self._idle.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        self._q.put(None)
        self._thread.join(2.0)

    # ------------------------------------------------------------------------------ internals
    def _run(self) -> None:
        while not self._stop.is_set():
            fault = self._q.get()
            if fault is None:
                return
            self._post(fault)
            if self._q.empty():
                self._idle.set()

    def _post(self, fault: P.Fault) -> None:
        seq: int | None = None
        failing = False
        while not self._stop.is_set():
            try:
                if seq is None:  # once a number is taken its key must be written (no hole)
                    why = self._stale(fault)
                    if why:
                        self._refuse(fault, why)
                        return
                    seq = self.kv.add(P.FAULT_SEQ, 1)
                self.kv.set(P.fault_key(seq), fault.to_json())
            except StoreError as exc:
                if not failing:
                    failing = True
                    self.log.warning(
                        "fault-report-retry",
                        f"cannot report the fault of rank "
                        f"{fault.rank} yet (store: {exc}); retrying",
                        rank=fault.rank,
                    )
                self._stop.wait(RETRY)
                continue
            self.log.info(
                "fault-reported",
                f"fault #{seq} reported to the controller",
                seq=seq,
                rank=fault.rank,
            )
            return
        self.log.warning(
            "fault-report-dropped",
            f"the fault of rank {fault.rank} was not reported: the agent is stopping",
            rank=fault.rank,
        )

    def _stale(self, fault: P.Fault) -> str:
        node, inc = self._me()
        if fault.by_incarnation and inc != fault.by_incarnation:
            return (
                f"it was observed by incarnation {fault.by_incarnation}; this agent is "
                f"incarnation {inc} now"
            )
        try:
            self._check(P.FAULT_SEQ)
        except FencedError as exc:
            return str(exc)
        return ""

    def _refuse(self, fault: P.Fault, why: str) -> None:
        self.log.error(
            "stale-write-refused",
            f"fault report of rank {fault.rank} (node "
            f"{fault.by_node}, incarnation {fault.by_incarnation}, generation "
            f"{fault.generation}) refused: this node is stale ({why})",
            rank=fault.rank,
            stale_node=fault.by_node,
            incarnation=fault.by_incarnation,
            stale_generation=fault.generation,
            where="agent",
        )
