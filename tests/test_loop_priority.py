"""rendezvous.store.loop_priority: FTRUN_STORE_NICE, the loop thread's own priority, a refusal said
in one line; and the store's and the proxy's loop threads really run at it (real sockets)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from launcher.config import ConfigError, build_config
from rendezvous.store.loop_priority import (
    DEFAULT_NICE,
    LoopPriority,
    loop_nice,
    raise_thread_priority,
)
from rendezvous.store.proxy import StoreProxy
from rendezvous.store.server import StoreServer

ROOT = os.geteuid() == 0


def thread_nice(native_id: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, native_id)


def settled_nice(native_id: int, want: int, timeout: float = 5.0) -> int:
    """The thread's nice value once it is `want` (the loop sets it as it starts), or after
    `timeout`, whatever it is then."""
    end = time.monotonic() + timeout
    while thread_nice(native_id) != want and time.monotonic() < end:
        time.sleep(0.01)
    return thread_nice(native_id)


def in_thread(fn):
    """fn() run in a new thread: (its result, the thread's nice value after it)."""
    out = {}

    def body():
        out["r"] = fn()
        out["nice"] = thread_nice(threading.get_native_id())

    t = threading.Thread(target=body)
    t.start()
    t.join(10)
    return out["r"], out["nice"]


def in_unprivileged_child(fn, nice: int = 0) -> str:
    """fn() -> str run in a forked child at nice `nice` that (when we are root) became the
    unprivileged user nobody first, whose RLIMIT_NICE 0 allows no raised priority."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.nice(nice)
            if ROOT:
                os.setgid(65534)
                os.setuid(65534)
            os.write(w, fn().encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 4096):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return data.decode()


@pytest.mark.parametrize("raw,want", [("", DEFAULT_NICE), ("0", 0), ("-5", -5), (" -20 ", -20)])
def test_loop_nice_reads_the_variable(raw, want):
    assert loop_nice({"FTRUN_STORE_NICE": raw}) == want
    assert loop_nice({}) == DEFAULT_NICE


@pytest.mark.parametrize("raw", ["abc", "5", "-21", "1.5"])
def test_loop_nice_rejects_a_bad_value_in_one_line(raw):
    with pytest.raises(ValueError) as e:
        loop_nice({"FTRUN_STORE_NICE": raw})
    msg = str(e.value)
    assert "\n" not in msg and "FTRUN_STORE_NICE" in msg and repr(raw) in msg and "-20" in msg


def test_a_bad_value_is_a_config_error_of_the_cli(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    with pytest.raises(ConfigError, match="FTRUN_STORE_NICE='7'"):
        build_config({"training_script": str(script)}, env={"FTRUN_STORE_NICE": "7"})
    cfg = build_config({"training_script": str(script)}, env={"FTRUN_STORE_NICE": "-3"})
    assert cfg.store_nice == -3


@pytest.mark.skipif(not ROOT, reason="raising a priority needs CAP_SYS_NICE")
def test_only_the_calling_thread_is_raised():
    before = thread_nice(threading.get_native_id())
    why, nice = in_thread(lambda: raise_thread_priority(-4))
    assert why is None and nice == min(before, -4)
    assert thread_nice(threading.get_native_id()) == before  # this thread: unchanged
    why, nice = in_thread(lambda: raise_thread_priority(0))
    assert why is None and nice == before


@pytest.mark.skipif(not ROOT, reason="needs root to become an unprivileged user")
def test_a_refusal_is_one_line_and_the_thread_keeps_its_priority():
    def child() -> str:
        why = raise_thread_priority(-5)
        return f"{thread_nice(threading.get_native_id())}|{why}"

    nice, why = in_unprivileged_child(child).split("|", 1)
    assert int(nice) == thread_nice(threading.get_native_id())
    assert "cannot raise the loop thread's priority to nice -5" in why and "\n" not in why


@pytest.mark.skipif(not ROOT, reason="raising a priority needs CAP_SYS_NICE")
def test_the_store_and_proxy_loop_threads_run_at_the_nice_value():
    me = thread_nice(threading.get_native_id())
    with (
        StoreServer(host="127.0.0.1", port=0, nice=-7) as srv,
        StoreProxy(("127.0.0.1", srv.port), port=0, nice=-6) as proxy,
        StoreServer(host="127.0.0.1", port=0, nice=0) as plain,
    ):
        assert settled_nice(srv._thread.native_id, min(me, -7)) == min(me, -7)
        assert settled_nice(proxy._thread.native_id, min(me, -6)) == min(me, -6)
        assert settled_nice(plain._thread.native_id, -99, timeout=0.3) == me
        assert thread_nice(threading.get_native_id()) == me


def test_a_proxy_keeps_its_inherited_priority_unless_asked(monkeypatch):
    """FTRUN_STORE_NICE is the store's: a node proxy's loop stays at the inherited priority
    (raised, it preempted its own ranks at every request and split their rounds: 4096
    clients via proxies 1.6x torch's time against 1.0x); an explicit `nice=` still works."""
    monkeypatch.setenv("FTRUN_STORE_NICE", "-8")
    with StoreServer(host="127.0.0.1", port=0) as srv:
        assert srv.nice == -8
        assert StoreProxy(("127.0.0.1", srv.port), port=0).nice == 0
        assert StoreProxy(("127.0.0.1", srv.port), port=0, nice=-3).nice == -3


@pytest.mark.parametrize("bad", [5, -21, 1.0, True, "-3"])
def test_a_nice_given_in_code_is_checked(bad):
    with pytest.raises(ValueError, match="nice="):
        StoreServer(host="127.0.0.1", port=0, nice=bad)


@pytest.mark.skipif(not ROOT, reason="raising a priority needs CAP_SYS_NICE")
def test_the_loop_keeps_its_inherited_priority_above_the_connection_bound():
    me = thread_nice(threading.get_native_id())
    logged = []

    def steps():
        p = LoopPriority(-6, logged.append, max_connections=3)
        tid = threading.get_native_id()
        seen = []
        for n in (0, 3, 4, 100, 2):
            p.update(n)
            seen.append(thread_nice(tid))
        return seen

    seen, _ = in_thread(steps)
    raised = min(me, -6)
    assert seen == [raised, raised, me, me, raised] and not logged


def test_an_unprivileged_loop_says_so_once_and_stops_asking():
    """Also from a positive nice (a job started under `nice 5`): after the refusal the loop
    neither asks again nor believes it was raised."""

    def child() -> str:
        logged = []
        p = LoopPriority(-5, logged.append, max_connections=3)
        for n in (0, 5, 1, 1):
            p.update(n)
        return f"{len(logged)}|{p.raised}|{p.nice == p.inherited}"

    assert in_unprivileged_child(child, nice=5) == "1|False|True"
