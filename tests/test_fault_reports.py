"""Fault reports off the agent's loop (launcher.agent.fault_reports): stamped with the reporter's
identity, retried while the store does not answer, refused and logged once the agent is stale."""

from __future__ import annotations

import threading
import time

from launcher.agent.fault_reports import FaultReporter
from launcher.observe.logs import AgentLog, read_event_file
from launcher.protocol import plan as P
from rendezvous.errors import FencedError
from rendezvous.kv import StoreError
from rendezvous.store.memory import LocalKV


class FlakyKV(LocalKV):
    """A store that does not answer while `down` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.down = threading.Event()

    def add(self, key: str, amount: int) -> int:
        if self.down.is_set():
            raise StoreError("cannot connect to the store (test: down)")
        return super().add(key, amount)


def _fault(rank: int = 1) -> P.Fault:
    return P.Fault(kind="signal", rank=rank, node=1, generation=0, message="x")


def _events(tmp_path) -> list[dict]:
    return read_event_file(str(tmp_path / "events.jsonl"))


def test_reports_are_stamped_and_posted_in_order(tmp_path) -> None:
    kv, log = LocalKV(), AgentLog(1, str(tmp_path / "events.jsonl"), quiet=True)
    r = FaultReporter(kv, log, lambda: (1, 3), lambda what: None)
    try:
        for rank in (4, 5):
            r.report(_fault(rank))
        assert r.drain(5.0)
        got = [P.Fault.from_json(kv.get(P.fault_key(s), 1.0)) for s in (1, 2)]
        assert [f.rank for f in got] == [4, 5]
        assert all((f.by_node, f.by_incarnation) == (1, 3) for f in got)
    finally:
        r.stop()
        log.close()


def test_a_report_made_while_cut_off_is_refused_once_the_agent_is_stale(tmp_path) -> None:
    """The store does not answer, then the agent is declared lost: the report never lands
    (it would reach the job's newer generation) and the refusal is logged."""
    kv, log = FlakyKV(), AgentLog(1, str(tmp_path / "events.jsonl"), quiet=True)
    lost = threading.Event()

    def check(what: str) -> None:
        if lost.is_set():
            raise FencedError(f"node 1 (incarnation 1) is stale: write to {what!r} refused (lost)")

    kv.down.set()
    r = FaultReporter(kv, log, lambda: (1, 1), check)
    try:
        t0 = time.monotonic()
        r.report(_fault())
        assert time.monotonic() - t0 < 0.5  # the caller (the agent's loop) never waits (seconds)
        time.sleep(0.5)
        lost.set()
        kv.down.clear()
        assert r.drain(5.0)
        assert kv.try_get(P.fault_key(1)) is None and kv.try_get(P.FAULT_SEQ) is None
    finally:
        r.stop()
        log.close()
    kinds = [e["event"] for e in _events(tmp_path)]
    assert "fault-report-retry" in kinds and "stale-write-refused" in kinds
    assert "fault-reported" not in kinds


def test_a_report_of_an_earlier_incarnation_is_refused_after_rejoining(tmp_path) -> None:
    kv, log = FlakyKV(), AgentLog(1, str(tmp_path / "events.jsonl"), quiet=True)
    me = [(1, 1)]
    kv.down.set()
    r = FaultReporter(kv, log, lambda: me[0], lambda what: None)
    try:
        r.report(_fault())
        time.sleep(0.3)
        me[0] = (1, 2)  # self-fenced and rejoined as a fresh node meanwhile
        kv.down.clear()
        assert r.drain(5.0)
        assert kv.try_get(P.FAULT_SEQ) is None
    finally:
        r.stop()
        log.close()
    refused = [e for e in _events(tmp_path) if e["event"] == "stale-write-refused"]
    assert len(refused) == 1 and "incarnation 2 now" in refused[0]["message"]
