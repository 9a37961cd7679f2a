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
  - identical GETs become one GET, identical CHECKs (the same keys) one CHECK (never merged
    with one already sent: that one may have been answered from a state older than the new
    request); many local ranks polling one key (a recovery round's repair plan) cost the
    upstream one CHECK per round, not one per rank;
  - WAITs for the same key set join one upstream WAIT, even one sent in an earlier turn:
    when it fires, the keys exist, which is after every joined waiter asked.
Nothing is cached: every answer comes from the upstream after the request arrived, so no
stale value is ever served (values of keys that can never change could be cached, but the
protocol cannot tell which keys those are). While requests are in flight upstream, new ones
are held for at most `max_hold` s so a burst becomes one round (Nagle-style; an idle proxy
forwards at once). CANCEL_WAIT detaches the caller; the upstream wait is cancelled
when nobody is left on it. PING and VALIDATE are answered locally. Reading and queueing the
common frames (SET, GET, ADD, WAIT / CHECK) of a local connection and sending the replies run
in C when the extension `rendezvous.store._quickstore` was built (`proxy_read`, `flush_out`; the
same batch as the Python path; while the batch is empty or held, `loop_turn` keeps reading in C,
so Python runs once per round; `accel=False` turns it off). The loop thread keeps its
inherited priority (`nice`; see `rendezvous.store.loop_priority`). The master thus sees
O(nodes) connections and, for the process-group init pattern, O(1) requests per node per
phase instead of O(ranks).

With a KVStore upstream, wire keys map to logical keys with `protocol.logical_key` (the few
keys torch sends without the "/", its `init/` counter, live under "ftrun/wire/") and data ops
run through `memory.apply`, the same dispatch the embedded server uses. Queue ops need
ftrun's server upstream; with a KVStore they close the client connection with a clear line.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from rendezvous.kv import KVStore, StoreAuthError, StoreError
from rendezvous.store import protocol as P
from rendezvous.store.auth import AUTH_KEY, check_token
from rendezvous.store.client import connect
from rendezvous.store.connection import Conn, DropConnection, check_validate
from rendezvous.store.memory import apply
from rendezvous.store.protocol import logical_key, wire_key
from rendezvous.store.server import LoopServer, c_accel

Op = P.Op


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

    def __init__(
        self, proxy: "StoreProxy", host: str, port: int, token: str | None, timeout: float
    ) -> None:
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
        s = connect(self.host, self.port, timeout, "proxy cannot reach the store")
        try:
            s.settimeout(self.timeout)
            hello = P.handshake_bytes(1)
            if self.token is not None:
                hello += P.encode_request(P.Request(Op.SET, (AUTH_KEY,), (self.token.encode(),)))
            hello += P.encode_request(P.Request(Op.PING, num=2))
            hello += P.encode_request(P.Request(Op.FT_MUX, num=P.MUX_MAGIC))
            s.sendall(hello)
            got = b""
            while len(got) < 12:
                chunk = s.recv(12 - len(got))
                if not chunk:
                    if self.token is not None:
                        raise StoreAuthError(f"store at {self.address} refused the job token")
                    raise StoreError(
                        f"store at {self.address} closed the connection during "
                        "the handshake (it needs a job token, or is not ftrun's)"
                    )
                got += chunk
            if got != P.enc_u32(1) + P.enc_u32(2) + P.enc_u32(P.MUX_MAGIC):
                raise StoreError(f"store at {self.address} does not speak ftrun's mux extension")
            s.setblocking(False)
        except socket.timeout:
            s.close()
            raise StoreError(
                f"store at {self.address} did not finish the handshake within {self.timeout:g} s"
            ) from None
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
        if req.op not in P.NO_REPLY:
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
            data = self.sock.recv(P.READ_SIZE)
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
                tag = P.parse_reply(buf, pos, P.Reply.U32)[0]
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

    def __init__(
        self,
        proxy: "StoreProxy",
        factory: Callable[[], KVStore],
        owned: bool,
        workers: int = 8,
        max_waits: int = 1024,
    ) -> None:
        self.proxy = proxy
        self.factory = factory
        self.owned = owned
        self.kv: KVStore | None = None
        self.table: _KVTable | None = None
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
        self.table = _KVTable(self.kv)
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
            if P.KIND_OF[req.op] == P.Kind.BLOCKING:
                self._block(handle, req, cb)
                return
            value = apply(self.table, req)
        except Exception as e:  # any KVStore failure becomes a closed client connection
            if cb is not None:
                self._reply(
                    cb,
                    None,
                    e if isinstance(e, StoreError) else StoreError(f"{type(e).__name__}: {e}"),
                )
            else:
                msg = f"proxy upstream {P.op_name(req.op)} failed: {e}"  # `e` dies with the block
                self.proxy.call_soon_threadsafe(lambda: self.proxy.log(msg))
            return
        if cb is not None:
            self._reply(cb, value, None)

    def _block(self, handle: int, req: P.Request, cb) -> None:
        """WAIT or BARRIER: answered now when it holds, else by a thread of `waits`."""
        if req.op == Op.WAIT:
            self.waits.submit(self._wait, handle, [logical_key(k) for k in req.keys], cb)
            return
        key = logical_key(req.keys[0])
        if self.kv.add(key, 1) >= req.num:
            self._reply(cb, P.STOP_WAITING, None)
        else:
            self.waits.submit(self._barrier, handle, key, req.num, cb)

    def _wait(self, handle: int, keys: list[str], cb) -> None:
        self._until(handle, cb, "WAIT", lambda: self.kv.wait(keys, 0.5))

    def _barrier(self, handle: int, key: str, world: int, cb) -> None:
        def reached() -> bool:
            # KVStore has no "value reached N" notification; barriers are rare, so poll.
            raw = self.kv.try_get(key)
            if raw is not None and int(raw) >= world:
                return True
            time.sleep(0.02)
            return False

        self._until(handle, cb, "BARRIER", reached)

    def _until(self, handle: int, cb, what: str, ready: Callable[[], bool]) -> None:
        """Answer STOP_WAITING once `ready()` (which blocks briefly) holds, unless cancelled."""
        try:
            while not self.closing:
                if handle in self.cancelled:
                    with self.cv:
                        self.cancelled.discard(handle)
                    return
                if ready():
                    self._reply(cb, P.STOP_WAITING, None)
                    return
        except Exception as e:
            self._reply(cb, None, StoreError(f"{what} failed upstream: {e}"))

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


class _KVTable:
    """A KVStore seen as a wire-keyed table: the methods `memory.apply` calls on a
    MemoryStore, with keys mapped by `protocol.logical_key`/`wire_key`."""

    def __init__(self, kv: KVStore) -> None:
        self.kv = kv

    def set(self, key: bytes, value: bytes) -> None:
        self.kv.set(logical_key(key), value)

    def multi_set(self, keys: tuple, values: tuple) -> None:
        for k, v in zip(keys, values):
            self.kv.set(logical_key(k), v)

    def get(self, key: bytes) -> bytes | None:
        return self.kv.try_get(logical_key(key))

    def multi_get(self, keys: tuple) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def add(self, key: bytes, amount: int) -> int:
        return self.kv.add(logical_key(key), amount)

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        return self.kv.compare_set(logical_key(key), expected, desired)

    def check(self, keys: tuple) -> bool:
        return all(self.get(k) is not None for k in keys)

    def delete(self, key: bytes) -> bool:
        return self.kv.delete(logical_key(key))

    def num_keys(self) -> int:
        return len(self.kv.keys(""))

    def list_keys(self) -> list[bytes]:
        return [wire_key(k) for k in self.kv.keys("")]

    def append(self, key: bytes, value: bytes) -> None:
        lk = logical_key(key)
        for _ in range(1000):
            cur = self.kv.try_get(lk)
            base = b"" if cur is None else cur
            if self.kv.compare_set(lk, base, base + value) == base + value:
                return
        raise StoreError(f"APPEND to {lk!r} kept losing races")

    def queue_push(self, key: bytes, value: bytes) -> None:
        self._unsupported(Op.QUEUE_PUSH)

    def queue_pop(self, key: bytes) -> tuple:
        self._unsupported(Op.QUEUE_POP)

    def queue_len(self, key: bytes) -> int:
        self._unsupported(Op.QUEUE_LEN)

    def _unsupported(self, op: int):
        raise StoreError(f"{P.op_name(op)} is not supported by a {type(self.kv).__name__} upstream")


# ----------------------------------------------------------------------------- the proxy


class _Round:
    """What one round coalesces: every SET / MULTI_SET into one MULTI_SET, ADDs per key into
    one ADD of the sum, identical GETs into one GET, identical CHECKs into one CHECK (see the
    module doc)."""

    __slots__ = ("set_keys", "set_values", "adds", "gets", "checks")

    def __init__(self) -> None:
        self.set_keys: list = []
        self.set_values: list = []
        self.adds: dict = {}
        self.gets: dict = {}
        self.checks: dict = {}

    def set(self, c: Conn, slot, req: P.Request) -> None:
        self.set_keys.extend(req.keys)
        self.set_values.extend(req.values)

    def add(self, c: Conn, slot, req: P.Request) -> None:
        self.adds.setdefault(req.keys[0], []).append((c, slot, req.num))

    def get(self, c: Conn, slot, req: P.Request) -> None:
        self.gets.setdefault(req.keys[0], []).append((c, slot))

    def check(self, c: Conn, slot, req: P.Request) -> None:
        self.checks.setdefault(tuple(req.keys), []).append((c, slot))


_COALESCED = {
    Op.SET: _Round.set,
    Op.MULTI_SET: _Round.set,
    Op.ADD: _Round.add,
    Op.GET: _Round.get,
    Op.CHECK: _Round.check,
}


class StoreProxy(LoopServer):
    """Per-node TCPStore proxy. `start()` connects upstream and listens; `port`; `stop()`."""

    _name = "proxy"

    def __init__(
        self,
        upstream,
        listen_host: str = "127.0.0.1",
        port: int = 0,
        limits: P.Limits = P.DEFAULT_LIMITS,
        log: Callable[[str], None] | None = None,
        upstream_timeout: float = 30.0,
        max_hold: float = 0.002,
        nice: int = 0,
        accel: bool = True,
    ) -> None:
        # The loop thread keeps its inherited priority unless `nice` (< 0) asks otherwise: a
        # node proxy shares its host with the ranks it serves; raised, it preempts them at
        # every request (see rendezvous.store.loop_priority).
        super().__init__(listen_host, port, None, limits, log, nice, accel)
        if isinstance(upstream, tuple) and len(upstream) in (2, 3):
            host, uport = upstream[0], upstream[1]
            token = upstream[2] if len(upstream) == 3 else None
            self._up = _MuxUpstream(self, host, int(uport), token, upstream_timeout)
        elif isinstance(upstream, KVStore):
            self._up = _KVUpstream(self, lambda: upstream, owned=False)
        elif callable(upstream):
            self._up = _KVUpstream(self, upstream, owned=True)
        else:
            raise TypeError(
                f"upstream={upstream!r}: expected (host, port[, token]), a KVStore "
                "or a KVStore factory"
            )
        self._batch: list = []
        self._batch_since = 0.0
        self._inflight = 0
        self._waits: dict[tuple, _Group] = {}
        self.upstream_requests = 0
        self.max_hold = max_hold
        self._session = {
            Op.VALIDATE: self._revalidate,
            Op.PING: self._ping,
            Op.FT_MUX: self._refuse_mux,
            Op.FT_WAIT_VALUES: self._refuse_wait_values,
        }
        self._forward = {
            P.Kind.DATA: self._single,
            P.Kind.BLOCKING: self._block,
            P.Kind.CANCEL: self._cancel,
        }
        # C: reads a validated connection and queues its SET / GET / ADD / WAIT / CHECK
        # frames onto the batch exactly as `_handle` does (the rest: the Python path)
        self._proxy_read = c_accel("proxy_read") if accel else None
        self._proxy_ctx = (
            self._batch,
            P.Request,
            AUTH_KEY,
            limits.max_key_bytes,
            limits.max_value_bytes,
            self._budget,
        )
        if self._proxy_read is not None:  # and the loop's reads of such connections too
            self._turn = c_accel("loop_turn")
            self._turn_ctx, self._turn_proxy = self._proxy_ctx, True

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

    def _read(self, c: Conn) -> None:
        """With the C path: one read of a validated connection with nothing buffered; its
        common frames are queued in C, the rest (from the first other frame) goes through
        `_consume` as before. Else `LoopServer._read`."""
        pr = self._proxy_read
        if pr is None or not c.validated or c.buf:
            super()._read(c)
            return
        self._quick_done(c, pr(c, self._proxy_ctx))

    def _quick_rest(self, c: Conn, r: tuple) -> None:
        """A read `proxy_read` did not finish: (requests queued, the rest of the read)."""
        nreq, rest = r
        stats = self.stats
        stats["requests"] += nreq
        if nreq >= self._budget:  # this turn's share is used: the rest next turn
            stats["reads"] += 1
            c.buf = bytearray(rest)
            c.partial_since = time.monotonic()
            self._backlog.append(c)
            return
        self._consume(c, rest)

    def _handle(self, c: Conn, req: P.Request, tag: int) -> None:
        """Answer session ops here; queue everything else for the next round. Replies go
        through `c.slots`, so they leave in request order."""
        op = req.op
        if not c.validated:
            check_validate(req)
            c.validated = True
            return None
        local = self._session.get(op)
        if local is not None:
            return local(c, req)
        if op == Op.SET and req.keys[0] == AUTH_KEY:
            return None  # no token on the loopback side; upstream auth is the proxy's own
        slot = None
        if op not in P.NO_REPLY:
            slot = [None]
            c.slots.append(slot)
        self._batch.append((c, req, slot))
        return None

    def _revalidate(self, c: Conn, req: P.Request) -> None:
        return None

    def _ping(self, c: Conn, req: P.Request) -> None:
        slot = [None]
        c.slots.append(slot)
        self._fill(c, slot, P.encode_reply(Op.PING, req.num))

    def _refuse_mux(self, c: Conn, req: P.Request) -> None:
        raise DropConnection("FT_MUX is not offered by the proxy")

    def _refuse_wait_values(self, c: Conn, req: P.Request) -> None:
        # its PING echoes CAPS_NONCE: a client that asked does not send it here
        raise DropConnection("FT_WAIT_VALUES is not offered by the proxy")

    def _fill(self, c: Conn, slot: list, data: bytes) -> None:
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

    def _on_close(self, c: Conn) -> None:
        w = c.waiter
        if w is not None:
            c.waiter = None
            self._leave(w[0], c)

    def _leave(self, g: _Group, c: Conn) -> None:
        g.members = [m for m in g.members if m[0] is not c]
        if not g.members:
            if g.key is not None:
                self._waits.pop(g.key, None)
            self._up.cancel(g.handle)

    def _fail(self, c: Conn, what: str, err: Exception) -> None:
        if not c.closed:
            self.log(f"proxy closed {c.peer}: {what} failed upstream: {err}")
            self.stats["dropped"] += 1
            self._close(c)

    # -- batching --------------------------------------------------------------------------

    def _poll_timeout(self) -> float:
        if self._batch:
            return max(0.0, self._batch_since + self.max_hold - time.monotonic())
        return super()._poll_timeout()

    def _turn_hold(self) -> float:
        """While answers are outstanding a new batch is held up to `max_hold` s; `loop_turn`
        then keeps collecting it in C (an upstream reply or anything else for Python ends
        that sooner). With nothing outstanding: 0, a new request goes upstream at once."""
        return self.max_hold if self._inflight else 0.0

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
            batch = batch.copy()  # the list itself stays: the C read path appends to it
            self._batch.clear()
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
        """Send upstream; `counted` requests hold back the next batch until answered (writes
        without a reply are never counted: a mux upstream never answers them)."""
        self.upstream_requests += 1
        if cb is not None and counted and req.op not in P.NO_REPLY:
            self._inflight += 1
            inner = cb

            def cb(value, err):
                self._inflight -= 1
                inner(value, err)

        return self._up.send(req, cb)

    def _round(self, items: list) -> None:
        rnd = _Round()
        for c, req, slot in items:
            if c.closed:
                continue
            merge = _COALESCED.get(req.op)
            if merge is not None:
                merge(rnd, c, slot, req)
            else:
                self._forward[P.KIND_OF[req.op]](c, slot, req)
        keys, values = rnd.set_keys, rnd.set_values
        if len(keys) == 1:
            self._send(P.Request(Op.SET, (keys[0],), (values[0],)), None)
        elif keys:
            self._send(P.Request(Op.MULTI_SET, tuple(keys), tuple(values)), None)
        for key, members in rnd.adds.items():
            total = sum(m[2] for m in members)
            self._send(P.Request(Op.ADD, (key,), (), total), self._add_cb(members, total))
        for key, members in rnd.gets.items():
            self._send(P.Request(Op.GET, (key,)), self._shared_cb(Op.GET, members))
        for keys, members in rnd.checks.items():
            self._send(P.Request(Op.CHECK, keys), self._shared_cb(Op.CHECK, members))
        self._up.end_round()

    def _block(self, c: Conn, slot: list, req: P.Request) -> None:
        """A WAIT joins the group waiting for the same key set (one upstream WAIT); a
        BARRIER is a group of its own (every call counts)."""
        key = tuple(sorted(set(req.keys))) if req.op == Op.WAIT else None
        g = self._waits.get(key) if key is not None else None
        joined = g is not None
        if not joined:
            g = _Group(key)
            if key is not None:
                self._waits[key] = g
        g.members.append((c, slot))
        c.waiter = (g, slot)
        if not joined:
            up = req if key is None else P.Request(Op.WAIT, key)
            g.handle = self._send(up, self._group_cb(g, req.op), counted=False)

    def _cancel(self, c: Conn, slot: list, req: P.Request) -> None:
        w = c.waiter
        if w is not None:
            c.waiter = None
            self._fill(c, w[1], b"")
            self._leave(w[0], c)
        self._fill(c, slot, P.encode_reply(Op.CANCEL_WAIT, P.WAIT_CANCELED))

    def _group_cb(self, g: _Group, op: int):
        def done(value, err) -> None:
            if g.key is not None and self._waits.get(g.key) is g:
                del self._waits[g.key]
            members, g.members = g.members, []
            data = None if err is not None else P.encode_reply(op, value)  # one for all
            for c, slot in members:
                if c.waiter is not None and c.waiter[0] is g:
                    c.waiter = None
                if data is None:
                    self._fail(c, P.op_name(op), err)
                else:
                    self._fill(c, slot, data)

        return done

    def _add_cb(self, members: list, total: int):
        def done(value, err) -> None:
            run = value - total if err is None else 0
            for c, slot, amount in members:
                if err is not None:
                    self._fail(c, "ADD", err)
                else:
                    run += amount
                    self._fill(c, slot, P.encode_reply(Op.ADD, run))

        return done

    def _shared_cb(self, op: int, members: list):
        """One upstream answer (GET, CHECK) for every member that asked the same."""

        def done(value, err) -> None:
            data = None if err is not None else P.encode_reply(op, value)
            for c, slot in members:
                if err is not None:
                    self._fail(c, P.op_name(op), err)
                else:
                    self._fill(c, slot, data)

        return done

    def _single(self, c: Conn, slot, req: P.Request) -> None:
        op = req.op
        name = P.op_name(op)

        def done(value, err) -> None:
            if err is not None:
                self._fail(c, name, err)
            elif slot is not None:
                self._fill(c, slot, P.encode_reply(op, value))

        self._send(req, done)
