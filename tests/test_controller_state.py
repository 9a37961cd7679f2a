"""The controller's saved state (launcher.control.controller_state): round trip, and the term
fencing that keeps a superseded controller from overwriting its successor's record."""

from __future__ import annotations

import pytest

from launcher.control import controller_state as CS
from rendezvous.errors import FencedError
from rendezvous.store import protocol as P
from rendezvous.store.memory import LocalKV


def test_saved_state_round_trips_through_the_store() -> None:
    kv = LocalKV()
    assert CS.load(kv) is None
    t = CS.take_term(kv)
    st = CS.SavedState(
        t,
        3,
        history=[{"rank": 1, "outcome": "recovered"}],
        lost={1: {"at": 12.5, "fault": "{}"}},
        known={0: 1, 1: 2},
    )
    CS.save(kv, st)
    back = CS.load(kv)
    assert back == st and back.lost[1]["at"] == 12.5 and back.known == {0: 1, 1: 2}


def test_a_superseded_controller_can_neither_save_nor_publish() -> None:
    kv = LocalKV()
    old, new = CS.take_term(kv), CS.take_term(kv)
    assert new > old
    CS.save(kv, CS.SavedState(old, 1))  # before the successor wrote: allowed
    CS.save(kv, CS.SavedState(new, 1, known={0: 2}))
    with pytest.raises(
        FencedError, match=f"term {old} was superseded by the controller of term {new}"
    ):
        CS.save(kv, CS.SavedState(old, 2))
    with pytest.raises(FencedError):
        CS.check_term(kv, old, "ftrun/plan/2")
    CS.check_term(kv, new, "ftrun/plan/2")
    assert CS.load(kv).known == {0: 2}  # the successor's record stands


def test_an_unreadable_record_is_not_trusted_and_is_overwritten() -> None:
    kv = LocalKV()
    kv.set(CS.STATE_KEY, b"{not json")
    assert CS.load(kv) is None
    CS.save(kv, CS.SavedState(CS.take_term(kv), 0))
    assert CS.load(kv) is not None


def test_the_fencing_reads_cost_one_request_each_on_the_tcp_store() -> None:
    """`check_term` (before every plan) and `save` read the record in one request (MULTI_GET),
    not two (CHECK then GET): a round trip less on a fault's path; fencing unchanged."""
    from rendezvous.store.client import StoreClient
    from rendezvous.store.server import StoreServer

    class Counting(StoreClient):
        sent: list[str] = []

        def _call(self, req, count: int = 0):
            self.sent.append(P.OP_NAMES[req.op])
            return super()._call(req, count)

    with (
        StoreServer(host="127.0.0.1") as server,
        Counting("127.0.0.1", server.port, timeout=10.0) as kv,
    ):
        old, new = CS.take_term(kv), CS.take_term(kv)
        CS.check_term(kv, old, "ftrun/plan/1")  # no record yet: nobody is fenced
        CS.save(kv, CS.SavedState(new, 1))
        kv.sent.clear()
        CS.check_term(kv, new, "ftrun/plan/2")
        assert kv.sent == ["MULTI_GET"]
        kv.sent.clear()
        CS.save(kv, CS.SavedState(new, 2))
        assert kv.sent == ["MULTI_GET", "COMPARE_SET"]
        assert CS.load(kv).generation == 2
        with pytest.raises(FencedError):
            CS.check_term(kv, old, "ftrun/plan/3")
