"""In-worker fault injection: `FTRUN_FAULT_PLAN` (tests) and `ftctl inject` (live jobs).

Owns: parsing the plan (a JSON list of {"rank","step","phase","kind","generation"}), arming
injections the agent forwards from `ftctl inject` ({"op":"inject","kind","step","phase"} on the
agent channel, any thread), and firing each entry once when the runtime reaches the matching
(generation, rank, step, phase). A forwarded injection matches any generation; without a step it
fires at the next phase edge ("now"). Process faults are real (SIGKILL, SIGSEGV, os._exit, an
un-interruptible hang, and stuck-wait: the same hang reported to the agent as a wait inside a
collective, as a wait in C++ that a stop failed to break looks); device faults (uce-low,
uce-high, network, unsafe-data) and "exception" are raised as `InjectedFault` and go through the
device adapter's classification like real ones. Every arming and firing is logged as injected.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from launcher.protocol.faults import INJECTION_KINDS as KINDS
from launcher.runtime.devices import InjectedFault

PHASES = ("forward", "backward", "optimizer", "transfer", "rebuild")  # transfer: a sender, midway
# through sending its state (or stripe) in a repair round; rebuild: a rank of a repair round that
# has the round's plan, just before it builds the round's groups; for both step = the resume
# step, generation = the round's


@dataclass
class FaultSpec:
    rank: int
    step: int | None  # None: the next phase edge
    phase: str | None  # None: any phase
    kind: str
    generation: int | None = 0  # None: any generation
    fired: bool = field(default=False, compare=False)

    def matches(self, generation: int, step: int, phase: str) -> bool:
        return (
            (self.generation is None or self.generation == generation)
            and (self.step is None or self.step == step)
            and (self.phase is None or self.phase == phase)
        )

    def where(self) -> str:
        if self.step is None:
            return "the next phase edge"
        return f"step {self.step} {self.phase or 'any phase'}"


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
            raise ValueError(
                f"FTRUN_FAULT_PLAN[{i}] has unknown keys {sorted(unknown)}; "
                "allowed: rank, step, phase, kind, generation"
            )
        try:
            spec = FaultSpec(
                rank=int(item["rank"]),
                step=int(item["step"]),
                phase=str(item["phase"]),
                kind=str(item["kind"]),
                generation=int(item.get("generation", 0)),
            )
        except KeyError as exc:
            raise ValueError(f"FTRUN_FAULT_PLAN[{i}] lacks {exc.args[0]!r}") from None
        if spec.phase not in PHASES:
            raise ValueError(
                f"FTRUN_FAULT_PLAN[{i}] phase={spec.phase!r}; allowed: {', '.join(PHASES)}"
            )
        if spec.kind not in KINDS:
            raise ValueError(
                f"FTRUN_FAULT_PLAN[{i}] kind={spec.kind!r}; allowed: {', '.join(KINDS)}"
            )
        out.append(spec)
    return out


def parse_injection(msg: dict, rank: int) -> FaultSpec:
    """The agent's {"op":"inject","kind","step","phase"} as a spec for this rank (any
    generation)."""
    kind, step, phase = msg.get("kind"), msg.get("step"), msg.get("phase")
    if kind not in KINDS:
        raise ValueError(f"inject kind={kind!r}; allowed: {', '.join(KINDS)}")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise ValueError(f"inject step={step!r}; allowed: a step number >= 0 or null")
    if phase is not None and phase not in PHASES:
        raise ValueError(f"inject phase={phase!r}; allowed: {', '.join(PHASES)} or null")
    if step is not None and phase is None:
        phase = "forward"
    return FaultSpec(
        rank=rank, step=step, phase=phase if step is not None else None, kind=kind, generation=None
    )


class FaultInjector:
    """Fires matching entries at phase edges (training thread); `arm` may be called from any
    thread (the agent channel's reader)."""

    def __init__(
        self,
        specs: list[FaultSpec],
        rank: int,
        log: Callable[[str], None],
        waiting: Callable[[bool], None] | None = None,
    ) -> None:
        self._rank = rank
        self._waiting = waiting or (lambda busy: None)  # tells the agent the rank waits on peers
        self._lock = threading.Lock()
        self._specs = [s for s in specs if s.rank == rank]
        self.armed = bool(self._specs)  # read at every phase edge: anything to fire at all?
        self._log = log

    def arm(self, msg: dict) -> None:
        """Arm an injection forwarded by the agent (`ftctl inject`). kill and segv without a step
        fire at once (real signals, from this thread); everything else at its phase edge."""
        try:
            spec = parse_injection(msg, self._rank)
        except ValueError as exc:
            self._log(f"ignored injection from the agent: {exc}")
            return
        if spec.step is None and spec.kind in ("kill", "segv"):
            self._fire(spec)
            return
        self._log(f"INJECTED fault kind={spec.kind} armed by ftctl inject: fires at {spec.where()}")
        with self._lock:
            self._specs.append(spec)
            self.armed = True

    def maybe_fire(self, generation: int, step: int, phase: str) -> None:
        if not self._specs:  # the common case, checked at every phase edge without the lock
            return
        with self._lock:  # one fault per edge: a second due entry fires at the next edge
            spec = next(
                (s for s in self._specs if not s.fired and s.matches(generation, step, phase)), None
            )
            if spec is None:
                return
            spec.fired = True
        self._fire(spec, step, phase)

    def _fire(self, spec: FaultSpec, step: int | None = None, phase: str | None = None) -> None:
        where = f"step {step} {phase}" if step is not None else "once armed"
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
        elif spec.kind in ("hang", "stuck-wait"):
            if spec.kind == "stuck-wait":
                self._waiting(True)
            while True:  # deliberately deaf to stop requests: only a kill ends it
                time.sleep(3600)
        else:
            raise InjectedFault(spec.kind, f"injected {spec.kind} fault at {where}")
