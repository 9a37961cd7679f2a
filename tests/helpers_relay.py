"""Test helper: a TCP relay whose "link" can be cut, for partitions inside one process.

Owns: `Relay`, which listens on a free loopback port and forwards every connection to a target
(etcd, an embedded store). `cut()` pauses forwarding in both directions without closing
anything, like a link that is down: bytes stay in the kernel buffers, calls through it hang
until their own timeouts, and after `heal()` everything buffered is delivered (as TCP
retransmission would). `close()` stops the relay and every connection. The multi-host version
of the same fault is `helpers_netns.Host.link(False)`.
"""

from __future__ import annotations

import socket
import threading


class Relay:
    """127.0.0.1:<port> -> (host, port). Use as a context manager or call close()."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self._up = threading.Event()
        self._up.set()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._lsock = socket.socket()
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._lsock.bind(("127.0.0.1", 0))
        self._lsock.listen(64)
        self._lsock.settimeout(0.1)
        self.port = self._lsock.getsockname()[1]
        self._spawn(self._accept)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self) -> None:
        """The link goes down: nothing passes until heal()."""
        self._up.clear()

    def heal(self) -> None:
        self._up.set()

    def close(self) -> None:
        self._closed.set()
        self._up.set()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in [self._lsock, *socks]:
            try:
                s.close()
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=2.0)

    def __enter__(self) -> "Relay":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name="test-relay")
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._lsock.accept()
            except (socket.timeout, OSError):
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5.0)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.settimeout(0.1)
            with self._lock:
                self._socks += [client, upstream]
            self._spawn(self._pump, client, upstream)
            self._spawn(self._pump, upstream, client)

    def _send(self, dst: socket.socket, data: bytes) -> bool:
        view = memoryview(data)
        while view and not self._closed.is_set():
            try:
                view = view[dst.send(view) :]
            except socket.timeout:
                continue
            except OSError:
                return False
        return not view

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while not self._closed.is_set():
            if not self._up.wait(0.1):
                continue  # link down: leave the bytes where they are
            try:
                data = src.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                break
            if not data:
                break
            if not self._send(dst, data):
                break
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
