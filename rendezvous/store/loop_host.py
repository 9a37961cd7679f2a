"""The cold half of the store's event-loop server: everything but the turn itself.

Owns: `LoopHost`, the base of `rendezvous.store.server.LoopServer` (whose `__init__` sets the
state both halves share): binding the listening socket (`bind_listener`), start / stop /
teardown and the context manager, admitting connections (`_accept` in Python, `_adopt` for
what the C `loop_turn` accepted, `_admit`: refused past `max_connections`), closing one
(`_close` and its `_on_close` hook), the once-a-second sweep of connections without a
handshake or with a stalled frame, and running a function on the loop thread
(`call_soon_threadsafe`). None of it runs per request: the hot path (read, execute, reply)
stays in `LoopServer`.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import threading
import time
from collections import deque
from typing import Callable

from rendezvous.kv import StoreError
from rendezvous.store import protocol as P
from rendezvous.store.connection import Conn, peer_str
from rendezvous.store.loop_priority import LoopPriority

_EPOLLIN = select.EPOLLIN


class LoopHost:
    """Lifecycle, admission and housekeeping of a loop server (see the module docstring).
    Subclasses provide `_run` (the loop thread) and may override the hooks `_on_start`,
    `_on_close`, `_end_turn`, `_poll_timeout`, `_turn_hold` and `_extra_event`."""

    # set by LoopServer.__init__ (and by start() / the loop thread)
    host: str
    token: str | None
    limits: P.Limits
    log: Callable[[str], None]
    stats: dict
    _name: str
    _accepts_per_turn: int
    _req_port: int
    _port: int
    _lsock: socket.socket | None
    _ep: select.epoll | None
    _wake_fd: int
    _thread: threading.Thread | None
    _stopping: bool
    _stopped: bool
    _lock: threading.Lock
    _conns: dict[int, Conn]
    _xq: deque
    _loop_ident: int
    _priority: LoopPriority

    def _run(self) -> None:
        raise NotImplementedError

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        return f"{self.host}:{self._port}"

    def start(self) -> "LoopHost":
        with self._lock:
            if self._thread is not None:
                return self
            if self._stopped:
                raise StoreError(f"this {type(self).__name__} was stopped; create a new one")
            self._lsock = bind_listener(self.host, self._req_port)
            self._port = self._lsock.getsockname()[1]
            self._ep = select.epoll()
            self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._ep.register(self._lsock.fileno(), _EPOLLIN)
            self._ep.register(self._wake_fd, _EPOLLIN)
            try:
                self._on_start()
            except BaseException:
                self._cleanup()
                raise
            self._thread = threading.Thread(
                target=self._run, name=f"ftrun-{self._name}:{self._port}", daemon=True
            )
            self._thread.start()
        return self

    def _on_start(self) -> None:
        """Hook: runs in start() after binding, before the loop thread starts."""

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._stopping = True
            t = self._thread
        if t is not None:
            os.eventfd_write(self._wake_fd, 1)
            t.join(timeout=10.0)
        self._cleanup()

    def _cleanup(self) -> None:
        for c in list(self._conns.values()):
            self._close(c)
        self._conns.clear()
        if self._lsock is not None:
            self._lsock.close()
        if self._ep is not None:
            self._ep.close()
        if self._wake_fd >= 0:
            os.close(self._wake_fd)
            self._wake_fd = -1

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def connection_count(self) -> int:
        return len(self._conns)

    # -- admission ---------------------------------------------------------------------

    def _accept(self) -> None:
        """Accept up to `_accepts_per_turn` connections. With `loop_turn` (the C extension)
        new connections are accepted in C and adopted by `_adopt`; this runs for what C hands
        back (the connection limit reached: refused here with the log line; an accept error:
        logged here) and whenever the extension is absent or off."""
        now = time.monotonic()
        lim = self.limits.max_connections
        for _ in range(self._accepts_per_turn):  # the rest next turn (level-triggered): fair
            try:
                s, addr = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.log(f"{self._name} accept failed: {e.strerror}")
                return
            peer = peer_str(addr)
            if len(self._conns) >= lim:
                self.log(f"{self._name} refused {peer}: {lim} connections open (max_connections)")
                s.close()
                self.stats["dropped"] += 1
                continue
            try:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            self._admit(s, peer, now)

    def _accept_in_c(self) -> tuple:
        """What `loop_turn` needs to accept new connections in the turn (adopting each through
        `_adopt`) up to the connection limit; past it, or on an error, the event goes to
        `_accept`: (listening fd, max_connections, accepts per turn, `_adopt`)."""
        lfd = self._lsock.fileno()
        return (lfd, self.limits.max_connections, self._accepts_per_turn, self._adopt)

    def _adopt(self, fd: int, peer: str) -> None:
        """A connection `loop_turn` accepted (non-blocking, TCP_NODELAY set): what `_accept`
        does after its accept. Owns `fd` from the call on (closed here if no socket object
        could be made for it)."""
        try:
            s = socket.socket(self._lsock.family, socket.SOCK_STREAM, 0, fd)
        except BaseException:
            os.close(fd)
            raise
        self._admit(s, peer, time.monotonic())

    def _admit(self, s: socket.socket, peer: str, now: float) -> None:
        """An accepted socket becomes a served connection: non-blocking, registered for
        reads, counted (and the loop's priority follows the connection count)."""
        s.setblocking(False)
        c = Conn(s, peer, self.token is None, now)
        self._conns[c.fd] = c
        self._ep.register(c.fd, _EPOLLIN)
        self.stats["accepted"] += 1
        if len(self._conns) > self._priority.max_connections:
            self._priority.update(len(self._conns))

    # -- teardown and housekeeping -----------------------------------------------------

    def _close(self, c: Conn) -> None:
        """Close `c` once: the `_on_close` hook, then unregister and close its socket."""
        if c.closed:
            return
        c.closed = True
        try:
            self._on_close(c)
        except Exception as e:  # pragma: no cover - a hook bug must not leak the socket
            self.log(f"{self._name}: close hook failed for {c.peer}: {e}")
        self._conns.pop(c.fd, None)
        try:
            self._ep.unregister(c.fd)
        except (OSError, ValueError):
            pass
        try:
            c.sock.close()
        except OSError:
            pass

    def _on_close(self, c: Conn) -> None:
        """Hook: connection `c` is being closed."""

    def _sweep(self, now: float) -> None:
        """Close the connections that sent no VALIDATE within handshake_timeout or left a
        frame incomplete for stalled_frame_timeout (once a second, from the loop)."""
        hs = self.limits.handshake_timeout
        st = self.limits.stalled_frame_timeout
        for c in list(self._conns.values()):
            if not c.validated and now - c.since > hs:
                self.log(f"{self._name} closed {c.peer}: no VALIDATE within {hs:g} s")
            elif c.partial_since and now - c.partial_since > st:
                self.log(f"{self._name} closed {c.peer}: request incomplete for {st:g} s")
            else:
                continue
            self.stats["dropped"] += 1
            self._close(c)

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop thread (now, when called from it)."""
        if threading.get_ident() == self._loop_ident:
            fn()
            return
        self._xq.append(fn)
        try:
            os.eventfd_write(self._wake_fd, 1)
        except OSError:
            pass

    def _count_turn(self, busy: float, c0: float) -> None:
        """Add a Python turn that took `busy` s (thread CPU time at its start: `c0`) to the
        stats: total busy time, and the longest turn with its CPU time."""
        stats = self.stats
        stats["busy_s"] += busy
        if busy > stats["max_turn_s"]:
            stats["max_turn_s"] = busy
            stats["max_turn_cpu_s"] = time.thread_time() - c0

    def _count_c_turn(
        self, reads: int, requests: int, busy: float, max_s: float, max_cpu: float
    ) -> None:
        """Add what a `loop_turn` call did in C to the stats: its reads and requests, its busy
        time, and its longest turn (with that turn's CPU time) when it is the longest yet."""
        stats = self.stats
        stats["reads"] += reads
        stats["requests"] += requests
        stats["busy_s"] += busy
        if max_s > stats["max_turn_s"]:
            stats["max_turn_s"], stats["max_turn_cpu_s"] = max_s, max_cpu

    def _drain_xq(self) -> None:
        """Run what other threads queued with `call_soon_threadsafe` (on the loop thread)."""
        xq = self._xq
        while xq:
            xq.popleft()()

    # -- hooks of the loop -------------------------------------------------------------

    def _end_turn(self) -> None:
        """Hook: runs once per loop turn, after all ready sockets were handled."""

    def _poll_timeout(self) -> float:
        """Hook: longest the loop may sleep when nothing happens."""
        return 1.0

    def _turn_hold(self) -> float:
        """Hook: how long (s) `loop_turn` may hold a proxy's new batch in C; 0: not at all."""
        return 0.0

    def _extra_event(self, fd: int, ev: int) -> None:
        """Hook: an event on a registered fd that is not a client connection."""


def bind_listener(host: str, port: int) -> socket.socket:
    """A non-blocking listening TCP socket on `host`:`port` (0: any free port; an IPv6
    socket also takes IPv4); StoreError naming host:port and why when it cannot."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        if fam == socket.AF_INET and host not in ("", "0.0.0.0"):
            infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM)
            fam = infos[0][0]
            addr = infos[0][4]
        else:
            addr = (host or "0.0.0.0", port)
    except socket.gaierror as e:
        raise StoreError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    s = socket.socket(fam, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if fam == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind(addr)
        s.listen(65535)
        s.setblocking(False)
    except OSError as e:
        s.close()
        why = "address already in use" if e.errno == errno.EADDRINUSE else e.strerror
        raise StoreError(f"cannot listen on {host}:{port}: {why}") from None
    return s
