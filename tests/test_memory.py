"""MemoryStore semantics (torch's), the waiter registry, and the LocalKV facade."""

from __future__ import annotations

import threading
import time

import pytest

from rendezvous.kv import StoreError, StoreTimeout
from rendezvous.store import protocol as P
from rendezvous.store.memory import LocalKV, MemoryStore, apply


def test_torch_semantics() -> None:
    m = MemoryStore()
    m.set(b"/a", b"1")
    assert m.get(b"/a") == b"1" and m.get(b"/x") is None
    assert m.add(b"/n", 5) == 5 and m.add(b"/n", -7) == -2 and m.get(b"/n") == b"-2"
    m.set(b"/a", b"zz")
    with pytest.raises(ValueError, match="not a decimal integer"):
        m.add(b"/a", 1)
    m.set(b"/a", b"1")
    assert m.compare_set(b"/a", b"1", b"2") == b"2"
    assert m.compare_set(b"/a", b"9", b"3") == b"2"
    assert m.compare_set(b"/new", b"", b"z") == b"z" and m.get(b"/new") == b"z"
    assert m.compare_set(b"/none", b"e", b"z") == b"e" and m.get(b"/none") is None
    m.append(b"/ap", b"x")
    m.append(b"/ap", b"y")
    assert m.get(b"/ap") == b"xy"
    assert m.check([b"/a", b"/n"]) and not m.check([b"/a", b"/missing"])
    assert m.delete(b"/a") and not m.delete(b"/a")
    m.multi_set([b"/m1", b"/m2"], [b"1", b"2"])
    assert m.multi_get([b"/m1", b"/zz", b"/m2"]) == [b"1", None, b"2"]
    assert sorted(m.list_keys()) == [b"/ap", b"/m1", b"/m2", b"/n", b"/new"]
    assert m.num_keys() == 5


def test_queues() -> None:
    m = MemoryStore()
    assert m.queue_pop(b"/q") == (0, None) and m.queue_len(b"/q") == 0
    m.queue_push(b"/q", b"1")
    m.queue_push(b"/q", b"2")
    assert m.check([b"/q"]) and m.queue_len(b"/q") == 2
    assert m.queue_pop(b"/q") == (2, b"1") and m.queue_pop(b"/q") == (1, b"2")
    assert not m.check([b"/q"])
    fired = []
    w1 = m.wait([b"/q"], lambda: fired.append(1))
    w2 = m.wait([b"/q"], lambda: fired.append(2))
    assert w1 and w2
    m.queue_push(b"/q", b"x")  # wakes exactly one waiter, the oldest
    assert fired == [1]
    m.queue_push(b"/q", b"y")
    assert fired == [1, 2]


def test_wait_fires_once_when_last_key_arrives() -> None:
    m = MemoryStore()
    fired = []
    w = m.wait([b"/a", b"/b", b"/a"], lambda: fired.append("x"))
    assert w is not None
    m.set(b"/a", b"1")
    assert fired == []
    m.set(b"/b", b"1")
    m.set(b"/b", b"2")
    assert fired == ["x"]
    assert m.wait([b"/a", b"/b"], lambda: fired.append("y")) is None
    assert m.pending_waiters() == 0


def test_cancel_and_fan_out_to_thousands() -> None:
    m = MemoryStore()
    hits = [0]

    def fire() -> None:
        hits[0] += 1

    ws = [m.wait([b"/go"], fire) for _ in range(5000)]
    assert m.cancel(ws[0]) and not m.cancel(ws[0])
    t = time.perf_counter()
    m.add(b"/go", 1)
    assert time.perf_counter() - t < 1.0
    assert hits[0] == 4999
    assert not m.cancel(ws[1])  # already fired
    assert m.pending_waiters() == 0


def test_barrier_counts_cumulatively() -> None:
    m = MemoryStore()
    fired = []
    w = m.barrier(b"/b", 3, lambda: fired.append(1))
    assert w is not None and m.get(b"/b") == b"1"
    assert m.barrier(b"/b", 3, lambda: fired.append(2)) is not None
    assert m.barrier(b"/b", 3, lambda: fired.append(3)) is None
    assert sorted(fired) == [1, 2] and m.get(b"/b") == b"3"
    assert m.barrier(b"/b", 3, lambda: None) is None  # counter already past 3
    m.set(b"/s", b"text")
    with pytest.raises(ValueError):
        m.barrier(b"/s", 2, lambda: None)


def test_concurrent_adds_are_exact() -> None:
    m = MemoryStore()

    def work() -> None:
        for _ in range(2000):
            m.add(b"/c", 1)

    ts = [threading.Thread(target=work) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert m.get(b"/c") == b"16000"


def test_local_kv_contract() -> None:
    kv = LocalKV()
    kv.set("job/a", b"1")
    assert kv.table.get(b"/job/a") == b"1"  # logical "x" is wire "/x"
    assert kv.get("job/a", 1.0) == b"1" and kv.try_get("job/zz") is None
    assert kv.add("job/n", 2) == 2
    assert kv.compare_set("job/a", b"1", b"2") == b"2"
    kv.set("other/b", b"x")
    assert kv.keys("job/") == ["job/a", "job/n"] and kv.keys() == ["job/a", "job/n", "other/b"]
    t = time.monotonic()
    assert kv.wait(["job/a", "job/missing"], 0.2) is False
    assert 0.15 < time.monotonic() - t < 2.0
    with pytest.raises(StoreTimeout, match="job/missing"):
        kv.get("job/missing", 0.05)
    kv.set("job/s", b"text")
    with pytest.raises(StoreError, match="not a decimal integer"):
        kv.add("job/s", 1)
    assert kv.clear_except("job/") == 1 and kv.keys() == ["job/a", "job/n", "job/s"]
    assert kv.delete_prefix("job/") == 3 and kv.keys() == []
    with pytest.raises(ValueError, match="timeout=-1"):
        kv.get("x", -1)


def test_local_kv_get_wakes_on_set_from_other_thread() -> None:
    kv = LocalKV()
    threading.Timer(0.1, kv.set, args=("late", b"v")).start()
    t = time.monotonic()
    assert kv.get("late", 5.0) == b"v"
    assert time.monotonic() - t < 2.0


def test_local_kv_names_torch_unprefixed_keys_under_ftrun_wire() -> None:
    kv = LocalKV()
    kv.table.add(b"init/", 2)  # torch's worker counter, sent without the "/"
    assert kv.keys() == ["ftrun/wire/init/"]
    assert kv.try_get("ftrun/wire/init/") == b"2"
    assert kv.add("ftrun/wire/init/", 1) == 3 and kv.table.get(b"init/") == b"3"
    assert kv.delete_prefix("ftrun/wire/") == 1 and kv.table.list_keys() == []


def test_apply_runs_every_data_op_with_its_reply_value() -> None:
    m = MemoryStore()
    Op, R = P.Op, P.Request
    steps = [
        (R(Op.SET, (b"/a",), (b"1",)), None),
        (R(Op.MULTI_SET, (b"/b", b"/c"), (b"2", b"3")), None),
        (R(Op.GET, (b"/a",)), b"1"),
        (R(Op.GET, (b"/none",)), b""),
        (R(Op.MULTI_GET, (b"/b", b"/none")), [b"2", b""]),
        (R(Op.ADD, (b"/n",), (), 5), 5),
        (R(Op.COMPARE_SET, (b"/a",), (b"1", b"9")), b"9"),
        (R(Op.CHECK, (b"/a", b"/b")), P.READY),
        (R(Op.CHECK, (b"/a", b"/none")), P.NOT_READY),
        (R(Op.APPEND, (b"/a",), (b"x",)), None),
        (R(Op.DELETE_KEY, (b"/c",)), 1),
        (R(Op.DELETE_KEY, (b"/c",)), 0),
        (R(Op.GETNUMKEYS), 3),
        (R(Op.QUEUE_PUSH, (b"/q",), (b"i",)), None),
        (R(Op.QUEUE_LEN, (b"/q",)), 1),
        (R(Op.QUEUE_POP, (b"/q",)), (1, b"i")),
        (R(Op.QUEUE_POP, (b"/q",)), (0, None)),
    ]
    for req, want in steps:
        assert apply(m, req) == want, req
    assert sorted(apply(m, R(Op.LIST_KEYS))) == [b"/a", b"/b", b"/n"]
    assert m.get(b"/a") == b"9x"
    data_ops = {op for op, kind in P.KIND_OF.items() if kind == P.Kind.DATA}
    assert {req.op for req, _ in steps} | {Op.LIST_KEYS} == data_ops
    with pytest.raises(ValueError, match="not a decimal integer"):
        apply(m, R(Op.ADD, (b"/a",), (), 1))
