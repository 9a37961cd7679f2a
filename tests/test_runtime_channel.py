"""The worker side of the agent channel, against a real unix socket served by the test."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time

import pytest

from launcher.protocol.messages import FaultReport, Hello, Inject
from launcher.runtime.channel import AgentChannel
from launcher.runtime.signals import StopSignal


@pytest.fixture
def server():
    d = tempfile.mkdtemp(prefix="ftrtch", dir="/tmp")
    path = os.path.join(d, "a.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    srv.settimeout(10)
    yield path, srv
    srv.close()
    os.unlink(path)
    os.rmdir(d)


def read_messages(conn: socket.socket, until, timeout: float = 5.0) -> list[dict]:
    conn.settimeout(0.1)
    buf, out = b"", []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not until(out):
        try:
            chunk = conn.recv(65536)
        except socket.timeout:
            continue
        if not chunk:
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            out.append(json.loads(line))
    return out


def test_hello_heartbeats_faults_stop_and_bye(server):
    path, srv = server
    stop = StopSignal()
    logs: list[str] = []
    ch = AgentChannel(path, 3, stop, logs.append, heartbeat_interval=0.2)
    ch.start(Hello(rank=3, local_rank=1, pid=os.getpid(), generation=0, replacement=False))
    conn, _ = srv.accept()
    try:
        msgs = read_messages(conn, lambda m: len([x for x in m if x["op"] == "heartbeat"]) >= 3)
        assert msgs[0] == {
            "op": "hello",
            "rank": 3,
            "local_rank": 1,
            "pid": os.getpid(),
            "generation": 0,
            "replacement": False,
            "notice_tid": 0,
        }
        beats = [m for m in msgs if m["op"] == "heartbeat"]
        assert len(beats) >= 3 and all(m["rank"] == 3 for m in beats)  # idle heartbeats keep coming
        ch.update(step=7, phase="backward", committed_step=6)
        ch.send(FaultReport(rank=3, kind="network", message="x", step=7, phase="backward"))
        msgs = read_messages(conn, lambda m: any(x["op"] == "fault" for x in m))
        hb = [m for m in msgs if m["op"] == "heartbeat"]
        assert hb and (hb[-1]["step"], hb[-1]["phase"], hb[-1]["committed_step"]) == (
            7,
            "backward",
            6,
        )
        t0 = time.monotonic()
        conn.sendall(b'{"op":"stop","generation":2}\nnot json\n{"op":"stop","generation":1}\n')
        assert stop.wait_newer(1, 2.0) and time.monotonic() - t0 < 0.5
        time.sleep(0.1)
        assert stop.target == 2  # the older stop did not lower it
        assert any("malformed" in line for line in logs)
        ch.close(bye=True)
        msgs = read_messages(conn, lambda m: any(x["op"] == "bye" for x in m))
        assert msgs[-1] == {"op": "bye", "rank": 3}
    finally:
        conn.close()


def test_connect_failure_names_the_socket(tmp_path):
    ch = AgentChannel(str(tmp_path / "missing.sock"), 0, StopSignal(), print, connect_timeout=0.2)
    with pytest.raises(ConnectionError, match="missing.sock"):
        ch.start(Hello(rank=0))


def test_inject_goes_to_the_injector_and_waiting_rides_the_next_heartbeat(server):
    path, srv = server
    got: list[dict] = []
    ch = AgentChannel(path, 1, StopSignal(), print, heartbeat_interval=0.2, on_inject=got.append)
    ch.start(Hello(rank=1))
    conn, _ = srv.accept()
    try:
        conn.sendall(b'{"op":"inject","kind":"uce-low","step":4,"phase":"backward"}\n')
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == [Inject(kind="uce-low", step=4, phase="backward")]
        ch.update(waiting=True)
        msgs = read_messages(
            conn, lambda m: any(x["op"] == "heartbeat" and x["waiting"] for x in m)
        )
        assert any(m["op"] == "heartbeat" and m["waiting"] is True for m in msgs)
    finally:
        ch.close(bye=False)
        conn.close()


def test_a_wait_probe_is_asked_while_nothing_changes_and_its_answer_rides_the_heartbeat(server):
    """rt.ddp's C++ waits cannot say they wait: the writer asks the probe (every PERIOD_S, even
    with no progress) and ORs its answer into `waiting`; it turns false again when the probe
    does."""
    path, srv = server
    answer = {"waiting": False}
    asked: list[float] = []

    def probe() -> bool:
        asked.append(time.monotonic())
        return answer["waiting"]

    ch = AgentChannel(path, 2, StopSignal(), print, heartbeat_interval=5.0)
    ch.start(Hello(rank=2))
    conn, _ = srv.accept()
    try:
        ch.set_wait_probe(probe)
        answer["waiting"] = True
        msgs = read_messages(
            conn, lambda m: any(x["op"] == "heartbeat" and x["waiting"] for x in m)
        )
        assert any(
            m["op"] == "heartbeat" and m["waiting"] for m in msgs
        )  # no progress, 5 s interval
        answer["waiting"] = False
        msgs = read_messages(
            conn, lambda m: any(x["op"] == "heartbeat" and not x["waiting"] for x in m)
        )
        assert any(m["op"] == "heartbeat" and not m["waiting"] for m in msgs)
        assert len(asked) >= 2
    finally:
        ch.close(bye=False)
        conn.close()


def test_a_progress_source_is_read_without_the_training_thread_calling_the_channel(server):
    """The runtime only stores its phase: the writer reads the source every MIN_HEARTBEAT_GAP and
    sends what changed; wake() sends at once (a recovery starting) even with a long interval."""
    path, srv = server
    now = {"v": (3, "forward", 2, None)}
    ch = AgentChannel(path, 0, StopSignal(), print, heartbeat_interval=30.0)
    ch.start(Hello(rank=0))
    conn, _ = srv.accept()
    try:
        ch.set_progress_source(lambda: now["v"])
        msgs = read_messages(
            conn, lambda m: any(x["op"] == "heartbeat" and x["phase"] == "forward" for x in m)
        )
        assert any(
            m["op"] == "heartbeat"
            and (m["step"], m["phase"], m["committed_step"]) == (3, "forward", 2)
            for m in msgs
        )
        now["v"] = (3, "committed", 3, 0.25)  # no call into the channel: the writer polls
        msgs = read_messages(
            conn, lambda m: any(x["op"] == "heartbeat" and x["phase"] == "committed" for x in m)
        )
        beat = next(m for m in msgs if m["op"] == "heartbeat" and m["phase"] == "committed")
        assert (beat["committed_step"], beat["step_s"]) == (3, 0.25)
        now["v"] = (4, "recovering", 3, None)
        t0 = time.monotonic()
        ch.wake()
        msgs = read_messages(
            conn, lambda m: any(x["op"] == "heartbeat" and x["phase"] == "recovering" for x in m)
        )
        assert any(m["op"] == "heartbeat" and m["phase"] == "recovering" for m in msgs)
        assert time.monotonic() - t0 < 1.0
    finally:
        ch.close(bye=False)
        conn.close()


def test_the_last_progress_goes_before_the_bye(server):
    # a finished run's view showed step 5 of 8: the steps committed after the last heartbeat
    # (within MIN_HEARTBEAT_GAP of the end) never reached the agent, the bye went alone
    path, srv = server
    ch = AgentChannel(path, 0, StopSignal(), lambda _m: None, heartbeat_interval=30.0)
    progress = {"now": (0, "forward", -1, None)}
    ch.start(Hello(rank=0, local_rank=0, pid=os.getpid(), generation=0, replacement=False))
    conn, _ = srv.accept()
    try:
        ch.set_progress_source(lambda: progress["now"])
        read_messages(conn, lambda m: any(x["op"] == "heartbeat" for x in m))
        progress["now"] = (7, "done", 7, None)  # the last steps, then at once the goodbye
        ch.close(bye=True)
        msgs = read_messages(conn, lambda m: any(x["op"] == "bye" for x in m))
        assert msgs[-1]["op"] == "bye"
        beats = [m for m in msgs if m["op"] == "heartbeat"]
        assert beats and (beats[-1]["step"], beats[-1]["committed_step"]) == (7, 7), msgs
    finally:
        conn.close()
