"""A blocking `KVStore` client over torch's TCPStore wire protocol.

Owns: `connect` (a store connection, retried until its timeout; the proxy's upstream link
uses it too) and `StoreClient`, which talks to anything that speaks the protocol: ftrun's embedded
server, an ftrun node proxy, or torch's own TCPStore server (LIST_KEYS is part of the torch
2.13+ protocol, so `keys()` and `delete_prefix()` work everywhere; auth needs ftrun's server).

Each thread gets its own connection (created on first use, with the torch handshake and the
job token when one is set), so blocking WAITs in one thread never hold up another. A WAIT that
runs out of time is withdrawn with CANCEL_WAIT exactly like torch's client does. A dead
connection is dropped and re-opened by the thread's next call.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Any, Callable, Iterable, Iterator

from rendezvous.kv import KVStore, StoreAuthError, StoreError, StoreTimeout, check_timeout
from rendezvous.store import protocol as P
from rendezvous.store.auth import AUTH_KEY, check_token
from rendezvous.store.protocol import logical_keys, wire_key

TRY_GET_ATTEMPTS = 3  # CHECK+GET pairs try_get makes before an empty value is taken as the value


def connect(
    host: str,
    port: int,
    timeout: float,
    what: str = "cannot connect to the store",
    call_timeout: float | None = None,
) -> socket.socket:
    """A TCP connection to a store (TCP_NODELAY, `call_timeout` (default `timeout`) on every
    later call), retried until `timeout` s have passed; StoreError "<what> at host:port within
    T s: <last error>", or naming the host at once when it does not resolve."""
    deadline = time.monotonic() + timeout
    last = "no attempt"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise StoreError(f"{what} at {host}:{port} within {timeout:g} s: {last}")
        try:
            s = socket.create_connection((host, port), timeout=min(left, 5.0))
        except socket.gaierror as e:
            raise StoreError(f"cannot resolve store host {host!r}: {e.strerror}") from None
        except OSError as e:
            last = e.strerror or str(e) or type(e).__name__
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
            continue
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(timeout if call_timeout is None else call_timeout)
        return s


class _Link:
    """One connected socket plus its unread bytes."""

    __slots__ = ("sock", "buf", "owner", "caps")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.owner = threading.get_ident()  # the thread whose connection it is
        self.caps = 0  # the server's extensions (protocol.CAP_*), from the handshake


class StoreClient(KVStore):
    """`KVStore` over TCP; thread-safe (one connection per calling thread). Another thread's
    blocking WAIT can be ended with `interrupt_waits` (its connection is shut down).

    `timeout` bounds every call (and connecting, after the first connection); `connect_timeout`
    (default `timeout`) is how long the first connection may take: an agent waits up to
    join_timeout for the store host to come up, but once joined its calls use read_timeout."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str | None = None,
        timeout: float = 30.0,
        connect_timeout: float | None = None,
    ) -> None:
        if not isinstance(port, int) or not 0 < port <= 65535:
            raise ValueError(f"store port {port!r}: must be an integer in 1-65535")
        self.host = host
        self.port = port
        self.token = check_token(token) if token is not None else None
        self.timeout = check_timeout(timeout)
        self._first_connect: float | None = (
            None if connect_timeout is None else check_timeout(connect_timeout)
        )
        self._local = threading.local()
        self._links: set[_Link] = set()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # -- connection management -----------------------------------------------------------

    def _link(self) -> _Link:
        if self._closed:
            raise StoreError(f"store client for {self.address} is closed")
        link = getattr(self._local, "link", None)
        if link is not None:
            return link
        first, self._first_connect = self._first_connect, None
        link = _Link(
            connect(
                self.host,
                self.port,
                self.timeout if first is None else first,
                call_timeout=self.timeout,
            )
        )
        self._local.link = link
        with self._lock:
            self._links.add(link)
        try:
            self._handshake(link)
        except socket.timeout:  # a peer that accepts but never answers: a store error too
            self._drop(link)
            raise StoreTimeout(
                f"store at {self.address} did not answer the handshake within {self.timeout:g} s"
            ) from None
        except OSError as exc:  # shut down meanwhile (interrupt_waits) or reset by the peer
            self._drop(link)
            raise StoreError(
                f"store at {self.address}: connection lost during the handshake: {exc}"
            ) from None
        except BaseException:
            self._drop(link)
            raise
        return link

    def _handshake(self, link: _Link) -> None:
        # the handshake's PING asks for ftrun's extensions: torch's server and the node proxy
        # echo the nonce (none), ftrun's server answers it with its extension bits set
        link.sock.sendall(P.handshake_bytes(P.CAPS_NONCE))
        caps = self._read(link, P.Reply.U32) ^ P.CAPS_NONCE
        if caps & ~P.CAP_WAIT_VALUES:
            raise StoreError(f"store at {self.address} answered the handshake wrongly")
        link.caps = caps
        nonce = os.getpid() & 0xFFFFFFFF
        if self.token is not None:
            auth = P.encode_request(P.Request(P.Op.SET, (AUTH_KEY,), (self.token.encode(),)))
            ping = P.encode_request(P.Request(P.Op.PING, num=nonce ^ 0x5A5A))
            try:
                link.sock.sendall(auth + ping)
                ok = self._read(link, P.Reply.U32) == nonce ^ 0x5A5A
            except StoreError:
                ok = False
            if not ok:
                raise StoreAuthError(f"store at {self.address} refused the job token")

    interruptible_waits = True

    def interrupt_waits(self, thread: threading.Thread) -> None:
        """Shut down `thread`'s connection: a WAIT it blocks in ends at once with StoreError
        (and the thread's next call opens a new connection). A thread that ended is left
        alone (its id may belong to another thread by now)."""
        if not thread.is_alive():
            return
        with self._lock:
            links = [link for link in self._links if link.owner == thread.ident]
        for link in links:
            try:
                link.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def release_thread(self) -> None:
        link = getattr(self._local, "link", None)
        if link is not None:
            self._drop(link)

    def _drop(self, link: _Link) -> None:
        if getattr(self._local, "link", None) is link:
            self._local.link = None
        with self._lock:
            self._links.discard(link)
        try:
            link.sock.close()
        except OSError:
            pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links = list(self._links)
            self._links.clear()
        for link in links:
            try:
                link.sock.close()
            except OSError:
                pass

    # -- request plumbing ----------------------------------------------------------------

    def _read(self, link: _Link, shape: int, count: int = 0):
        buf = link.buf
        while True:
            if buf:
                r = P.parse_reply(buf, 0, shape, count)
                if r is not None:
                    del buf[: r[1]]
                    return r[0]
            elif shape == P.Reply.NONE:
                return None
            try:
                chunk = link.sock.recv(P.READ_SIZE)
            except socket.timeout:
                raise
            except OSError as e:
                raise StoreError(
                    f"lost the connection to the store at {self.address}: {e.strerror or e}"
                ) from None
            if not chunk:
                raise StoreError(
                    f"the store at {self.address} closed the connection"
                    + (" (no job token given?)" if self.token is None else "")
                )
            buf += chunk

    @contextlib.contextmanager
    def _using(self, link: _Link, what: str) -> Iterator[None]:
        """Map a failed exchange on `link` to StoreTimeout/StoreError and drop the link."""
        try:
            yield
        except socket.timeout:
            self._drop(link)
            raise StoreTimeout(
                f"store at {self.address} did not answer {what} within {self.timeout:g} s"
            ) from None
        except StoreError:
            self._drop(link)
            raise
        except OSError as e:
            self._drop(link)
            raise StoreError(
                f"lost the connection to the store at {self.address}: {e.strerror or e}"
            ) from None

    def _call(self, req: P.Request, count: int = 0):
        link = self._link()
        with self._using(link, P.OP_NAMES[req.op]):
            link.sock.sendall(P.encode_request(req))
            return self._read(link, P.REPLY_OF[req.op], count)

    def _wait_wire(self, wks: tuple, timeout: float) -> bool:
        return self._await(P.Op.WAIT, wks, timeout, lambda link: True) is not None

    def _await(self, op: int, wks: tuple, timeout: float, woken: Callable[[_Link], Any]) -> Any:
        """WAIT or FT_WAIT_VALUES on `wks` for up to `timeout` s: `woken(link)` reads what follows
        the wake-up's STOP_WAITING (nothing for a WAIT, the values for FT_WAIT_VALUES); None
        when the time ran out (the wait withdrawn with CANCEL_WAIT)."""
        link = self._link()
        with self._using(link, "CANCEL_WAIT"):
            link.sock.sendall(P.encode_request(P.Request(op, wks)))
            link.sock.settimeout(max(timeout, 1e-3))
            try:
                r = self._read(link, P.Reply.U8)
            except socket.timeout:
                r = None
            finally:
                link.sock.settimeout(self.timeout)
            if r is not None:
                return woken(link) if r == P.STOP_WAITING else None
            link.sock.sendall(bytes((P.Op.CANCEL_WAIT,)))
            if self._read(link, P.Reply.U8) != P.STOP_WAITING:
                return None
            got = woken(link)  # satisfied just before the cancel arrived
            self._read(link, P.Reply.U8)  # then the cancel's WAIT_CANCELED
            return got

    # -- KVStore -------------------------------------------------------------------------

    def set(self, key: str, value: bytes) -> None:
        self._call(P.Request(P.Op.SET, (wire_key(key),), (bytes(value),)))

    def get(self, key: str, timeout: float) -> bytes:
        timeout = check_timeout(timeout)
        wk = wire_key(key)
        if not self._wait_wire((wk,), timeout):
            raise StoreTimeout(
                f"key {key!r} did not appear in the store at {self.address} within {timeout:g} s"
            )
        return self._call(P.Request(P.Op.GET, (wk,)))

    def try_get(self, key: str) -> bytes | None:
        # CHECK then GET is two requests: a key deleted between them GETs as b"" (the server
        # answers a missing key with an empty value), which is not what the key held. An empty
        # answer is checked again: missing now is None, present is read again.
        wk = wire_key(key)
        value = b""
        for _ in range(TRY_GET_ATTEMPTS):
            if self._call(P.Request(P.Op.CHECK, (wk,))) != P.READY:
                return None
            value = self._call(P.Request(P.Op.GET, (wk,)))
            if value:
                return value
        return value  # present every time and empty every time: its value is b""

    def add(self, key: str, amount: int) -> int:
        return self._call(P.Request(P.Op.ADD, (wire_key(key),), (), int(amount)))

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call(
            P.Request(P.Op.COMPARE_SET, (wire_key(key),), (bytes(expected), bytes(desired)))
        )

    def wait(self, keys: Iterable[str], timeout: float) -> bool:
        timeout = check_timeout(timeout)
        return self._wait_wire(tuple(wire_key(k) for k in keys), timeout)

    def wait_values(self, keys: Iterable[str], timeout: float) -> list[bytes] | None:
        """One FT_WAIT_VALUES where the server answers it (ftrun's), else WAIT then MULTI_GET."""
        timeout = check_timeout(timeout)
        wks = tuple(wire_key(k) for k in keys)
        if not self._link().caps & P.CAP_WAIT_VALUES:
            return super().wait_values(list(keys), timeout)
        values = lambda link: self._read(link, P.Reply.MULTI, len(wks))  # noqa: E731
        return self._await(P.Op.FT_WAIT_VALUES, wks, timeout, values)

    def delete(self, key: str) -> bool:
        return self._call(P.Request(P.Op.DELETE_KEY, (wire_key(key),))) > 0

    def keys(self, prefix: str = "") -> list[str]:
        return logical_keys(self._call(P.Request(P.Op.LIST_KEYS)), prefix)

    # -- extras (torch ops beyond KVStore) -----------------------------------------------

    def check(self, keys: Iterable[str]) -> bool:
        return self._call(P.Request(P.Op.CHECK, tuple(wire_key(k) for k in keys))) == P.READY

    def num_keys(self) -> int:
        return self._call(P.Request(P.Op.GETNUMKEYS))

    def append(self, key: str, value: bytes) -> None:
        self._call(P.Request(P.Op.APPEND, (wire_key(key),), (bytes(value),)))

    def multi_set(self, items: dict[str, bytes]) -> None:
        ks = tuple(wire_key(k) for k in items)
        self._call(P.Request(P.Op.MULTI_SET, ks, tuple(bytes(v) for v in items.values())))

    def present(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        wks = tuple(wire_key(k) for k in keys)
        got = self._call(P.Request(P.Op.MULTI_GET, wks), count=len(wks))
        return [v if v else None for v in got]

    def multi_get(self, keys: list[str], timeout: float) -> list[bytes]:
        wks = tuple(wire_key(k) for k in keys)
        if not self._wait_wire(wks, check_timeout(timeout)):
            raise StoreTimeout(f"keys {keys!r} did not all appear within {timeout:g} s")
        return self._call(P.Request(P.Op.MULTI_GET, wks), count=len(wks))

    def ping(self) -> float:
        """Round-trip time in seconds."""
        t = time.perf_counter()
        self._call(P.Request(P.Op.PING, num=12345))
        return time.perf_counter() - t
