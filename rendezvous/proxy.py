"""The per-node store proxy: local workers speak TCPStore to it; it forwards upstream.

Owns: `StoreProxy`, which listens on loopback, serves the full TCPStore protocol to unmodified
torch clients, and forwards their ops over one upstream link: a multiplexed connection to an
ftrun `StoreServer` (given as `(host, port, token)`), or any `KVStore` (e.g. `EtcdKV`; given as
an instance or a zero-argument factory) driven from a worker thread.

Batching and coalescing (per event-loop turn). All requests that arrived in one loop turn form
a batch. The batch is cut into *rounds*: round i holds the i-th pending op of every client, so
one round never holds two ops of the same client and its ops are concurrent; rounds go upstream
in order, so each client's own order is kept. Within a round:
  - all SET / MULTI_SET become one MULTI_SET (in arrival order);
  - ADDs to one key become one ADD of the sum; the caller that came j-th gets
    `final - sum + (a_1 + ... + a_j)`, a valid serial order of those concurrent adds;
  - identical GETs become one GET (never merged with a GET already sent: that one may have
    been answered from a state older than the new request);
  - WAITs for the same key set join one upstream WAIT, even one sent in an earlier turn:
    when it fires, the keys exist, which is after every joined waiter asked.
Nothing is cached: every answer comes from the upstream after the request arrived, so no
stale value is ever served (values of keys that can never change could be cached, but the
protocol cannot tell which keys those are). While requests are in flight upstream, new ones
are held for at most `max_hold` s so a burst becomes one round (Nagle-style; an idle proxy
forwards at once). CANCEL_WAIT detaches the caller; the upstream wait is cancelled
when nobody is left on it. PING and VALIDATE are answered locally. The master thus sees
O(nodes) connections and, for the process-group init pattern, O(1) requests per node per
phase instead of O(ranks).

With a KVStore upstream, wire keys map to logical keys by dropping the leading "/"; the few
keys torch sends without it (its `init/` counter) live under "ftrun/wire/". Queue ops need
ftrun's server upstream; with a KVStore they close the client connection with a clear line.
"""
from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from rendezvous import protocol as P
from rendezvous.auth import AUTH_KEY, check_token
from rendezvous.kv import KVStore, StoreAuthError, StoreError
from rendezvous.server import DropConnection, LoopServer, ServerLimits, _Conn

Op = P.Op
_NO_REPLY = frozenset((Op.SET, Op.MULTI_SET, Op.APPEND, Op.QUEUE_PUSH))
_WAIT_CANCELED = bytes((P.WAIT_CANCELED,))
_FAST_OPS = frozenset((Op.SET, Op.GET, Op.ADD, Op.WAIT, Op.CHECK, Op.MULTI_GET,
                       Op.COMPARE_SET, Op.DELETE_KEY))
_STOP = bytes((P.STOP_WAITING,))


class _Group:
    """Local callers sharing one upstream WAIT (or one BARRIER caller)."""

    __slots__ = ("key", "handle", "members")

    def __init__(self, key) -> None:
        self.key = key
        self.handle = None
        self.members: list = []


# ----------------------------------------------------------------------------- upstreams


class _MuxUpstream:
    """A pipelined, multiplexed link to an ftrun StoreServer, driven by the proxy's loop."""

    def __init__(self, proxy: "StoreProxy", host: str, port: int, token: str | None,
                 timeout: float) -> None:
        self.proxy = proxy
        self.host, self.port = host, port
        self.token = check_token(token) if token is not None else None
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self.fd = -1
        self.tag = 0
        self.pending: dict[int, tuple] = {}
        self.cancels: dict[int, int] = {}
        self.out: list = []
        self.rest = b""
        self.inbuf = bytearray()
        self.want_write = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        self._connect()

    def _connect(self, timeout: float | None = None) -> None:
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            try:
                s = socket.create_connection((self.host, self.port),
                                             timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as e:
                last = e.strerror or str(e)
                if time.monotonic() >= deadline:
                    raise StoreError(f"proxy cannot reach the store at {self.address} within "
                                     f"{timeout:g} s: {last}") from None
                time.sleep(0.05)
        try:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(self.timeout)
            hello = P.handshake_bytes(1)
            if self.token is not None:
                hello += P.encode_request(P.Request(Op.SET, (AUTH_KEY,), (self.token.encode(),)))
            hello += P.encode_request(P.Request(Op.PING, num=2))
            hello += bytes((Op.FT_MUX,)) + P.enc_u32(P.MUX_MAGIC)
            s.sendall(hello)
            got = b""
            while len(got) < 12:
                chunk = s.recv(12 - len(got))
                if not chunk:
                    if self.token is not None:
                        raise StoreAuthError(f"store at {self.address} refused the job token")
                    raise StoreError(f"store at {self.address} closed the connection during "
                                     "the handshake (it needs a job token, or is not ftrun's)")
                got += chunk
            if got != P.enc_u32(1) + P.enc_u32(2) + P.enc_u32(P.MUX_MAGIC):
                raise StoreError(f"store at {self.address} does not speak ftrun's mux extension")
            s.setblocking(False)
        except socket.timeout:
            s.close()
            raise StoreError(f"store at {self.address} did not finish the handshake within "
                             f"{self.timeout:g} s") from None
        except BaseException:
            s.close()
            raise
        self.sock = s
        self.fd = s.fileno()
        self.inbuf = bytearray()
        self.rest = b""
        self.want_write = False
        self.proxy._ep.register(self.fd, select.EPOLLIN)

    def send(self, req: P.Request, cb) -> int | None:
        if self.sock is None:
            try:
                # on the loop thread: try briefly, local clients must not stall for long
                self._connect(min(self.timeout, 1.0))
                self.proxy.log(f"proxy reconnected to the store at {self.address}")
            except StoreError as e:
                if cb is not None:
                    cb(None, e)
                else:
                    self.proxy.log(f"proxy dropped a {P.OP_NAMES[req.op]}: {e}")
                return None
        self.tag = tag = (self.tag + 1) & 0xFFFFFFFF
        if req.op not in _NO_REPLY:
            self.pending[tag] = (P.REPLY_OF[req.op], len(req.keys), cb)
        self.out.append(P.encode_mux_request(tag, req))
        return tag

    def cancel(self, handle: int | None) -> None:
        if handle is None or handle not in self.pending or self.sock is None:
            return
        shape, count, _ = self.pending[handle]
        self.pending[handle] = (shape, count, None)  # a racing STOP_WAITING is skipped
        self.tag = tag = (self.tag + 1) & 0xFFFFFFFF
        self.pending[tag] = (P.Reply.U8, 0, None)
        self.cancels[tag] = handle
        self.out.append(P.encode_mux_request(tag, P.Request(Op.CANCEL_WAIT, num=handle)))

    def end_round(self) -> None:
        pass

    def flush(self) -> None:
        if self.sock is None or self.want_write or not (self.out or self.rest):
            return
        data = self.rest + b"".join(self.out)
        self.out.clear()
        try:
            n = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as e:
            self._lost(f"send failed: {e.strerror or e}")
            return
        self.rest = data[n:]
        if self.rest:
            self.want_write = True
            self.proxy._ep.modify(self.fd, select.EPOLLIN | select.EPOLLOUT)

    def on_event(self, ev: int) -> None:
        if ev & select.EPOLLOUT:
            self.want_write = False
            self.proxy._ep.modify(self.fd, select.EPOLLIN)
            self.flush()
        if self.sock is None or not ev & (select.EPOLLIN | select.EPOLLERR | select.EPOLLHUP):
            return
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._lost(f"receive failed: {e.strerror or e}")
            return
        if not data:
            self._lost("the store closed the connection")
            return
        buf = self.inbuf
        buf += data
        pos, n = 0, len(buf)
        pending = self.pending
        try:
            while pos + 4 <= n:
                tag = P._U32_unpack(buf, pos)[0]
                ent = pending.get(tag)
                if ent is None:
                    raise P.ProtocolError(f"reply for unknown tag {tag}")
                r = P.parse_reply(buf, pos + 4, ent[0], ent[1])
                if r is None:
                    break
                pos = r[1]
                del pending[tag]
                orig = self.cancels.pop(tag, None)
                if orig is not None:
                    pending.pop(orig, None)
                if ent[2] is not None:
                    ent[2](r[0], None)
        except P.ProtocolError as e:
            self._lost(f"bad reply: {e}")
            return
        if pos:
            del buf[:pos]

    def _lost(self, why: str) -> None:
        self.proxy.log(f"proxy lost its upstream link to {self.address}: {why}")
        try:
            self.proxy._ep.unregister(self.fd)
        except (OSError, ValueError):
            pass
        try:
            self.sock.close()
        except OSError:
            pass
        self.sock = None
        pending, self.pending = self.pending, {}
        self.cancels.clear()
        self.out.clear()
        err = StoreError(f"upstream store {self.address} lost: {why}")
        for _, _, cb in pending.values():
            if cb is not None:
                cb(None, err)

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None


class _KVUpstream:
    """Any KVStore as the upstream. One worker thread runs the rounds in order (the ops of
    one round, which are concurrent, in parallel); blocking WAIT/BARRIER run on their own
    threads so they never hold up other ops."""

    def __init__(self, proxy: "StoreProxy", factory: Callable[[], KVStore], owned: bool,
                 workers: int = 8, max_waits: int = 1024) -> None:
        self.proxy = proxy
        self.factory = factory
        self.owned = owned
        self.kv: KVStore | None = None
        self.round: list = []
        self.queue: deque = deque()
        self.cv = threading.Condition()
        self.closing = False
        self.thread: threading.Thread | None = None
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="ftrun-proxy-op")
        self.waits = ThreadPoolExecutor(max_waits, thread_name_prefix="ftrun-proxy-wait")
        self.seq = 0
        self.cancelled: set[int] = set()

    @property
    def address(self) -> str:
        return type(self.kv).__name__

    def start(self) -> None:
        self.kv = self.factory()
        if not isinstance(self.kv, KVStore):
            raise TypeError(f"proxy upstream factory returned {self.kv!r}, not a KVStore")
        self.thread = threading.Thread(target=self._run, name="ftrun-proxy-kv", daemon=True)
        self.thread.start()

    def send(self, req: P.Request, cb) -> int:
        self.seq += 1
        self.round.append((self.seq, req, cb))
        return self.seq

    def cancel(self, handle) -> None:
        if handle is not None:
            with self.cv:
                self.cancelled.add(handle)

    def end_round(self) -> None:
        if self.round:
            with self.cv:
                self.queue.append(self.round)
                self.cv.notify()
            self.round = []

    def flush(self) -> None:
        self.end_round()

    def on_event(self, ev: int) -> None:  # pragma: no cover - no fd
        pass

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.queue and not self.closing:
                    self.cv.wait(1.0)
                if self.closing:
                    return
                rnd = self.queue.popleft()
            if len(rnd) == 1:
                self._exec(*rnd[0])
            else:
                for f in [self.pool.submit(self._exec, *item) for item in rnd]:
                    f.result()

    def _reply(self, cb, value, err) -> None:
        self.proxy.call_soon_threadsafe(lambda: cb(value, err))

    def _exec(self, handle: int, req: P.Request, cb) -> None:
        try:
            if req.op == Op.WAIT:
                keys = [_logical(k) for k in req.keys]
                self.waits.submit(self._wait, handle, keys, cb)
                return
            if req.op == Op.BARRIER:
                key = _logical(req.keys[0])
                count = self.kv.add(key, 1)
                if count >= req.num:
                    self._reply(cb, P.STOP_WAITING, None)
                else:
                    self.waits.submit(self._barrier, handle, key, req.num, cb)
                return
            value = self._op(req)
        except Exception as e:  # any KVStore failure becomes a closed client connection
            if cb is not None:
                self._reply(cb, None, e if isinstance(e, StoreError) else StoreError(
                    f"{type(e).__name__}: {e}"))
            else:
                msg = f"proxy upstream {P.OP_NAMES[req.op]} failed: {e}"  # `e` dies with the block
                self.proxy.call_soon_threadsafe(lambda: self.proxy.log(msg))
            return
        if cb is not None:
            self._reply(cb, value, None)

    def _op(self, req: P.Request):
        kv, op = self.kv, req.op
        if op == Op.SET or op == Op.MULTI_SET:
            for k, v in zip(req.keys, req.values):
                kv.set(_logical(k), v)
            return None
        if op == Op.GET:
            v = kv.try_get(_logical(req.keys[0]))
            return b"" if v is None else v
        if op == Op.ADD:
            return kv.add(_logical(req.keys[0]), req.num)
        if op == Op.COMPARE_SET:
            return kv.compare_set(_logical(req.keys[0]), req.values[0], req.values[1])
        if op == Op.CHECK:
            ok = all(kv.try_get(_logical(k)) is not None for k in req.keys)
            return P.READY if ok else P.NOT_READY
        if op == Op.MULTI_GET:
            return [kv.try_get(_logical(k)) or b"" for k in req.keys]
        if op == Op.DELETE_KEY:
            return 1 if kv.delete(_logical(req.keys[0])) else 0
        if op == Op.GETNUMKEYS:
            return len(kv.keys(""))
        if op == Op.LIST_KEYS:
            return [_wire(k) for k in kv.keys("")]
        if op == Op.APPEND:
            key = _logical(req.keys[0])
            for _ in range(1000):
                cur = kv.try_get(key)
                base = b"" if cur is None else cur
                if kv.compare_set(key, base, base + req.values[0]) == base + req.values[0]:
                    return None
            raise StoreError(f"APPEND to {key!r} kept losing races")
        raise StoreError(f"{P.OP_NAMES.get(op, op)} is not supported by a "
                         f"{type(kv).__name__} upstream")

    def _wait(self, handle: int, keys: list[str], cb) -> None:
        try:
            while not self.closing:
                if handle in self.cancelled:
                    with self.cv:
                        self.cancelled.discard(handle)
                    return
                if self.kv.wait(keys, 0.5):
                    self._reply(cb, P.STOP_WAITING, None)
                    return
        except Exception as e:
            self._reply(cb, None, StoreError(f"WAIT failed upstream: {e}"))

    def _barrier(self, handle: int, key: str, world: int, cb) -> None:
        # KVStore has no "value reached N" notification; barriers are rare, so poll.
        try:
            while not self.closing:
                if handle in self.cancelled:
                    with self.cv:
                        self.cancelled.discard(handle)
                    return
                raw = self.kv.try_get(key)
                if raw is not None and int(raw) >= world:
                    self._reply(cb, P.STOP_WAITING, None)
                    return
                time.sleep(0.02)
        except Exception as e:
            self._reply(cb, None, StoreError(f"BARRIER failed upstream: {e}"))

    def close(self) -> None:
        with self.cv:
            self.closing = True
            self.cv.notify_all()
        if self.thread is not None:
            self.thread.join(5.0)
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.waits.shutdown(wait=False, cancel_futures=True)
        if self.owned and self.kv is not None:
            self.kv.close()


RAW_PREFIX = "ftrun/wire/"


def _logical(wk: bytes) -> str:
    """Wire key -> KVStore key. Torch sends a few keys without the "/" prefix (its
    `init/` worker counter); those live under the logical prefix "ftrun/wire/"."""
    if wk.startswith(b"/"):
        return wk[1:].decode("utf-8", "surrogateescape")
    return RAW_PREFIX + wk.decode("utf-8", "surrogateescape")


def _wire(lk: str) -> bytes:
    if lk.startswith(RAW_PREFIX):
        return lk[len(RAW_PREFIX):].encode("utf-8", "surrogateescape")
    return b"/" + lk.encode("utf-8", "surrogateescape")


# ----------------------------------------------------------------------------- the proxy


class StoreProxy(LoopServer):
    """Per-node TCPStore proxy. `start()` connects upstream and listens; `port`; `stop()`."""

    _name = "proxy"

    def __init__(self, upstream, listen_host: str = "127.0.0.1", port: int = 0,
                 limits: ServerLimits = ServerLimits(),
                 log: Callable[[str], None] | None = None,
                 upstream_timeout: float = 30.0, max_hold: float = 0.002) -> None:
        super().__init__(listen_host, port, None, limits, log)
        if isinstance(upstream, tuple) and len(upstream) in (2, 3):
            host, uport = upstream[0], upstream[1]
            token = upstream[2] if len(upstream) == 3 else None
            self._up = _MuxUpstream(self, host, int(uport), token, upstream_timeout)
        elif isinstance(upstream, KVStore):
            self._up = _KVUpstream(self, lambda: upstream, owned=False)
        elif callable(upstream):
            self._up = _KVUpstream(self, upstream, owned=True)
        else:
            raise TypeError(f"upstream={upstream!r}: expected (host, port[, token]), a KVStore "
                            "or a KVStore factory")
        self._batch: list = []
        self._batch_since = 0.0
        self._inflight = 0
        self._waits: dict[tuple, _Group] = {}
        self.upstream_requests = 0
        self.max_hold = max_hold

    @property
    def upstream_address(self) -> str:
        return self._up.address

    def _on_start(self) -> None:
        self._up.start()

    def stop(self) -> None:
        super().stop()
        self._up.close()

    def _extra_event(self, fd: int, ev: int) -> None:
        if fd == getattr(self._up, "fd", None):
            self._up.on_event(ev)

    # -- local side ----------------------------------------------------------------------

    def _read(self, c: _Conn) -> None:
        """Fast path: one complete ordinary request in one read goes straight into the
        batch; anything else (partial frames, several requests, handshake) via `_consume`."""
        data = self._recv(c)
        if not data:
            return
        n = len(data)
        if c.buf or not c.validated or data[0] not in _FAST_OPS:
            self._consume(c, data)
            return
        try:
            r = P._parse(data, 0, n, self._plimits)
        except P.ProtocolError:
            r = None
        if r is None or r[1] != n or (r[0].op == Op.SET and r[0].keys[0] == AUTH_KEY):
            self._consume(c, data)
            return
        req = r[0]
        slot = None
        if req.op != Op.SET:
            slot = [None]
            c.slots.append(slot)
        self._batch.append((c, req, slot))

    def _process(self, c: _Conn, buf) -> int:
        pos, n = 0, len(buf)
        lim = self._plimits
        parse = P._parse
        batch = self._batch
        budget = self._budget
        while pos < n:
            budget -= 1
            if budget < 0:
                c.more = True
                break
            r = parse(buf, pos, n, lim)
            if r is None:
                break
            req, pos = r
            op = req.op
            if not c.validated:
                if op != Op.VALIDATE or req.num != P.VALIDATION_MAGIC:
                    raise DropConnection(f"first message was {P.OP_NAMES.get(op, op)}, "
                                         "expected VALIDATE")
                c.validated = True
                continue
            if op == Op.VALIDATE or (op == Op.SET and req.keys[0] == AUTH_KEY):
                continue  # no token on the loopback side; upstream auth is the proxy's own
            if op == Op.FT_MUX:
                raise DropConnection("FT_MUX is not offered by the proxy")
            slot = None
            if op not in _NO_REPLY:
                slot = [None]
                c.slots.append(slot)
            if op == Op.PING:
                self._fill(c, slot, P.enc_u32(req.num))
                continue
            batch.append((c, req, slot))
        return pos

    def _fill(self, c: _Conn, slot: list, data: bytes) -> None:
        slot[0] = data
        if c.closed:
            return
        slots = c.slots
        moved = False
        while slots and slots[0][0] is not None:
            d = slots.popleft()[0]
            if d:
                c.out.append(d)
                moved = True
        if moved:
            self._dirty.append(c)

    def _on_close(self, c: _Conn) -> None:
        w = c.waiter
        if w is not None:
            c.waiter = None
            self._leave(w[0], c)

    def _leave(self, g: _Group, c: _Conn) -> None:
        g.members = [m for m in g.members if m[0] is not c]
        if not g.members:
            if g.key is not None:
                self._waits.pop(g.key, None)
            self._up.cancel(g.handle)

    def _fail(self, c: _Conn, what: str, err: Exception) -> None:
        if not c.closed:
            self.log(f"proxy closed {c.peer}: {what} failed upstream: {err}")
            self.stats["dropped"] += 1
            self._close(c)

    # -- batching --------------------------------------------------------------------------

    def _poll_timeout(self) -> float:
        if self._batch:
            return max(0.0, self._batch_since + self.max_hold - time.monotonic())
        return 1.0

    def _end_turn(self) -> None:
        batch = self._batch
        if batch:
            # Nagle-style: while answers to earlier requests are outstanding, keep
            # collecting (at most max_hold s), so a burst becomes one upstream round.
            now = time.monotonic()
            if not self._batch_since:
                self._batch_since = now
            if self._inflight and now - self._batch_since < self.max_hold:
                return
            self._batch = []
            self._batch_since = 0.0
            per: dict = {}
            for item in batch:
                per.setdefault(item[0], []).append(item)
            queues = list(per.values())
            depth = max(len(q) for q in queues)
            if depth == 1:
                self._round(batch)
            else:
                for i in range(depth):
                    self._round([q[i] for q in queues if len(q) > i])
        self._up.flush()

    def _send(self, req: P.Request, cb, counted: bool = True):
        """Send upstream; `counted` requests hold back the next batch until answered."""
        self.upstream_requests += 1
        if cb is not None and counted:
            self._inflight += 1
            inner = cb

            def cb(value, err):
                self._inflight -= 1
                inner(value, err)
        return self._up.send(req, cb)

    def _round(self, items: list) -> None:
        set_k: list = []
        set_v: list = []
        adds: dict = {}
        gets: dict = {}
        for c, req, slot in items:
            if c.closed:
                continue
            op = req.op
            if op == Op.SET or op == Op.MULTI_SET:
                set_k.extend(req.keys)
                set_v.extend(req.values)
            elif op == Op.ADD:
                adds.setdefault(req.keys[0], []).append((c, slot, req.num))
            elif op == Op.GET:
                gets.setdefault(req.keys[0], []).append((c, slot))
            elif op == Op.WAIT:
                self._wait(c, slot, req)
            elif op == Op.CANCEL_WAIT:
                w = c.waiter
                if w is not None:
                    c.waiter = None
                    self._fill(c, w[1], b"")
                    self._leave(w[0], c)
                self._fill(c, slot, _WAIT_CANCELED)
            elif op == Op.BARRIER:
                g = _Group(None)
                g.members.append((c, slot))
                c.waiter = (g, slot)
                g.handle = self._send(req, self._group_cb(g, P.OP_NAMES[op]), counted=False)
            else:
                self._single(c, slot, req)
        if set_k:
            if len(set_k) == 1:
                self._send(P.Request(Op.SET, (set_k[0],), (set_v[0],)), None)
            else:
                self._send(P.Request(Op.MULTI_SET, tuple(set_k), tuple(set_v)), None)
        for key, members in adds.items():
            total = sum(m[2] for m in members)
            self._send(P.Request(Op.ADD, (key,), (), total), self._add_cb(members, total))
        for key, members in gets.items():
            self._send(P.Request(Op.GET, (key,)), self._get_cb(members))
        self._up.end_round()

    def _wait(self, c: _Conn, slot: list, req: P.Request) -> None:
        key = tuple(sorted(set(req.keys)))
        g = self._waits.get(key)
        if g is None:
            g = self._waits[key] = _Group(key)
            g.members.append((c, slot))
            g.handle = self._send(P.Request(Op.WAIT, key), self._group_cb(g, "WAIT"),
                                  counted=False)
        else:
            g.members.append((c, slot))
        c.waiter = (g, slot)

    def _group_cb(self, g: _Group, what: str):
        def done(value, err) -> None:
            if g.key is not None and self._waits.get(g.key) is g:
                del self._waits[g.key]
            members, g.members = g.members, []
            for c, slot in members:
                if c.waiter is not None and c.waiter[0] is g:
                    c.waiter = None
                if err is not None:
                    self._fail(c, what, err)
                else:
                    self._fill(c, slot, bytes((value,)))
        return done

    def _add_cb(self, members: list, total: int):
        def done(value, err) -> None:
            run = value - total if err is None else 0
            for c, slot, amount in members:
                if err is not None:
                    self._fail(c, "ADD", err)
                else:
                    run += amount
                    self._fill(c, slot, P.enc_i64(run))
        return done

    def _get_cb(self, members: list):
        def done(value, err) -> None:
            data = None if err is not None else P.enc_bytes(value)
            for c, slot in members:
                if err is not None:
                    self._fail(c, "GET", err)
                else:
                    self._fill(c, slot, data)
        return done

    def _single(self, c: _Conn, slot, req: P.Request) -> None:
        op = req.op
        enc = _ENCODERS.get(op)
        if enc is None:
            raise AssertionError(f"proxy has no encoder for {op}")  # pragma: no cover
        name = P.OP_NAMES[op]

        def done(value, err) -> None:
            if err is not None:
                self._fail(c, name, err)
            elif slot is not None:
                self._fill(c, slot, enc(value))
        self._send(req, done if slot is not None else _log_failure(self, c, name))


def _log_failure(proxy: StoreProxy, c: _Conn, name: str):
    def done(value, err) -> None:
        if err is not None:
            proxy._fail(c, name, err)
    return done


def _enc_u8(v: int) -> bytes:
    return bytes((v,))


def _enc_queue_pop(v) -> bytes:
    return P.enc_queue_pop(1, v) if v is not None else P.enc_i64(0)


_ENCODERS: dict[int, Callable] = {
    Op.COMPARE_SET: P.enc_bytes,
    Op.GET: P.enc_bytes,
    Op.ADD: P.enc_i64,
    Op.CHECK: _enc_u8,
    Op.GETNUMKEYS: P.enc_i64,
    Op.DELETE_KEY: P.enc_i64,
    Op.APPEND: lambda v: b"",
    Op.QUEUE_PUSH: lambda v: b"",
    Op.MULTI_GET: P.enc_bytes_list,
    Op.QUEUE_POP: _enc_queue_pop,
    Op.QUEUE_LEN: P.enc_i64,
    Op.LIST_KEYS: P.enc_key_list,
}
