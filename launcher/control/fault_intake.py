"""The controller's intake of fault reports: in order, from live writers, one event one fault.

Owns: `post_fault` (an agent, or the controller itself, reports a fault: the next number of
`P.FAULT_SEQ`) and `FaultIntake`, the controller's reading side: the next report in order (the
next number to read is kept in the store, `P.FAULT_NEXT_KEY`, so a controller elected later goes
on from it); a report stamped by an agent that is no longer a member (`Fault.by_node` /
`by_incarnation`, asked of `ControllerHooks.stale`) is refused (logged `stale-write-refused`,
nothing decided); a report that may be a consequence of another rank's fault
(`decision.may_be_consequence`) is held up to the fault window, and the window's reports and
every node's progress records (`launcher.control.progress`) become one fault
(`decision.merge`, logged `fault-merged`).
"""

from __future__ import annotations

import time

from launcher.control.controller_settings import ControllerHooks, ControllerSettings
from launcher.control.controller_state import ControllerState
from launcher.control.decision import covered_by, culprit, may_be_consequence, merge
from launcher.control.progress import read_progress
from launcher.control.round_phase import RoundTracker
from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from rendezvous.kv import KVStore


def post_fault(kv: KVStore, fault: P.Fault) -> int:
    """Agents report a fault to the controller; returns its sequence number."""
    seq = kv.add(P.FAULT_SEQ, 1)
    kv.set(P.fault_key(seq), fault.to_json())
    return seq


class FaultIntake:
    def __init__(
        self,
        kv: KVStore,
        log: AgentLog,
        settings: ControllerSettings,
        hooks: ControllerHooks,
        state: ControllerState,
        rounds: RoundTracker,
    ) -> None:
        self.kv, self.log, self.settings, self.hooks = kv, log, settings, hooks
        self.state = state  # next_fault: the next report to read
        self.rounds = rounds  # the round in progress covers some late reports

    def next_report(self, timeout: float) -> P.Fault | None:
        """The next reported fault (consumed), waiting up to `timeout` s for it; None when none
        came or its writer is stale."""
        key = P.fault_key(self.state.next_fault)
        # the wait's wake-up carries the report (`KVStore.wait_values`: one request on
        # ftrun's store, etcd's watch event; elsewhere the wait, then one read of what it found)
        if timeout <= 0:
            raw = self.kv.try_get(key)
        else:
            got = self.kv.wait_values([key], timeout)
            raw = got[0] if got else None
        if not raw:
            return None
        seq = self.state.next_fault
        self.state.next_fault += 1
        self.kv.set(P.FAULT_NEXT_KEY, str(self.state.next_fault).encode())
        fault = P.Fault.from_json(raw)
        stale = self.hooks.stale
        why = (
            stale(fault.by_node, fault.by_incarnation)
            if (stale is not None and fault.by_node is not None and fault.by_incarnation)
            else ""
        )
        if why:
            self._refuse(seq, fault, why)
            return None
        return fault

    def _refuse(self, seq: int, fault: P.Fault, why: str) -> None:
        self.log.error(
            "stale-write-refused",
            f"fault #{seq} of rank {fault.rank} from node "
            f"{fault.by_node} (incarnation {fault.by_incarnation}, generation "
            f"{fault.generation}) refused: the writer is stale ({why}); the job is "
            f"at generation {self.state.generation}",
            rank=fault.rank,
            stale_node=fault.by_node,
            incarnation=fault.by_incarnation,
            stale_generation=fault.generation,
            seq=seq,
            where="controller",
        )

    def take(self, timeout: float) -> P.Fault | None:
        """The next fault to decide about: a report that may be a consequence is held for the
        window and merged with what else arrives (see the module docstring)."""
        fault = self.next_report(timeout)
        if fault is None or not may_be_consequence(fault) or covered_by(fault, self.rounds.round):
            return fault
        batch = [fault]
        deadline = time.monotonic() + self.settings.window
        while True:
            progress = read_progress(self.kv, self.settings.nnodes)
            reporters = sorted({f.rank for f in batch if f.rank is not None})
            if (
                not all(may_be_consequence(f) for f in batch)
                or culprit(batch, progress)
                or len(reporters) >= self.settings.world_size
                or time.monotonic() >= deadline
            ):
                break
            more = self.next_report(min(0.2, max(0.0, deadline - time.monotonic())))
            if more is not None:
                batch.append(more)
        merged = merge(batch, progress)
        if len(batch) > 1 or merged.rank != fault.rank or merged.kind != fault.kind:
            self.log.warning(
                "fault-merged",
                f"{len(batch)} report(s) from ranks {reporters} are one "
                f"fault: rank {merged.rank} {merged.kind} ({merged.message})",
                rank=merged.rank,
                fault_kind=merged.kind,
                reporters=reporters,
                reports=len(batch),
            )
        return merged
