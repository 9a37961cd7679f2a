"""launcher/control/step_halt.py (`StepHalt`) on an in-memory store: the pause request and the
agents' nudge, the step every rank halted after, and each way a halt is not reached (a fault
first with its decision, the pause ended by someone else, the caller's own reason, the phase
timeout naming the late ranks); `end` writes the reason once. The grow back and the hot switch
that use it are tests/test_grow.py's and tests/test_hot_switch.py's."""

from __future__ import annotations

import threading

from launcher.control.decision import Decision
from launcher.control.step_halt import StepHalt
from launcher.protocol import plan as P
from rendezvous.store.memory import LocalKV


class Intake:
    def __init__(self, fault: P.Fault | None = None) -> None:
        self.fault = fault

    def take(self, timeout: float) -> P.Fault | None:
        fault, self.fault = self.fault, None
        return fault


class Decider:
    def decide(self, fault: P.Fault) -> Decision:
        return Decision(P.RECOVER_IN_PLACE, f"rank {fault.rank}", fault)


def halt(kv, fault=None, timeout: float = 5.0) -> StepHalt:
    h = StepHalt(kv, Intake(fault), Decider(), threading.Event(), timeout)  # type: ignore[arg-type]
    h.request()
    return h


def test_every_rank_halted_after_one_step_and_the_end_is_written_once() -> None:
    kv = LocalKV()
    h = halt(kv)
    assert h.active and P.PauseRequest.from_json(kv.get(P.PAUSE_KEY, 1.0)).seq == 1
    nudge = P.Injection.from_json(kv.get(P.inject_key(1), 1.0))
    assert (nudge.rank, nudge.kind) == (P.EVERY_RANK, P.PAUSE_KIND)
    for r in range(3):
        kv.set(P.pause_halted_key(1, r), b"7")
    got = h.wait([0, 1, 2])
    assert (got.step, got.why, got.decision) == (7, "", None) and h.halted_at >= h.t0
    h.end("done")
    h.end("again")  # no pause in effect any more: nothing
    assert kv.get(P.resume_key(1), 1.0) == b"done" and not h.active


def test_a_halt_that_is_not_reached_says_why() -> None:
    kv = LocalKV()
    fault = P.Fault(kind="signal", rank=2, node=0, generation=0)
    got = halt(kv, fault).wait([0, 1])
    assert got.step is None and got.why == "a fault came first (rank 2 signal)"
    assert got.decision is not None and got.decision.cause == fault
    h = halt(kv)
    kv.set(P.resume_key(h.seq), b"ftctl resume")
    assert halt_why(h) == "the pause ended: ftctl resume"
    h = halt(kv)
    assert h.wait([0], lambda: "the new process ended").why == "the new process ended"
    h = halt(kv, timeout=0.3)
    kv.set(P.pause_halted_key(h.seq, 0), b"3")
    assert h.wait([0, 1]).why == "ranks [1] did not halt within 0s"


def halt_why(h: StepHalt) -> str:
    return h.wait([0, 1]).why
