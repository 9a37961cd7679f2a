"""The agent's worker channel: messages in, stop pushed out, no stale socket left."""
from __future__ import annotations

import json
import os
import queue
import socket

from launcher.channel import ChannelMessage, ChannelServer


def test_hello_heartbeat_and_push(tmp_path) -> None:
    q: queue.Queue = queue.Queue()
    path = str(tmp_path / "a.sock")
    srv = ChannelServer(path, q)
    try:
        c = socket.socket(socket.AF_UNIX)
        c.connect(path)
        c.sendall(b'{"op":"hello","rank":3,"pid":99}\n{"op":"heartbeat","rank":3,"step":1}\nnot json\n')
        m1, m2 = q.get(timeout=5), q.get(timeout=5)
        assert isinstance(m1, ChannelMessage) and m1.rank == 3 and m1.msg["op"] == "hello"
        assert m2.msg == {"op": "heartbeat", "rank": 3, "step": 1} and m2.pid == 99
        assert srv.connected_ranks() == {3}
        assert srv.send(3, {"op": "stop", "generation": 2})
        c.settimeout(5)
        assert json.loads(c.recv(4096).decode().strip()) == {"op": "stop", "generation": 2}
        assert not srv.send(4, {"op": "stop"})
        c.close()
    finally:
        srv.stop()
    assert not os.path.exists(path)
