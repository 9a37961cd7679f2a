"""The agent's store stack on one node: hosted store, world, address published atomically."""

from __future__ import annotations

import json
import os
import time

from launcher.agent.store_stack import AgentWorld, StoreStack
from launcher.cli.ftrun import parse
from launcher.config import build_config
from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from rendezvous.store.client import StoreClient


def test_single_node_stack_hosts_the_store_and_tells_ftctl_where(tmp_path) -> None:
    (tmp_path / "x.py").write_text("")
    cfg = build_config(parse(["--nproc_per_node", "3", str(tmp_path / "x.py")]), env={})
    stack = StoreStack(cfg, AgentLog(0, None, quiet=True))
    try:
        kv = stack.open()
        world = stack.join("h", lambda n: None, lambda n: None)
        assert world == AgentWorld(0, 1, 0, 3, True) and not stack.rejoined
        host, port = stack.start_proxy()
        assert port == stack.store_port() > 0
        addr = stack.publish(world, str(tmp_path))
        assert addr == f"127.0.0.1:{port}"
        assert json.loads((tmp_path / P.STORE_ADDR_FILE).read_text())["addr"] == addr
        assert sorted(os.listdir(tmp_path)) == [P.STORE_ADDR_FILE, "x.py"]  # no temp file left
        assert kv.try_get(P.WORLD_SIZE_KEY) == b"3"
        c = StoreClient("127.0.0.1", port, token=stack.token, timeout=5.0)
        try:
            assert c.try_get(P.WORLD_SIZE_KEY) == b"3"  # what `ftctl inject --addr` reads
        finally:
            c.close()
    finally:
        stack.close()


def test_the_hosted_store_loop_at_ftrun_store_nice_and_the_proxy_at_its_own(tmp_path) -> None:
    """FTRUN_STORE_NICE goes from the CLI's environment through the config to the store the
    agent hosts (only its loop thread; root raises a priority); the node proxy's loop keeps
    the inherited priority (raised, it preempted its own ranks: 4096 clients via proxies
    took 1.6x torch's time, 1.0x at the inherited priority)."""
    import threading

    import pytest

    from tests.test_loop_priority import settled_nice, thread_nice

    if os.geteuid() != 0:
        pytest.skip("raising a priority needs CAP_SYS_NICE")
    (tmp_path / "x.py").write_text("")
    cfg = build_config(
        parse(["--nproc_per_node", "2", "--rdzv-conf", "proxy=true", str(tmp_path / "x.py")]),
        env={"FTRUN_STORE_NICE": "-4"},
    )
    stack = StoreStack(cfg, AgentLog(0, None, quiet=True))
    me = thread_nice(threading.get_native_id())
    try:
        stack.open()
        stack.join("h", lambda n: None, lambda n: None)
        stack.start_proxy()
        want = min(me, -4)
        assert settled_nice(stack._server._thread.native_id, want) == want
        assert stack._proxy.nice == 0
        deadline = time.monotonic() + 5
        while not hasattr(stack._proxy, "_priority") and time.monotonic() < deadline:
            time.sleep(0.01)  # the loop has started (and applied its priority)
        time.sleep(0.05)
        assert thread_nice(stack._proxy._thread.native_id) == me
        assert thread_nice(threading.get_native_id()) == me
    finally:
        stack.close()


def test_ftrun_store_accel_0_reaches_the_hosted_store_and_the_proxy(tmp_path) -> None:
    """FTRUN_STORE_ACCEL goes from the CLI's environment through the config (`store_accel`) to
    the store the agent hosts and to its node proxy: 0 leaves both on their Python paths."""
    (tmp_path / "x.py").write_text("")
    argv = ["--nproc_per_node", "2", "--rdzv-conf", "proxy=true", str(tmp_path / "x.py")]
    for env, accel in (({"FTRUN_STORE_ACCEL": "0"}, False), ({}, True)):
        cfg = build_config(parse(argv), env=env)
        assert cfg.store_accel is accel
        stack = StoreStack(cfg, AgentLog(0, None, quiet=True))
        try:
            stack.open()
            stack.join("h", lambda n: None, lambda n: None)
            stack.start_proxy()
            assert stack._server.accel is accel and stack._proxy.accel is accel
            if not accel:
                assert stack._server._read_quick is None and stack._proxy._proxy_read is None
        finally:
            stack.close()
