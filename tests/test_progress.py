"""Per-rank progress records: published by agents, read back by the controller, aged, stale ones
skipped."""

from __future__ import annotations

import json

from launcher.control.progress import STALE_AFTER, ProgressBoard, read_progress
from launcher.protocol import plan as P
from rendezvous.store.memory import LocalKV


def test_records_round_trip_aged_by_their_age() -> None:
    kv = LocalKV()
    b0, b1 = ProgressBoard(kv, 0, interval=1.0), ProgressBoard(kv, 1)
    assert b0.due(100.0)
    b0.publish(
        {
            0: {
                "aware": True,
                "idle_s": 1.0,
                "waiting": True,
                "silent_s": 0.5,
                "state": "S",
                "phase": "backward",
                "pid": 10,
                "local_rank": 0,
                "host": "a",
            }
        },
        now=100.0,
    )
    assert not b0.due(100.5) and b0.due(101.0)
    b1.publish({2: {"aware": False, "idle_s": 7.0, "state": "T", "pid": 12}}, now=98.0)
    recs = {r.rank: r for r in read_progress(kv, 2, now=102.0)}
    assert (
        recs[0].idle_s == 3.0 and recs[0].silent_s == 2.5 and recs[0].waiting and recs[0].node == 0
    )
    assert recs[0].phase == "backward" and recs[0].pid == 10 and recs[0].host == "a"
    assert (
        recs[2].idle_s == 11.0 and recs[2].state == "T" and not recs[2].aware and recs[2].node == 1
    )


def test_stale_or_damaged_records_are_skipped() -> None:
    kv = LocalKV()
    ProgressBoard(kv, 0).publish({0: {"aware": True, "idle_s": 1.0}}, now=0.0)
    kv.set(P.progress_key(1), b"not json")
    kv.set(P.progress_key(2), json.dumps({"time": 1.0}).encode())
    assert read_progress(kv, 4, now=STALE_AFTER + 1.0) == []
    assert [r.rank for r in read_progress(kv, 4, now=STALE_AFTER - 1.0)] == [0]


def test_every_nodes_record_is_read_in_one_request() -> None:
    """The controller's blame read every node's record with a CHECK and a GET each: 512
    sequential requests at 256 nodes while it held a report."""
    reads: list[list[str]] = []

    class Counting(LocalKV):
        inside = False  # LocalKV answers present() with try_get()s: not requests of their own

        def present(self, keys):  # type: ignore[no-untyped-def]
            reads.append(list(keys))
            self.inside = True
            try:
                return super().present(keys)
            finally:
                self.inside = False

        def try_get(self, key):  # type: ignore[no-untyped-def]
            if not self.inside:
                reads.append([key])
            return super().try_get(key)

    kv = Counting()
    now = 1000.0
    for node in (0, 2):
        ProgressBoard(kv, node).publish({node: {"aware": True, "idle_s": 1.0}}, now=now)
    reads.clear()
    got = read_progress(kv, 3, now=now + 1)
    assert reads == [[P.progress_key(n) for n in range(3)]]
    assert sorted((p.node, p.rank, p.idle_s) for p in got) == [(0, 0, 2.0), (2, 2, 2.0)]
