"""Tests for rendezvous.store.etcd against a real etcd server (tests/helpers_etcd.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from helpers_etcd import EtcdServer, etcd_server, free_port, start_etcd  # noqa: F401

from rendezvous.kv import StoreAuthError, StoreError, StoreTimeout
from rendezvous.store.etcd import Endpoint, EtcdConf, EtcdKV, LeaseExpiredError, parse_endpoints

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.etcd


@pytest.fixture
def kv(etcd_server: EtcdServer):
    store = EtcdKV(etcd_server.endpoint, "/ftrun/test-job", EtcdConf(request_timeout=5))
    yield store
    store.close()


# -- configuration (no server needed) ----------------------------------------------------------


def test_parse_endpoints_forms() -> None:
    assert parse_endpoints("a,b:1234") == [Endpoint("a", 2379), Endpoint("b", 1234)]
    assert parse_endpoints("[::1]:23, [fe80::1]") == [
        Endpoint("::1", 23),
        Endpoint("fe80::1", 2379),
    ]
    assert parse_endpoints(["http://h:5/", "https://g"]) == [Endpoint("h", 5), Endpoint("g", 2379)]
    assert Endpoint("::1", 23).target == "[::1]:23"
    assert parse_endpoints(parse_endpoints("a,[::1]:5")) == [Endpoint("a"), Endpoint("::1", 5)]
    for bad, word in [
        ("", "no etcd endpoint"),
        ("h:0", "port"),
        ("h:x", "port"),
        ("::1", "[addr]:port"),
        ("[::1", "']'"),
        ("[::1]x", "':port'"),
        (":5", "host"),
    ]:
        with pytest.raises(ValueError, match=word.replace("[", r"\[").replace("]", r"\]")):
            parse_endpoints(bad)


def test_conf_from_rdzv_conf(tmp_path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    conf = EtcdConf.from_rdzv_conf(
        {"cacert": str(ca), "join_timeout": "5", "user": "u", "password": "p"}
    )
    assert (conf.protocol, conf.cacert, conf.user, conf.password) == ("https", str(ca), "u", "p")
    assert EtcdConf.from_rdzv_conf({}).protocol == "http"
    cases = [
        ({"protocol": "ftp"}, "protocol='ftp' is not valid; use http or https"),
        ({"protocol": "http", "cacert": str(ca)}, "need protocol=https"),
        ({"cert": str(ca)}, "cert and key must be given together"),
        ({"cacert": str(tmp_path / "nope.pem")}, "no such file"),
        ({"user": "u"}, "user and password must be given together"),
    ]
    for conf_dict, msg in cases:
        with pytest.raises(ValueError, match=msg):
            EtcdConf.from_rdzv_conf(conf_dict)


# -- the KV contract ---------------------------------------------------------------------------


def test_every_operation_and_key_mapping(kv: EtcdKV, etcd_server: EtcdServer) -> None:
    kv.set("ftrun/a", b"1")
    kv.set("worker/b", "two")  # str values are encoded
    assert kv.get("ftrun/a", 1) == b"1"
    assert kv.try_get("worker/b") == b"two"
    assert kv.try_get("missing") is None
    assert kv.add("cnt", 5) == 5 and kv.add("cnt", -2) == 3 and kv.try_get("cnt") == b"3"
    assert kv.keys() == ["cnt", "ftrun/a", "worker/b"]
    assert kv.keys("ftrun/") == ["ftrun/a"]
    # logical key k lives at etcd key root/k
    raw = etcd_server.etcdctl("get", "--prefix", "--keys-only", "/ftrun/test-job/").split()
    assert sorted(raw) == [
        "/ftrun/test-job/cnt",
        "/ftrun/test-job/ftrun/a",
        "/ftrun/test-job/worker/b",
    ]
    assert kv.delete("cnt") is True and kv.delete("cnt") is False
    kv.set("ftrun/b", b"x")
    assert kv.clear_except("ftrun/") == 1 and kv.keys() == ["ftrun/a", "ftrun/b"]
    assert kv.delete_prefix("ftrun/") == 2 and kv.keys() == []
    with pytest.raises(StoreError, match="not a counter"):
        kv.set("s", b"abc")
        kv.add("s", 1)


def test_compare_set_torch_semantics(kv: EtcdKV) -> None:
    assert kv.compare_set("k", b"", b"v1") == b"v1"  # missing + expected "" -> set
    assert kv.compare_set("k", b"", b"v9") == b"v1"  # exists, mismatch -> current
    assert kv.compare_set("k", b"nope", b"v9") == b"v1"
    assert kv.compare_set("k", b"v1", b"v2") == b"v2" and kv.try_get("k") == b"v2"
    assert kv.compare_set("absent", b"x", b"y") == b"x" and kv.try_get("absent") is None
    kv.set("empty", b"")
    assert kv.compare_set("empty", b"", b"filled") == b"filled"


def test_guarded_writes_fence_on_another_key(kv: EtcdKV) -> None:
    kv.set("guard", b"me")
    assert kv.put_if("ctl", b"1", "guard", b"me") and kv.try_get("ctl") == b"1"
    assert not kv.put_if("ctl", b"2", "guard", b"other") and kv.try_get("ctl") == b"1"
    assert not kv.put_if("ctl", b"2", "missing-guard", b"me")
    assert kv.compare_set_if("gen", b"", b"0", "guard", b"me") == b"0"
    assert kv.compare_set_if("gen", b"0", b"1", "guard", b"me") == b"1"
    assert kv.compare_set_if("gen", b"0", b"2", "guard", b"me") == b"1"  # lost the race
    assert kv.compare_set_if("nokey", b"x", b"y", "guard", b"me") == b"x"  # torch semantics
    assert kv.compare_set_if("gen", b"1", b"2", "guard", b"other") is None
    assert kv.try_get("gen") == b"1"
    assert not kv.delete_if("guard", b"other") and kv.delete_if("guard", b"me")
    assert kv.try_get("guard") is None


def test_wait_wakes_on_set_and_times_out(kv: EtcdKV) -> None:
    setter = threading.Timer(0.2, kv.set, args=("late", b"1"))
    setter.start()
    t0 = time.monotonic()
    assert kv.wait(["late"], 5.0) is True
    assert time.monotonic() - t0 < 1.5
    setter.join()  # its own call may still be returning when the watch fires

    # several keys, set one by one (one watch over their range)
    def writer() -> None:
        for k in ("w/2", "w/0", "w/1"):
            time.sleep(0.05)
            kv.set(k, b"")

    wt = threading.Thread(target=writer, daemon=True)
    wt.start()
    assert kv.wait(["w/0", "w/1", "w/2"], 5.0) is True
    wt.join(5.0)
    t0 = time.monotonic()
    assert kv.wait(["never"], 0.3) is False
    assert 0.25 < time.monotonic() - t0 < 1.5
    with pytest.raises(StoreTimeout, match="'never2'"):
        kv.get("never2", 0.2)
    threading.Timer(0.2, kv.set, args=("g", b"val")).start()
    assert kv.get("g", 5.0) == b"val"


def test_wait_values_takes_the_values_from_the_watch(kv: EtcdKV, etcd_server: EtcdServer) -> None:
    """`wait_values`: one read, then a watch whose events carry the values (no read after the
    wake-up); a key deleted meanwhile is waited for again; None when the time runs out."""
    writer = EtcdKV(etcd_server.endpoint, "/ftrun/test-job", EtcdConf(request_timeout=5))
    calls: list[str] = []
    real = kv._call
    kv._call = lambda what, fn: (calls.append(what), real(what, fn))[1]  # type: ignore[method-assign]
    try:
        writer.set("wv/a", b"A")
        assert kv.wait_values(["wv/a"], 1.0) == [b"A"] and calls == ["get"]
        calls.clear()
        threading.Timer(0.2, writer.set, args=("wv/b", b"B")).start()
        t0 = time.monotonic()
        assert kv.wait_values(["wv/b", "wv/a", "wv/b"], 5.0) == [b"B", b"A", b"B"]
        assert time.monotonic() - t0 < 1.5
        assert calls == ["get"]  # the snapshot before the watch; the value came with the event

        def churn() -> None:
            time.sleep(0.1)
            writer.set("wv/c", b"1")
            writer.delete("wv/c")
            writer.set("wv/d", b"D")
            writer.set("wv/c", b"2")

        t = threading.Thread(target=churn, daemon=True)
        t.start()
        assert kv.wait_values(["wv/c", "wv/d"], 5.0) == [b"2", b"D"]
        t.join(5.0)
        t0 = time.monotonic()
        assert kv.wait_values(["wv/never", "wv/a"], 0.3) is None
        assert 0.25 < time.monotonic() - t0 < 1.5
        assert kv.wait_values([], 0.1) == [] and kv.wait_values(["wv/never"], 0) is None
    finally:
        writer.close()


def test_add_under_contention(etcd_server: EtcdServer) -> None:
    stores = [EtcdKV(etcd_server.endpoint, "/c") for _ in range(2)]
    results: list[list[int]] = [[], []]

    def bump(i: int) -> None:
        for _ in range(150):
            results[i].append(stores[i].add("n", 1))

    threads = [threading.Thread(target=bump, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        seen = sorted(results[0] + results[1])
        assert seen == list(range(1, 301))  # every increment applied exactly once
        assert stores[0].try_get("n") == b"300"
    finally:
        for s in stores:
            s.close()


def test_leases_expire_and_refresh_keeps_them(kv: EtcdKV) -> None:
    short, kept = kv.grant_lease(1), kv.grant_lease(1)
    kv.put_with_lease("short", b"x", short)
    kv.put_with_lease("kept", b"y", kept)
    assert kv.create("kept", b"z", kept) is False and kv.create("new", b"n") is True
    t0 = time.monotonic()
    while time.monotonic() - t0 < 2.5:
        assert kv.refresh_lease(kept) >= 1
        time.sleep(0.3)
    assert kv.try_get("short") is None
    assert kv.try_get("kept") == b"y"
    with pytest.raises(LeaseExpiredError):
        kv.refresh_lease(short)
    kv.revoke_lease(kept)
    assert kv.try_get("kept") is None
    kv.revoke_lease(kept)  # already gone: fine


def test_watch_fires_for_put_delete_and_lease_expiry(kv: EtcdKV) -> None:
    events = []
    got = threading.Event()

    def cb(ev):
        events.append((ev.kind, ev.key, ev.value))
        if len(events) >= 3:
            got.set()

    handle = kv.watch_prefix("nodes/", cb)
    lease = kv.grant_lease(1)
    kv.put_with_lease("nodes/1", b"n1", lease)
    kv.set("other", b"ignored")
    kv.set("nodes/2", b"n2")
    t0 = time.monotonic()
    assert got.wait(5)
    deadline = time.monotonic() + 5
    while ("delete", "nodes/1", b"") not in events and time.monotonic() < deadline:
        time.sleep(0.05)
    expiry = time.monotonic() - t0
    assert events[:2] == [("put", "nodes/1", b"n1"), ("put", "nodes/2", b"n2")]
    assert ("delete", "nodes/1", b"") in events and expiry < 3.0
    handle.cancel()
    n = len(events)
    kv.set("nodes/3", b"after cancel")
    time.sleep(0.2)
    assert len(events) == n
    snap, rev = kv.get_prefix("nodes/")
    assert snap == {"nodes/2": b"n2", "nodes/3": b"after cancel"} and rev > 0
    # replay from a revision: sees exactly the later change
    replay = []
    h2 = kv.watch_key("nodes/2", lambda ev: replay.append(ev.kind), start_revision=rev + 1)
    kv.delete("nodes/2")
    assert kv.wait_deleted("nodes/2", 2) is True
    time.sleep(0.1)
    h2.cancel()
    assert replay == ["delete"]


# -- failures: one clear line -------------------------------------------------------------------


def test_wrong_credentials_give_one_clear_error(etcd_server: EtcdServer) -> None:
    etcd_server.enable_auth("root", "right")
    good = EtcdKV(etcd_server.endpoint, "/a", EtcdConf(user="root", password="right"))
    good.set("k", b"v")
    events = []
    h = good.watch_key("k", events.append)
    good.set("k", b"w")
    assert good.wait(["k"], 1) and good.get("k", 1) == b"w"
    h.cancel()
    good.close()
    with pytest.raises(StoreAuthError) as err:
        EtcdKV(etcd_server.endpoint, "/a", EtcdConf(user="root", password="wrong"))
    msg = str(err.value)
    assert "\n" not in msg and "authentication failed" in msg and "root" in msg
    assert err.value.__cause__ is None and err.value.__suppress_context__
    with pytest.raises(StoreAuthError, match="no user given"):
        EtcdKV(etcd_server.endpoint, "/a")


def test_unreachable_endpoint_fails_within_timeout() -> None:
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(StoreError) as err:
        EtcdKV(f"127.0.0.1:{port}", "/a", EtcdConf(request_timeout=1.5))
    took = time.monotonic() - t0
    assert took < 3.0
    assert "\n" not in str(err.value) and f"127.0.0.1:{port}" in str(err.value)


def test_failover_to_second_endpoint(etcd_server: EtcdServer) -> None:
    dead = free_port()
    kv = EtcdKV(f"127.0.0.1:{dead},{etcd_server.endpoint}", "/f", EtcdConf(request_timeout=3))
    try:
        kv.set("x", b"1")
        assert kv.get("x", 1) == b"1"
    finally:
        kv.close()


def test_ipv6_endpoint() -> None:
    server = start_etcd(ipv6=True)
    try:
        kv = EtcdKV(server.endpoint_v6, "/v6")
        kv.set("k", b"v")
        assert kv.get("k", 1) == b"v" and kv.endpoints == [Endpoint("::1", server.client_port)]
        kv.close()
    finally:
        server.stop()


def test_survives_etcd_restart(kv: EtcdKV, etcd_server: EtcdServer) -> None:
    """Requests retry while etcd is down; watches and pending waits resume afterwards."""
    seen: list[str] = []
    kv.watch_prefix("r/", lambda ev: seen.append(ev.key))
    kv.set("r/before", b"1")
    waiter_result: list[bool] = []
    waiter = threading.Thread(target=lambda: waiter_result.append(kv.wait(["r/late"], 10)))
    waiter.start()
    time.sleep(0.2)
    down = threading.Thread(target=etcd_server.restart, kwargs={"down_for": 0.8})
    down.start()
    time.sleep(0.3)  # etcd is down now
    t0 = time.monotonic()
    kv.set("r/during", b"2")  # retried until etcd is back (request_timeout 5 s)
    assert 0.2 < time.monotonic() - t0 < 5
    down.join(20)
    kv.set("r/late", b"3")
    waiter.join(10)
    assert waiter_result == [True]
    deadline = time.monotonic() + 5
    while len(seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seen == ["r/before", "r/during", "r/late"]


def test_close_is_quiet_and_env_is_restored(etcd_server: EtcdServer) -> None:
    """No 'Channel closed' noise from watch threads, no gRPC log lines for an unreachable
    endpoint, and the protobuf switch does not leak into the environment workers inherit."""
    code = textwrap.dedent(f"""
        import os, threading
        from rendezvous.store.etcd import EtcdKV
        assert "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION" not in os.environ
        kv = EtcdKV("{etcd_server.endpoint}", "/q")
        hs = [kv.watch_prefix("p", lambda ev: None) for _ in range(3)]
        setter = threading.Timer(0.1, kv.set, args=("w", b"1"))
        setter.start()
        assert kv.wait(["w"], 5)
        setter.join()  # the setter's own call may still be finishing when the watch fires
        kv.close()
        kv.close()
        from rendezvous.store.etcd import EtcdConf
        from rendezvous.kv import StoreError
        try:
            EtcdKV("127.0.0.1:{free_port()}", "/q", EtcdConf(request_timeout=0.5))
        except StoreError:
            print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"}
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok" and res.stderr == ""


def test_protobuf_already_loaded_gives_clear_error() -> None:
    code = textwrap.dedent("""
        from google.protobuf.internal import api_implementation
        import google.protobuf.message
        impl = api_implementation.Type()
        from rendezvous.store.etcd import EtcdKV
        from rendezvous.kv import StoreError
        try:
            EtcdKV("127.0.0.1:1", "/x")
        except StoreError as e:
            print(impl, "|", e)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"}
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 0, res.stderr
    impl, _, msg = res.stdout.strip().partition(" | ")
    if impl == "python":
        pytest.skip("protobuf runs pure-Python here; the upb conflict cannot happen")
    assert "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python" in msg and "\n" not in msg


def test_wait_inside_a_watch_callback_fails_fast(kv: EtcdKV) -> None:
    errors: list[str] = []
    done = threading.Event()

    def cb(ev) -> None:
        try:
            kv.wait(["never"], 5)
        except StoreError as exc:
            errors.append(str(exc))
        done.set()

    kv.watch_key("trigger", cb)
    kv.set("trigger", b"1")
    assert done.wait(3)
    assert errors and "inside a watch callback" in errors[0]


def test_a_short_wait_whose_watch_is_confirmed_late_times_out_instead_of_failing(
    kv: EtcdKV,
) -> None:
    """A wait shorter than etcd's confirmation of its watch (the controller's status wait
    polls in 0.02 s slices) returns False, and True when the keys exist; it used to raise
    "etcd did not confirm a watch" (a StoreError) on a loaded machine, which cut the
    controller's round short (failed once in CI). The confirmation is held up here by a watch
    callback that takes 0.4 s: confirmations come on the same thread."""
    busy = threading.Event()

    def slow(ev) -> None:
        busy.set()
        time.sleep(0.4)

    kv.watch_key("trigger", slow)
    kv.set("trigger", b"1")
    assert busy.wait(3)
    t0 = time.monotonic()
    assert kv.wait(["never"], 0.02) is False
    assert kv.wait_values(["never"], 0.02) is None
    assert time.monotonic() - t0 < 3.0
    kv.set("there", b"v")
    busy.clear()
    kv.set("trigger", b"2")
    assert busy.wait(3)
    assert kv.wait(["there"], 0.02) is True  # held by the snapshot: no watch needed
    kv.set("gone", b"1")
    busy.clear()
    kv.set("trigger", b"3")
    assert busy.wait(3)
    assert kv.wait_deleted("gone", 0.02) is False
