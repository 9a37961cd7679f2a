"""In-worker fault injection for tests (`FTRUN_FAULT_PLAN`).

Owns: parsing the plan (a JSON list of {"rank","step","phase","kind","generation"}) and firing
each entry once when the runtime reaches the matching (generation, rank, step, phase). Process
faults are real (SIGKILL, SIGSEGV, os._exit, an un-interruptible hang); device faults
(uce-low, uce-high, network, unsafe-data) and "exception" are raised as `InjectedFault` and go
through the device adapter's classification like real ones. Every firing is logged as injected.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from launcher.runtime.devices import (EXCEPTION, NETWORK, UCE_HIGH, UCE_LOW, UNSAFE_DATA,
                                      InjectedFault)

PHASES = ("forward", "backward", "optimizer")
PROCESS_KINDS = ("kill", "segv", "exit", "hang")
RAISED_KINDS = (EXCEPTION, UCE_LOW, UCE_HIGH, NETWORK, UNSAFE_DATA)
KINDS = PROCESS_KINDS + RAISED_KINDS


@dataclass
class FaultSpec:
    rank: int
    step: int
    phase: str
    kind: str
    generation: int = 0
    fired: bool = field(default=False, compare=False)


def parse_plan(raw: str | None) -> list[FaultSpec]:
    if not raw:
        return []
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"FTRUN_FAULT_PLAN is not valid JSON: {exc}") from None
    if not isinstance(data, list):
        raise ValueError(f"FTRUN_FAULT_PLAN must be a JSON list, got {type(data).__name__}")
    out = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise ValueError(f"FTRUN_FAULT_PLAN[{i}] must be an object, got {item!r}")
        unknown = set(item) - {"rank", "step", "phase", "kind", "generation"}
        if unknown:
            raise ValueError(f"FTRUN_FAULT_PLAN[{i}] has unknown keys {sorted(unknown)}; "
                             "allowed: rank, step, phase, kind, generation")
        try:
            spec = FaultSpec(rank=int(item["rank"]), step=int(item["step"]), phase=str(item["phase"]),
                             kind=str(item["kind"]), generation=int(item.get("generation", 0)))
        except KeyError as exc:
            raise ValueError(f"FTRUN_FAULT_PLAN[{i}] lacks {exc.args[0]!r}") from None
        if spec.phase not in PHASES:
            raise ValueError(f"FTRUN_FAULT_PLAN[{i}] phase={spec.phase!r}; allowed: {', '.join(PHASES)}")
        if spec.kind not in KINDS:
            raise ValueError(f"FTRUN_FAULT_PLAN[{i}] kind={spec.kind!r}; allowed: {', '.join(KINDS)}")
        out.append(spec)
    return out


class FaultInjector:
    """Fires matching plan entries; `report` is called before a raised fault propagates."""

    def __init__(self, specs: list[FaultSpec], rank: int, log: Callable[[str], None]) -> None:
        self._specs = [s for s in specs if s.rank == rank]
        self._log = log

    def maybe_fire(self, generation: int, step: int, phase: str) -> None:
        for spec in self._specs:
            if spec.fired or (spec.generation, spec.step, spec.phase) != (generation, step, phase):
                continue
            spec.fired = True
            self._fire(spec)

    def _fire(self, spec: FaultSpec) -> None:
        where = f"step {spec.step} {spec.phase}"
        self._log(f"INJECTED fault kind={spec.kind} at {where}")
        sys.stdout.flush()
        sys.stderr.flush()
        if spec.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # the signal is delivered before this returns
        elif spec.kind == "segv":
            signal.signal(signal.SIGSEGV, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGSEGV)
            time.sleep(60)
        elif spec.kind == "exit":
            os._exit(3)
        elif spec.kind == "hang":
            while True:  # deliberately deaf to stop requests: only a kill ends it
                time.sleep(3600)
        else:
            raise InjectedFault(spec.kind, f"injected {spec.kind} fault at {where}")
