"""The KVStore contract (rendezvous.kv): the same behaviour from every implementation that
needs no external service — LocalKV, StoreClient to the embedded server, and StoreClient
through a node proxy whose upstream is a KVStore — plus timeouts and error types."""

from __future__ import annotations

import math
import time
from typing import Iterator

import pytest

from rendezvous.kv import KVStore, StoreAuthError, StoreError, StoreTimeout, check_timeout
from rendezvous.store.client import StoreClient
from rendezvous.store.memory import LocalKV
from rendezvous.store.proxy import StoreProxy
from rendezvous.store.server import StoreServer


@pytest.fixture(params=["local", "client", "client-via-kv-proxy"])
def kv(request) -> Iterator[KVStore]:
    if request.param == "local":
        yield LocalKV()
        return
    with StoreServer(host="127.0.0.1") as s:
        if request.param == "client":
            with StoreClient("127.0.0.1", s.port, timeout=10) as c:
                yield c
            return
        with StoreProxy(s.kv) as px, StoreClient("127.0.0.1", px.port, timeout=10) as c:
            yield c


def test_values_and_counters(kv: KVStore) -> None:
    kv.set("job/a", b"\x00one")
    assert kv.get("job/a", 1.0) == b"\x00one" and kv.try_get("job/a") == b"\x00one"
    assert kv.try_get("job/none") is None
    assert kv.add("job/n", 5) == 5 and kv.add("job/n", -7) == -2
    assert kv.try_get("job/n") == b"-2"  # decimal ASCII, as torch stores counters


def test_compare_set_follows_torch(kv: KVStore) -> None:
    kv.set("cs", b"1")
    assert kv.compare_set("cs", b"1", b"2") == b"2"  # hit: set
    assert kv.compare_set("cs", b"x", b"3") == b"2"  # miss: current value
    assert kv.compare_set("new", b"", b"z") == b"z"  # missing + expected b"": create
    assert kv.compare_set("none", b"e", b"z") == b"e"  # missing + expected: unchanged
    assert kv.try_get("none") is None and kv.try_get("cs") == b"2"


def test_waits_time_out_and_say_which_key(kv: KVStore) -> None:
    kv.set("w/a", b"1")
    assert kv.wait(["w/a"], 1.0) is True
    t = time.monotonic()
    assert kv.wait(["w/a", "w/missing"], 0.2) is False
    assert 0.15 < time.monotonic() - t < 3.0
    with pytest.raises(StoreTimeout, match="w/missing"):
        kv.get("w/missing", 0.05)
    kv.set("w/late", b"v")  # the store is still usable after a timed-out wait
    assert kv.get("w/late", 1.0) == b"v"


def test_listing_and_clearing(kv: KVStore) -> None:
    for k in ("job/b", "job/a", "jobx", "other/c", "ftrun/keep"):
        kv.set(k, b"1")
    assert kv.keys("job/") == ["job/a", "job/b"]
    assert kv.keys() == ["ftrun/keep", "job/a", "job/b", "jobx", "other/c"]
    assert kv.delete("jobx") is True and kv.delete("jobx") is False
    assert kv.delete_prefix("job/") == 2 and kv.keys() == ["ftrun/keep", "other/c"]
    assert kv.clear_except("ftrun/") == 1 and kv.keys() == ["ftrun/keep"]


def test_torch_unprefixed_keys_live_under_ftrun_wire(kv: KVStore) -> None:
    kv.set("ftrun/wire/init/", b"1")
    assert kv.keys("ftrun/wire/") == ["ftrun/wire/init/"]
    assert kv.add("ftrun/wire/init/", 1) == 2


def test_check_and_multi_get_read_many_keys_at_once(kv: KVStore) -> None:
    keys = [f"ftrun/g1/status/{r}" for r in range(50)]
    assert kv.check([]) is True and kv.check(keys) is False
    for i, k in enumerate(keys[:-1]):
        kv.set(k, str(i).encode())
    assert kv.check(keys[:-1]) is True and kv.check(keys) is False
    with pytest.raises(StoreTimeout):
        kv.multi_get(keys, 0.05)
    kv.set(keys[-1], b"49")
    assert kv.check(keys) is True
    assert kv.multi_get(keys, 1.0) == [str(i).encode() for i in range(50)]


def test_present_reads_what_exists_now_and_none_for_the_rest(kv: KVStore) -> None:
    keys = [f"ftrun/finished/{r}" for r in range(40)]
    assert kv.present([]) == []
    for r in range(0, 40, 3):
        kv.set(keys[r], str(r).encode())
    got = kv.present(keys)
    assert got == [str(r).encode() if r % 3 == 0 else None for r in range(40)]


def test_the_tcp_client_reads_many_keys_in_constant_requests() -> None:
    keys = [f"ftrun/aware/{r}" for r in range(300)]
    with StoreServer(host="127.0.0.1") as s:
        with StoreClient("127.0.0.1", s.port, timeout=10) as c:
            for k in keys:
                c.set(k, b"1")

            assert c.check(keys) and len(c.multi_get(keys, 1.0)) == 300
            assert c.present(keys + ["ftrun/aware/x"]) == [b"1"] * 300 + [None]
            c.ping()
            time.sleep(0.2)  # the loop adds up its requests at the end of a busy stretch
            # the 300 SETs, the handshake, CHECK, WAIT, MULTI_GET, MULTI_GET (present), PING:
            # not 300 more per read
            assert 300 < s.stats["requests"] <= 300 + 11


def test_check_timeout() -> None:
    assert check_timeout(0) == 0.0 and check_timeout(1.5) == 1.5
    assert isinstance(check_timeout(2), float)
    for bad in (-1, math.nan, "1", None):
        with pytest.raises(ValueError, match=r"timeout=.*: must be a number of seconds >= 0"):
            check_timeout(bad)


def test_error_types() -> None:
    assert issubclass(StoreTimeout, StoreError) and issubclass(StoreTimeout, TimeoutError)
    assert issubclass(StoreAuthError, StoreError) and issubclass(StoreError, RuntimeError)


def test_the_contract_is_what_every_implementation_must_provide() -> None:
    assert KVStore.__abstractmethods__ == {
        "set",
        "get",
        "try_get",
        "add",
        "compare_set",
        "wait",
        "delete",
        "keys",
    }
    with pytest.raises(TypeError):
        KVStore()  # type: ignore[abstract]


def test_context_manager_closes() -> None:
    with StoreServer(host="127.0.0.1") as s:
        with StoreClient("127.0.0.1", s.port, timeout=5) as c:
            c.set("x", b"1")
        with pytest.raises(StoreError, match=f"store client for 127.0.0.1:{s.port} is closed"):
            c.set("x", b"2")  # the calling thread's link was closed too: not "bad fd"
