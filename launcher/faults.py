"""Fault kinds and the escalation policy: which strategy of the chain handles which fault.

Owns: `FaultKind` (the fault taxonomy shared by agents, controller and runtime) and
`pick_strategy()`, the pure function that walks the user's strategy chain (cheapest first) and
returns the first strategy able to handle a fault, with the reason for every strategy skipped.
"""
from __future__ import annotations

import enum

from launcher import plan as P


class FaultKind(str, enum.Enum):
    EXIT = "exit"  # process exited with a non-zero code
    SIGNAL = "signal"  # process killed by a signal
    HANG = "hang"  # no progress for --hang-timeout
    UCE_LOW = "uce-low"  # uncorrectable memory error, memory reusable: repair in place
    UCE_HIGH = "uce-high"  # uncorrectable memory error, state objects must be rebuilt
    NETWORK = "network"  # collective/link error, retryable
    UNSAFE_DATA = "unsafe-data"  # access to data marked unsafe after a fault
    EXCEPTION = "exception"  # any other exception reported by the runtime
    UNKNOWN = "unknown"


# Faults after which the process itself is healthy and can stay (no restart needed).
IN_PLACE_KINDS = {FaultKind.UCE_LOW, FaultKind.UCE_HIGH, FaultKind.NETWORK, FaultKind.UNSAFE_DATA}


def can_handle(strategy: str, kind: FaultKind, runtime_aware: bool) -> tuple[bool, str]:
    """Whether `strategy` can handle `kind`; the reason when it cannot."""
    if strategy == P.RETRY:
        if not runtime_aware:
            return False, "retry needs every rank to use launcher.runtime"
        if kind not in IN_PLACE_KINDS:
            return False, f"retry handles {', '.join(sorted(k.value for k in IN_PLACE_KINDS))}, not {kind.value}"
        return True, "process stays alive; state repaired in place"
    if strategy == P.RECOVER_IN_PLACE:
        if not runtime_aware:
            return False, "recover-in-place needs every rank to use launcher.runtime"
        return True, "restart only the failed rank and repair it from a replica"
    if strategy == P.RESTART_ALL:
        return True, "restart every worker (from the last checkpoint)"
    if strategy == P.DUMP:
        if not runtime_aware:
            return False, "dump needs every rank to use launcher.runtime"
        return True, "survivors save the current step, then the job exits"
    if strategy == P.EXIT:
        return True, "stop the job"
    return False, f"unknown strategy {strategy}"


def pick_strategy(kind: FaultKind, chain: list[str], runtime_aware: bool,
                  budget_left: bool, repeat_uce: bool = False) -> tuple[str, str]:
    """Walk `chain` and return (strategy, one-line reason, naming every skipped strategy).

    `repeat_uce`: the device had a second UCE within 24 h, so it is not retried in place."""
    skipped: list[str] = []
    if repeat_uce and P.RETRY in chain:
        chain = [s for s in chain if s != P.RETRY]
        skipped.append("retry: second UCE on this device within 24 h")
    if not runtime_aware:
        # Unmodified scripts: process-level strategies do not apply (torchrun semantics).
        chain = [s for s in chain if s in (P.RESTART_ALL, P.EXIT)]
        skipped.append("workers do not use launcher.runtime")
    for s in chain:
        if s in (P.RETRY, P.RECOVER_IN_PLACE, P.RESTART_ALL) and not budget_left:
            skipped.append(f"{s}: restart budget spent")
            continue
        ok, why = can_handle(s, kind, runtime_aware)
        if ok:
            return s, "; ".join(skipped + [why]) if skipped else why
        skipped.append(f"{s}: {why}")
    return P.EXIT, "; ".join(skipped + ["nothing else left: exit"])
