"""The agent's end of the worker channel: a Unix socket for runtime-aware workers.

Owns: listening on `FTRUN_AGENT_SOCKET`, reading the workers' messages
(`launcher.protocol.messages`: Hello, Heartbeat, FaultReport, Recovered, Bye), handing them to the
agent as `ChannelMessage` events (a connection is tied to its rank by its Hello), and pushing
messages (Stop, Inject) to a rank's connection, and `connecting(pid)`: whether a process has a
connection open or may have one pending (a cold replacement a warm spare may still overtake
has none). `keep(rank, pid)` holds a rank's messages on one process's connection while a second
process of the rank connects (a hot switch's incoming process: its Hello is set aside until
`release`). Lines that are not valid messages are dropped (counted in `malformed`). One thread
(selectors); `stop()` closes every connection and removes the socket file so no stale socket is
left behind.
"""

from __future__ import annotations

import os
import queue
import select
import selectors
import socket
import struct
import threading
from dataclasses import dataclass

from launcher.protocol.messages import Hello, Message, MessageError, decode, encode

MAX_LINE = 1 << 20


@dataclass
class ChannelMessage:
    rank: int | None  # from the connection's Hello (None before it)
    pid: int | None
    msg: Message


def _peer_pid(conn: socket.socket) -> int | None:
    """The pid of the process at the other end of a Unix connection (SO_PEERCRED)."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", raw)[0]
    except (OSError, AttributeError):
        return None


class ChannelServer:
    def __init__(self, path: str, events: "queue.Queue[object]") -> None:
        self.path = path
        self.events = events
        if os.path.exists(path):
            os.unlink(path)
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(path)
        os.chmod(path, 0o600)
        self._srv.listen(256)
        self._srv.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._srv, selectors.EVENT_READ, None)
        self._conns: dict[socket.socket, dict] = {}
        self._by_rank: dict[int, socket.socket] = {}
        self._kept: dict[int, int | None] = {}  # rank -> the pid its messages stay with
        self._aside: dict[int, socket.socket] = {}  # rank -> a kept rank's other connection
        self._lock = threading.Lock()
        self.malformed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftrun-channel", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ready = self._sel.select(timeout=0.5)
            except (OSError, ValueError):
                return
            for key, _ in ready:
                if key.data is None:
                    with self._lock:  # accepted and known as one step (`connecting`)
                        try:
                            conn, _ = self._srv.accept()
                        except OSError:
                            continue
                        conn.setblocking(False)
                        self._conns[conn] = {
                            "buf": b"",
                            "rank": None,
                            "pid": None,
                            "peer": _peer_pid(conn),
                        }
                    self._sel.register(conn, selectors.EVENT_READ, "conn")
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]

    def _read(self, conn: socket.socket) -> None:
        st = self._conns.get(conn)
        if st is None:
            return
        try:
            data = conn.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        st["buf"] += data
        if len(st["buf"]) > MAX_LINE and b"\n" not in st["buf"]:
            self._drop(conn)
            return
        *lines, st["buf"] = st["buf"].split(b"\n")
        for line in lines:
            if not line.strip():
                continue
            try:
                msg = decode(line)
            except MessageError:
                self.malformed += 1
                continue
            if isinstance(msg, Hello):
                st["rank"], st["pid"] = msg.rank, msg.pid
                with self._lock:
                    if self._kept.get(msg.rank, msg.pid) != msg.pid:
                        self._aside[msg.rank] = conn  # not the kept process: until `release`
                    else:
                        self._by_rank[msg.rank] = conn
            self.events.put(ChannelMessage(st["rank"], st["pid"], msg))

    def _drop(self, conn: socket.socket) -> None:
        with self._lock:
            st = self._conns.pop(conn, None)
            if st and st["rank"] is not None and self._by_rank.get(st["rank"]) is conn:
                del self._by_rank[st["rank"]]
            if st and st["rank"] is not None and self._aside.get(st["rank"]) is conn:
                del self._aside[st["rank"]]
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def send(self, rank: int, msg: Message, pid: int | None = None) -> bool:
        """Push one message to `rank`'s connection (with `pid`: only when that process said
        hello on it; a killed predecessor's connection may still take bytes while the kernel
        tears the process down, and they would be lost). False when it has no such live
        connection."""
        data = encode(msg)
        with self._lock:
            conn = self._by_rank.get(rank)
            if conn is None:
                return False
            if pid is not None and self._conns.get(conn, {}).get("pid") != pid:
                return False
            try:
                conn.setblocking(True)
                conn.settimeout(2.0)
                conn.sendall(data)
                return True
            except OSError:
                return False
            finally:
                try:
                    conn.setblocking(False)
                except OSError:
                    pass

    def keep(self, rank: int, pid: int | None) -> None:
        """`rank`'s messages stay with process `pid`'s connection: a Hello of another process
        for the rank is set aside until `release`."""
        with self._lock:
            self._kept[rank] = pid

    def release(self, rank: int, promote: bool) -> None:
        """End `keep(rank)`: with `promote`, the connection set aside (if any) becomes the
        rank's; else it stays out (its process is being stopped)."""
        with self._lock:
            self._kept.pop(rank, None)
            conn = self._aside.pop(rank, None)
            if promote and conn is not None and conn in self._conns:
                self._by_rank[rank] = conn

    def connecting(self, pid: int) -> bool:
        """Whether process `pid` has a connection to this channel, or may have one waiting to
        be accepted (any pending connection counts: whose it is is not known before)."""
        with self._lock:
            if any(st.get("peer") == pid for st in self._conns.values()):
                return True
            try:
                return bool(select.select([self._srv], [], [], 0)[0])
            except (OSError, ValueError):
                return True  # closed: nothing may be decided on it

    def connected_ranks(self) -> set[int]:
        with self._lock:
            return set(self._by_rank)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(3.0)
        with self._lock:
            conns = list(self._conns)
            self._conns.clear()
            self._by_rank.clear()
        for c in conns:
            c.close()
        self._sel.close()
        self._srv.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
