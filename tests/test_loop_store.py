"""The agent loop's store calls, off the loop (launcher.agent.loop_store): writes coalesced and in
order, and nothing the loop does waits on a store whose peer stopped answering (a real store
server behind a relay whose link is cut: calls through it hang until their timeout)."""

from __future__ import annotations

import time

from helpers_relay import Relay

from launcher.agent.hang_guard import READ_WAIT, HangGuard
from launcher.agent.loop_store import Call, LoopStore
from launcher.cli.ftrun import parse
from launcher.config import build_config
from launcher.control.progress import ProgressBoard
from launcher.observe.logs import AgentLog, RunLogDir
from launcher.protocol import plan as P
from launcher.workers.workers import NodeWorkers
from rendezvous.store.client import StoreClient
from rendezvous.store.memory import LocalKV
from rendezvous.store.server import StoreServer

CALL_TIMEOUT = 5.0  # the client's read_timeout: a call through the cut link blocks this long


def test_puts_keep_the_latest_value_and_adds_run_in_order_with_their_follow_up() -> None:
    kv, log = LocalKV(), AgentLog(0, None, quiet=True)
    s = LoopStore(kv, log)
    try:
        seen: list[int] = []
        s.add("c", 1, then=seen.append)
        s.add("c", 1, then=seen.append)
        for i in range(50):
            s.put("p", str(i).encode())
        assert s.drain(5.0)
        assert kv.try_get("p") == b"49" and seen == [1, 2]
    finally:
        s.stop()


def test_nothing_the_loop_hands_over_waits_for_a_store_that_stopped_answering(tmp_path) -> None:
    log = AgentLog(0, None, quiet=True)
    with StoreServer(host="127.0.0.1") as server, Relay("127.0.0.1", server.port) as relay:
        kv = StoreClient("127.0.0.1", relay.port, timeout=CALL_TIMEOUT)
        s = LoopStore(kv, log)
        try:
            s.put("warm", b"1")
            assert s.drain(5.0)
            relay.cut()
            time.sleep(0.3)  # the relay's pumps finish a read already under way (0.1 s)
            t0 = time.monotonic()
            s.put(P.aware_key(0), b"1")
            s.add(P.stopped_key(1), 1)
            board = ProgressBoard(kv, 0, put=s.put)
            board.publish({0: {"aware": True}})
            assert time.monotonic() - t0 < 0.5  # the loop went on at once (a cut write stalls 5 s)
            assert not s.drain(0.5)  # the writes themselves hang in the cut link
            relay.heal()
            assert s.drain(CALL_TIMEOUT + 5.0)
            # everything lands once the link is back (a SET has no reply: the server applies
            # it a moment after the client sent it)
            assert server.kv.wait([P.aware_key(0), P.progress_key(0), P.stopped_key(1)], 5.0)
        finally:
            s.stop()
            kv.close()


def test_the_health_checks_read_of_other_nodes_progress_is_bounded(tmp_path) -> None:
    """Unmodified ranks all silent: the check reads the other nodes' progress records. With the
    link cut it waits READ_WAIT, counts them as progressing (no kill on a guess), and goes on."""
    script = tmp_path / "x.py"
    script.write_text("")
    cfg = build_config(
        parse(["--nproc_per_node", "1", "--log_dir", str(tmp_path), str(script)]), env={}
    )
    log = AgentLog(0, None, quiet=True)
    with StoreServer(host="127.0.0.1") as server, Relay("127.0.0.1", server.port) as relay:
        kv = StoreClient("127.0.0.1", relay.port, timeout=CALL_TIMEOUT)
        try:
            g = HangGuard(
                cfg,
                log,
                RunLogDir.create(str(tmp_path), "t"),
                "h",
                lambda: NodeWorkers.create(0, 1),
            )
            g.attach(kv, 0, 2, put=lambda k, v: None)
            kv.try_get("warm")
            relay.cut()
            time.sleep(0.3)
            t0 = time.monotonic()
            assert g._others_progress(0, 10.0) is True
            assert g._others_progress(0, 10.0) is True  # the same read, still in flight
            assert time.monotonic() - t0 < 2 * READ_WAIT + 0.2
            relay.heal()
        finally:
            kv.close()


def test_a_call_hands_back_its_value_or_its_error() -> None:
    ok = Call.start(lambda: 7)
    assert ok.wait(5.0) and ok.value == 7 and ok.error is None

    def boom() -> None:
        raise ValueError("x")

    bad = Call.start(boom)
    assert bad.wait(5.0) and isinstance(bad.error, ValueError)
