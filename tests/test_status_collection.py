"""launcher.control.status_collection: a round's statuses gathered one record per node, the
ranks' own keys of a node whose record is late or incomplete, and what is missing."""

from __future__ import annotations

import threading

from launcher.control.status_collection import StatusCollection
from launcher.protocol import plan as P
from rendezvous.store.client import StoreClient
from rendezvous.store.memory import LocalKV
from rendezvous.store.server import StoreServer


def status(rank: int, g: int = 1) -> P.RankStatus:
    return P.RankStatus(rank, g, False, 4, 5, shard="dp")


def post_node(kv, node: int, ranks: list[int], g: int = 1) -> None:
    rec = P.NodeStatuses(g, node, [status(r, g).__dict__ for r in ranks])
    kv.set(P.node_statuses_key(g, node), rec.to_json())


def of_node(rank: int) -> int:
    return rank // 4


def test_one_record_per_node_completes_the_round() -> None:
    kv = LocalKV()
    c = StatusCollection(kv, 1, list(range(8)), of_node)
    assert not c.wait(0.01) and not c.done
    post_node(kv, 0, [0, 1, 2, 3])
    assert not c.wait(0.01)  # node 1's record is still awaited
    post_node(kv, 1, [4, 5, 6, 7])
    assert c.wait(0.5) and c.done
    assert [s.rank for s in c.statuses()] == list(range(8))
    assert all(s.committed_step == 4 and s.shard == "dp" for s in c.statuses())


def test_the_wait_names_one_key_per_node_not_one_per_rank() -> None:
    with StoreServer(host="127.0.0.1") as server:
        with StoreClient("127.0.0.1", server.port, timeout=10) as kv:
            c = StatusCollection(kv, 1, list(range(64)), lambda r: r // 16)
            waited: list[list[str]] = []
            real = kv.wait
            kv.wait = lambda keys, t: waited.append(list(keys)) or real(keys, t)  # type: ignore
            assert not c.wait(0.01)
            assert waited[-1] == [P.node_statuses_key(1, n) for n in range(4)]


def test_a_node_without_a_record_is_read_from_its_ranks_keys_at_a_look() -> None:
    kv = LocalKV()
    c = StatusCollection(kv, 1, list(range(8)), of_node)
    post_node(kv, 0, [0, 1, 2, 3])
    for r in range(4, 7):
        kv.set(P.status_key(1, r), status(r).to_json())
    assert not c.look() and c.missing() == [7]  # node 0 taken, node 1 not all in
    kv.set(P.status_key(1, 7), status(7).to_json())
    assert c.look() and c.done and [s.rank for s in c.statuses()] == list(range(8))


def test_a_record_without_every_member_waits_for_the_ranks_own_keys() -> None:
    kv = LocalKV()
    c = StatusCollection(kv, 1, list(range(8)), of_node)
    post_node(kv, 0, [0, 1, 2, 3])
    post_node(kv, 1, [4, 5, 6])  # its agent did not know rank 7
    assert not c.wait(0.01) and c.missing() == [4, 5, 6, 7]
    done = threading.Event()
    t = threading.Thread(target=lambda: c.wait(5.0) and done.set())
    t.start()
    for r in range(4, 8):
        kv.set(P.status_key(1, r), status(r).to_json())
    t.join(5.0)
    assert done.is_set() and [s.rank for s in c.statuses()] == list(range(8))


def test_an_older_rounds_record_does_not_count() -> None:
    kv = LocalKV()
    c = StatusCollection(kv, 2, [0, 1], lambda r: 0)
    rec = P.NodeStatuses(1, 0, [status(r, 1).__dict__ for r in (0, 1)])
    kv.set(P.node_statuses_key(2, 0), rec.to_json())  # a record naming generation 1
    assert not c.wait(0.01) and c.missing() == [0, 1]


def test_a_satisfied_wait_reads_every_record_in_one_request() -> None:
    """The records a WAIT just found are read with one MULTI_GET (it was WAIT + MULTI_GET
    again: one more round trip on the round's path)."""

    class Counting(StoreClient):
        ops: list[str] = []

        def _call(self, req, count=0):  # type: ignore[no-untyped-def]
            Counting.ops.append(P_store.OP_NAMES[req.op])
            return super()._call(req, count)

        def _wait_wire(self, wks, timeout):  # type: ignore[no-untyped-def]
            Counting.ops.append("WAIT")
            return super()._wait_wire(wks, timeout)

    from rendezvous.store import protocol as P_store

    with StoreServer(host="127.0.0.1") as server:
        kv = Counting("127.0.0.1", server.port, timeout=10)
        try:
            for node in range(64):
                post_node(kv, node, [4 * node + i for i in range(4)])
            c = StatusCollection(kv, 1, list(range(256)), of_node)
            Counting.ops.clear()
            assert c.wait(1.0) and len(c.statuses()) == 256
            assert Counting.ops == ["WAIT", "MULTI_GET"]
        finally:
            kv.close()


def test_waiting_names_the_ranks_of_the_nodes_not_in_yet() -> None:
    kv = LocalKV()
    c = StatusCollection(kv, 1, list(range(12)), of_node)
    assert c.waiting() == list(range(12))
    post_node(kv, 1, [4, 5, 6, 7])
    assert not c.look() and c.waiting() == [0, 1, 2, 3, 8, 9, 10, 11]
    post_node(kv, 0, [0, 1, 2])  # incomplete: node 0's ranks are still waited for
    assert not c.look() and c.waiting() == [0, 1, 2, 3, 8, 9, 10, 11]


def test_records_that_came_are_taken_before_the_last_one_and_not_read_again() -> None:
    with StoreServer(host="127.0.0.1") as server:
        with StoreClient("127.0.0.1", server.port, timeout=10) as kv:
            c = StatusCollection(kv, 1, list(range(12)), of_node)
            post_node(kv, 0, [0, 1, 2, 3])
            post_node(kv, 2, [8, 9, 10, 11])
            assert not c.take_arrived() and c.waiting() == [4, 5, 6, 7]
            read: list[list[str]] = []
            real = kv.present
            kv.present = lambda keys: read.append(list(keys)) or real(keys)  # type: ignore
            post_node(kv, 1, [4, 5, 6, 7])
            assert c.wait(1.0) and c.done
            assert read == [[P.node_statuses_key(1, 1)]]  # the last record alone is parsed
            assert [s.rank for s in c.statuses()] == list(range(12))
