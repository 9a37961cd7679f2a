"""launcher.control.decider: the aware keys read while the controller is idle (not on a
fault's path), and the finished marks read for the ranks asked about only."""

from __future__ import annotations

from launcher.control.controller_settings import ControllerSettings
from launcher.control.controller_state import ControllerState
from launcher.control.decider import AWARE_LOOK_S, Decider
from launcher.control.round_phase import RoundTracker
from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from rendezvous.store.memory import LocalKV


class CountingKV(LocalKV):
    """LocalKV that records the keys of every CHECK and MULTI_GET (`present`)."""

    def __init__(self) -> None:
        super().__init__()
        self.checked: list[list[str]] = []
        self.read: list[list[str]] = []

    def check(self, keys) -> bool:
        self.checked.append(list(keys))
        return super().check(self.checked[-1])

    def present(self, keys: list[str]) -> list[bytes | None]:
        self.read.append(list(keys))
        return super().present(keys)


def decider(kv, world: int = 8) -> Decider:
    settings = ControllerSettings(world, 2, 3, (P.RECOVER_IN_PLACE, P.RESTART_ALL))
    return Decider(
        kv, AgentLog(0, None, quiet=True), settings, ControllerState.read(kv, 3), RoundTracker()
    )


def signal(rank: int = 3) -> P.Fault:
    return P.Fault(kind="signal", rank=rank, node=0, generation=0, message="x")


def test_primed_while_idle_a_fault_decision_reads_no_aware_key() -> None:
    kv = CountingKV()
    for r in range(8):
        kv.set(P.aware_key(r), b"1")
    d = decider(kv)
    d.prime()
    assert kv.checked == [[P.aware_key(r) for r in range(8)]]
    kv.checked.clear()
    assert d.decide(signal()).strategy == P.RECOVER_IN_PLACE
    assert kv.checked == []  # the first fault's path asks nothing of the aware keys


def test_prime_asks_at_most_every_aware_look_until_every_rank_said_hello(monkeypatch) -> None:
    import launcher.control.decider as mod

    kv = CountingKV()
    d = decider(kv)
    now = [100.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: now[0])
    d.prime()
    d.prime()  # not yet: one look per AWARE_LOOK_S while some rank is not aware
    assert len(kv.checked) == 1
    for r in range(8):
        kv.set(P.aware_key(r), b"1")
    now[0] += AWARE_LOOK_S
    d.prime()
    assert len(kv.checked) == 2 and d.all_aware()
    now[0] += 10 * AWARE_LOOK_S
    d.prime()
    assert len(kv.checked) == 2  # every rank said hello: never asked again


def test_finished_marks_are_read_for_the_ranks_asked_about_only() -> None:
    kv = CountingKV()
    kv.set(P.finished_key(2), b"0")
    kv.set(P.finished_key(6), b"0")
    d = decider(kv)
    assert d.finished_ranks() == (2, 6)
    assert kv.read[-1] == [P.finished_key(r) for r in range(8)]
    assert d.finished_ranks(among=[5, 6, 7]) == (6,)
    assert kv.read[-1] == [P.finished_key(r) for r in (5, 6, 7)]
    assert d.finished_ranks(among=[]) == () and len(kv.read) == 2  # nothing to ask: no request
