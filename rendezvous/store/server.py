"""The embedded store server: torch's TCPStore protocol over a `MemoryStore`.

Owns: `LoopServer` (the event-loop thread's turns, reads, per-turn budgets, the request loop
`_process` and ordered flushes; shared with the node proxy; its cold half — listening socket,
start/stop, accepting and closing connections, the sweep — is
`rendezvous.store.loop_host.LoopHost`) and `StoreServer` (request execution, handshake and
token checks). A connection's state and the VALIDATE rule are `rendezvous.store.connection`.

Design: one thread runs a level-triggered epoll loop over non-blocking sockets. A readable
connection is read once (64 KiB), its complete requests are decoded and executed (on a plain
connection with nothing buffered and no waiter, and on a node proxy's mux connection, the
handshake, PING, GET, SET, ADD, WAIT / CHECK (MULTI_SET on a mux connection) and the wake-ups
of the waiters a write satisfies by the C read path
`rendezvous.store._quickstore`, which also reads and answers them, when it was built; else GET, SET,
ADD and a satisfied one-key WAIT in place by `StoreServer._quick`; the rest through
`protocol.parse_common` / `protocol.parse_request`) against the table through one dispatch
(`Kind` from the codec's table, data ops through `memory.apply`), and its replies are sent at
once, in one `send` (queued output of many connections at the end of a turn: `flush_out`
in C when built; with the C read path the loop's epoll wait and those reads are one C call,
`loop_turn`, which also accepts new connections, handing each to `_adopt`; Python finishes the
rest of the turn; while a turn leaves nothing to Python, `loop_turn` waits and reads again in
C, until the next one-second sweep). Nothing blocks on a
client: at most 128 requests per connection and 256 accepts run per turn (the rest next
turn), a stalled reader only grows its own bounded output buffer, a slow sender only holds
its own partial frame (closed after `stalled_frame_timeout`),
and a malformed or over-limit frame closes that connection with one log line. WAITs register a
waiter in the table; a SET that satisfies thousands of waiters queues one byte per waiter and
flushes them all at the end of that turn. Limits are a `protocol.Limits`. Writes from other
threads (the in-process `LocalKV` at `.kv`) wake waiters through an
eventfd. Unmodified torch clients (`TCPStore(is_master=False)`, gloo/NCCL init through
env://) speak to it directly.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections import deque
from typing import Callable

from rendezvous.store import protocol as P
from rendezvous.store.auth import AUTH_KEY, check_token, token_matches
from rendezvous.store.connection import Conn, DropConnection, check_validate
from rendezvous.store.loop_host import LoopHost
from rendezvous.store.loop_priority import LoopPriority, check_nice, loop_nice
from rendezvous.store.memory import LocalKV, MemoryStore, Waiter, apply

_log = logging.getLogger("ftrun.store")

_EPOLLIN = select.EPOLLIN
_EPOLLOUT = select.EPOLLOUT
_EPOLLERRS = select.EPOLLERR | select.EPOLLHUP
Op = P.Op
_GET, _SET, _ADD, _WAIT = Op.GET, Op.SET, Op.ADD, Op.WAIT
_u64, _i64 = P.unpack_u64, P.unpack_i64
_u64_pack, _i64_pack = P.pack_u64, P.pack_i64
_EMPTY_VALUE = _u64_pack(0)
_STOP = P.STOP_WAITING_REPLY


def c_accel(name: str) -> Callable | None:
    """`name` from the C module `rendezvous.store._quickstore`, or None when it was not built
    (the Python path then does the same; a server made with `accel=False` does not ask)."""
    try:
        from rendezvous.store import _quickstore
    except ImportError:
        return None
    return getattr(_quickstore, name, None)


def _c_read_path(
    server: "StoreServer", table: MemoryStore, limits: P.Limits, budget: int
) -> tuple[Callable | None, tuple]:
    """The C read path over `table` (see `rendezvous/store/_quickstore.c`) and its context, or
    (None, ()) when the extension was not built, the server was made with `accel=False`
    (FTRUN_STORE_ACCEL=0), or the table is not a plain `MemoryStore` (a subclass may do more
    on a write)."""
    plain = type(table) is MemoryStore and server.accel
    read_quick = c_accel("read_quick") if plain else None
    if read_quick is None:
        return None, ()
    return read_quick, (
        table._data,
        table._waiters,
        table._barriers,
        table._lock,
        limits.max_key_bytes,
        limits.max_value_bytes,
        AUTH_KEY,
        budget,
        table._queues,
        Waiter,
        _Wake,
        server,
        limits.max_keys_per_request,
    )


class _Wake:
    """The callback of one registered waiter of connection `c` (tag -1: a plain connection's
    only waiter; >= 0: a mux tag): delivers its STOP_WAITING on the loop thread. `_deliver`
    recognises the waiter by this object (`waiter.fire is wake`), so nothing refers back to
    the waiter and no reference cycle is left for the garbage collector."""

    __slots__ = ("srv", "c", "tag")

    def __init__(self, srv: "StoreServer", c: Conn, tag: int) -> None:
        self.srv, self.c, self.tag = srv, c, tag

    def __call__(self) -> None:
        srv = self.srv
        if threading.get_ident() == srv._loop_ident:
            srv._deliver(self.c, self, self.tag)
        else:  # a write of another thread (LocalKV)
            srv.call_soon_threadsafe(lambda: srv._deliver(self.c, self, self.tag))


class _WakeValues(_Wake):
    """The callback of an FT_WAIT_VALUES waiter: its answer carries the values of `keys` as
    the table holds them when it is delivered. Not a `_Wake` by exact type, so the C read path
    leaves its delivery to `fire()`."""

    __slots__ = ("keys",)

    def __init__(self, srv: "StoreServer", c: Conn, tag: int, keys: tuple) -> None:
        super().__init__(srv, c, tag)
        self.keys = keys


class LoopServer(LoopHost):
    """The event-loop machinery shared by the store server and the node proxy: the epoll loop
    thread's turns, buffered reads, ordered flushes (lifecycle, admission, teardown and the
    sweep: `LoopHost`). Subclasses implement `_handle(conn, request, tag) -> reply bytes or
    None` and may override `LoopHost`'s hooks."""

    # Hook: (conn, buf, pos, n) -> (reply, end) | None. Executes the request at buf[pos] of a
    # validated, authenticated, plain connection without building a Request when it is one of
    # the frames that dominate a rendezvous; None takes the general path (`_handle`).
    _quick: (
        Callable[[Conn, bytes | bytearray, int, int], tuple[bytes | None, int] | None] | None
    ) = None
    # Hook: the C read path (`rendezvous.store._quickstore.read_quick`) and its context tuple, or
    # None: reads, executes and answers a plain connection's common frames without Python.
    _read_quick: Callable | None = None
    _quick_ctx: tuple = ()
    # Hook: `rendezvous.store._quickstore.loop_turn`, or None: one epoll wait and, for the reads
    # `_read` would give to the C read path, those reads, in C (the rest of the turn in
    # Python; `_quick_done` / `_quick_rest` finish what C hands back). Its context:
    # `_quick_ctx` for the server's path, the proxy's for `proxy_read` (`_turn_proxy`).
    _turn: Callable | None = None
    _turn_ctx: tuple = ()
    _turn_proxy = False

    _name = "store"
    _budget = 128  # requests per connection per loop turn
    _accepts_per_turn = 256

    def __init__(
        self,
        host: str,
        port: int,
        token: str | None,
        limits: P.Limits,
        log: Callable[[str], None] | None,
        nice: int | None = None,
        accel: bool = True,
    ) -> None:
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port={port!r}: must be an integer in 0-65535")
        # The loop thread's nice value (rendezvous.store.loop_priority): FTRUN_STORE_NICE when None.
        self.nice = loop_nice() if nice is None else check_nice(nice)
        if not isinstance(limits, P.Limits):
            raise TypeError(f"limits={limits!r}: must be a rendezvous.store.protocol.Limits")
        self.host = host
        self._req_port = port
        self.token = check_token(token) if token is not None else None
        self.limits = limits
        self.log = log or _log.warning
        self._port = 0
        self._lsock: socket.socket | None = None
        self._ep = None
        self._wake_fd = -1
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stopped = False
        self._lock = threading.Lock()
        self._conns: dict[int, Conn] = {}
        self._dirty: list = []
        self._xq: deque = deque()
        self._loop_ident = 0
        self._backlog: list = []
        self.accel = accel  # False: the Python paths only, even where the C module was built
        self._flush_out = c_accel("flush_out") if accel else None  # C: _flush, for many conns
        self.stats = {
            "accepted": 0,
            "reads": 0,
            "dropped": 0,
            "max_turn_s": 0.0,
            "max_turn_cpu_s": 0.0,
            "requests": 0,
            "busy_s": 0.0,
        }

    # -- loop --------------------------------------------------------------------------

    def _run(self) -> None:
        """The loop thread: its priority follows the connection count; a crash is logged."""
        self._loop_ident = threading.get_ident()
        self._priority = LoopPriority(
            self.nice, lambda m: _log.info("%s:%d %s", self._name, self._port, m)
        )
        self._priority.update(len(self._conns))
        try:
            self._turns()
        except Exception as e:  # pragma: no cover - a bug; never leave clients hanging
            self.log(f"{self._name} loop crashed: {type(e).__name__}: {e}")
            raise

    def _turns(self) -> None:
        """Loop turns until stop(): wait for events (with the C `loop_turn`: the wait and the
        reads it can finish, in C), handle them, then the turn's backlog, output and stats;
        once a second, the sweep."""
        conns = self._conns
        poll = self._ep.poll
        turn, epfd = self._turn, self._ep.fileno()
        ctx, proxy = self._turn_ctx, self._turn_proxy
        accept = self._accept_in_c()
        next_sweep = time.monotonic() + 1.0
        while not self._stopping:
            timeout = 0 if self._backlog else self._poll_timeout()
            if turn is not None:  # C: the wait, and the reads _read gives to read_quick,
                # turning again in C while a turn leaves nothing to Python (at most until
                # the next sweep)
                (events, done, reads, requests, t0, c0, busy, max_s, max_cpu) = turn(
                    epfd,
                    conns,
                    ctx,
                    timeout,
                    proxy,
                    next_sweep,
                    self,
                    self._turn_hold(),
                    accept,
                )
                self._count_c_turn(reads, requests, busy, max_s, max_cpu)
                for c, r in done:
                    self._quick_done(c, r)
            else:
                events = poll(timeout)
                t0 = time.monotonic()
                c0 = time.thread_time()
            self._handle_events(events)
            now = self._finish_turn(t0, c0)
            if now >= next_sweep:
                next_sweep = now + 1.0
                self._sweep(now)
                self._priority.update(len(conns))  # back to the raised priority once they left

    def _handle_events(self, events: list) -> None:
        """One turn's ready fds: the listening socket (accept), the eventfd (calls from other
        threads), a connection (flush, then read), or a subclass's own fd (`_extra_event`)."""
        lfd, wfd = self._lsock.fileno(), self._wake_fd
        conns = self._conns
        for fd, ev in events:
            if fd == lfd:
                self._accept()
            elif fd == wfd:
                try:
                    os.eventfd_read(wfd)
                except BlockingIOError:
                    pass
                self._drain_xq()
            else:
                c = conns.get(fd)
                if c is None:
                    self._extra_event(fd, ev)
                    continue
                if ev & _EPOLLOUT:
                    self._flush(c)
                if ev & (_EPOLLIN | _EPOLLERRS) and not c.closed:
                    self._read(c)

    def _finish_turn(self, t0: float, c0: float) -> float:
        """The end of a turn that began at `t0` (thread CPU time `c0`): connections left over
        at the request budget, the `_end_turn` hook, queued output, the turn's stats. Returns
        the time it ends."""
        if self._backlog:
            backlog, self._backlog = self._backlog, []
            for c in backlog:
                if not c.closed:
                    self._consume(c, b"")
        self._end_turn()
        if self._dirty:
            self._flush_dirty()
        now = time.monotonic()
        self._count_turn(now - t0, c0)
        return now

    def _read(self, c: Conn) -> None:
        """One read. The common case of a rendezvous — one complete request that `_quick`
        executes, on a connection with nothing buffered either way — is answered here with
        one `send` and no further calls; everything else goes through `_consume`. With the C
        read path, such a connection's read, execution and reply all happen in C."""
        rq = self._read_quick
        if (
            rq is not None
            and c.authed
            and not c.buf
            and not c.out
            and not c.want_write
            and (c.mux or c.waiter is None)
        ):
            self._quick_done(c, rq(c, self._quick_ctx))  # validates a new one's handshake too
            return
        try:
            data = c.sock.recv(P.READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(c)
            return
        if not data:
            self._close(c)
            return
        quick = self._quick
        if quick is None or c.buf or c.out or c.mux or not c.validated or not c.authed:
            self._consume(c, data)
            return
        n = len(data)
        r = quick(c, data, 0, n)
        if r is None:
            self._consume(c, data)
            return
        rep, pos = r
        stats = self.stats
        stats["requests"] += 1
        if pos != n:  # more requests behind the first (executed): the rest the usual way
            if rep:
                c.out.append(rep)
                c.out_bytes += len(rep)
            self._consume(c, data[pos:])
            return
        stats["reads"] += 1
        if rep:
            self._send_now(c, rep)

    def _quick_done(self, c: Conn, r) -> None:
        """Finish what the C read path returned for c (see `rendezvous/store/_quickstore.c`)."""
        if r is None:
            return
        if r is False:
            self._close(c)
            return
        if type(r) is int:
            self.stats["reads"] += 1
            self.stats["requests"] += r
            return
        self._quick_rest(c, r)

    def _quick_rest(self, c: Conn, r: tuple) -> None:
        """A read the C path did not finish: (requests executed, their replies not sent yet,
        the rest of the read from the first frame it left to the Python path)."""
        nreq, unsent, rest = r
        stats = self.stats
        stats["requests"] += nreq
        if unsent:
            c.out.append(unsent)
            c.out_bytes += len(unsent)
        if rest:
            self._consume(c, rest)  # counts the read; flushes what is queued
        else:
            stats["reads"] += 1
            self._flush(c)

    def _consume(self, c: Conn, data: bytes) -> None:
        """Execute the complete requests in c's buffer + `data`, at most `_budget` of them
        (the rest wait for the next turn, so one busy client cannot starve the others)."""
        if c.buf:
            c.buf += data  # bytearray: amortised O(1) growth for large values
            buf = c.buf
        else:
            buf = data
        c.more = False
        try:
            pos = self._process(c, buf)
        except (DropConnection, P.ProtocolError) as e:
            self.log(f"{self._name} closed {c.peer}: {e}")
            self.stats["dropped"] += 1
            self._close(c)
            return
        if pos < len(buf):
            if buf is c.buf:
                if pos:
                    del buf[:pos]
            else:
                c.buf = bytearray(buf[pos:]) if pos else bytearray(buf)
            if not c.partial_since or pos:
                c.partial_since = time.monotonic()
        else:
            c.buf = b""
            c.partial_since = 0.0
        if c.more:
            self._backlog.append(c)
        if c.out and not c.want_write:
            self._flush(c)

    # -- output --------------------------------------------------------------------

    def _flush_dirty(self) -> None:
        d = self._dirty
        self._dirty = []
        if self._flush_out is not None:
            d = self._flush_out(d)  # the connections it leaves to _flush (a short send, ...)
        for c in d:
            if c.out and not c.closed and not c.want_write:
                self._flush(c)

    def _send_now(self, c: Conn, data: bytes) -> None:
        """Send `data` to c at once, unless output is queued before it (then it queues behind
        and goes with that). A short send queues the rest (`_flush`)."""
        if c.closed:
            return
        queued = bool(c.out) or c.want_write
        c.out.append(data)
        c.out_bytes += len(data)
        if queued:
            self._dirty.append(c)
        else:
            self._flush(c)  # one item: sent as is, no join

    def _flush(self, c: Conn) -> None:
        if c.closed:
            return
        out = c.out
        if not out:
            if c.want_write:
                c.want_write = False
                self._ep.modify(c.fd, _EPOLLIN)
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        try:
            sent = c.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(c)
            return
        if sent == len(data):
            out.clear()
            c.out_bytes = 0
            if c.want_write:
                c.want_write = False
                self._ep.modify(c.fd, _EPOLLIN)
            return
        rest = data[sent:]
        out.clear()
        out.append(rest)
        c.out_bytes = len(rest)
        if c.out_bytes > self.limits.max_pending_reply_bytes:
            self.log(
                f"{self._name} closed {c.peer}: it does not read its replies "
                f"({c.out_bytes} bytes pending)"
            )
            self.stats["dropped"] += 1
            self._close(c)
            return
        if not c.want_write:
            c.want_write = True
            self._ep.modify(c.fd, _EPOLLIN | _EPOLLOUT)

    # -- requests ------------------------------------------------------------------------

    def _process(self, c: Conn, buf) -> int:
        """Decode and handle the complete requests in `buf` (at most `_budget`); appends each
        reply (tagged on a mux connection) to `c.out`; returns the bytes consumed."""
        pos, n = 0, len(buf)
        lim = self.limits
        common, parse, parse_mux = P.parse_common, P.parse_request, P.parse_mux_request
        handle = self._handle
        out = c.out
        budget = self._budget
        nreq = 0
        quick = self._quick if not c.mux and c.validated and c.authed else None
        while pos < n:
            budget -= 1
            if budget < 0:
                c.more = True
                break
            if quick is not None:
                r = quick(c, buf, pos, n)
                if r is not None:
                    rep, pos = r
                    nreq += 1
                    if rep:
                        out.append(rep)
                        c.out_bytes += len(rep)
                    continue
            if c.mux:
                r = parse_mux(buf, pos, lim)
                if r is None:
                    break
                tag, req, pos = r
            else:
                r = common(buf, pos, lim) or parse(buf, pos, lim)
                if r is None:
                    break
                req, pos = r
                tag = -1
            rep = handle(c, req, tag)
            nreq += 1
            if rep:
                if tag >= 0:
                    out.append(P.enc_tag(tag))
                out.append(rep)
                c.out_bytes += len(rep)
            if c.closed:
                break
        self.stats["reads"] += 1
        self.stats["requests"] += nreq
        return pos

    def _handle(self, c: Conn, req: P.Request, tag: int) -> bytes | None:
        """Execute one request; its reply (None or b"" when there is none yet)."""
        raise NotImplementedError


class StoreServer(LoopServer):
    """A TCPStore-compatible server hosted in this process.

    `start()` binds (raising StoreError naming host:port when it cannot), starts the loop
    thread and returns once listening; `port` is the bound port; `kv` is a `LocalKV` over the
    same table; `stop()` closes every socket and joins the thread (idempotent); usable as a
    context manager. With `token`, connections must authenticate (see rendezvous.store.auth)."""

    _name = "store"

    def __init__(
        self,
        host: str = "0.0.0.0",
        port: int = 0,
        token: str | None = None,
        limits: P.Limits = P.DEFAULT_LIMITS,
        log: Callable[[str], None] | None = None,
        table: MemoryStore | None = None,
        nice: int | None = None,
        accel: bool = True,
    ) -> None:
        super().__init__(host, port, token, limits, log, nice, accel)
        self.table = table if table is not None else MemoryStore()
        self.kv = LocalKV(self.table)
        self._table_data = self.table._data  # read-only use by _quick (GET, WAIT present)
        self._read_quick, self._quick_ctx = _c_read_path(self, self.table, limits, self._budget)
        self._turn = c_accel("loop_turn") if self._read_quick is not None else None
        self._turn_ctx = self._quick_ctx
        self._max_key, self._max_value = limits.max_key_bytes, limits.max_value_bytes
        by_kind = {
            P.Kind.DATA: self._data,
            P.Kind.BLOCKING: self._wait,
            P.Kind.CANCEL: self._cancel,
        }
        self._handlers: dict[int, Callable] = {
            op: by_kind[kind] for op, kind in P.KIND_OF.items() if kind in by_kind
        }
        self._handlers.update(
            {
                Op.SET: self._set,
                Op.MULTI_SET: self._multi_set,
                Op.APPEND: self._append,
                Op.VALIDATE: self._validate,
                Op.PING: self._ping,
                Op.FT_MUX: self._mux,
            }
        )

    def _on_close(self, c: Conn) -> None:
        if c.waiter is not None:
            self.table.cancel(c.waiter)
            c.waiter = None
        for w in c.mux_waiters.values():
            self.table.cancel(w)
        c.mux_waiters.clear()

    # -- request execution -------------------------------------------------------------

    def _handle(self, c: Conn, req: P.Request, tag: int) -> bytes | None:
        if not c.authed or not c.validated:
            r = self._gate(c, req)
            if r is not False:
                return r
        return self._handlers[req.op](c, req, tag)

    def _gate(self, c: Conn, req: P.Request):
        """Handshake and auth checks; False = go on executing the request."""
        op = req.op
        if not c.validated:
            check_validate(req)
            c.validated = True
            return None
        if c.authed or op == Op.PING or op == Op.VALIDATE:
            return False
        if op == Op.SET and req.keys[0] == AUTH_KEY:
            return self._auth(c, req.values[0])
        raise DropConnection(f"unauthenticated {P.op_name(op)} refused (job token required)")

    def _auth(self, c: Conn, presented: bytes):
        if self.token is None or c.authed:
            return None
        if not token_matches(self.token, presented):
            raise DropConnection("wrong job token")
        c.authed = True
        return None

    def _quick(self, c: Conn, buf, pos: int, n: int) -> tuple[bytes | None, int] | None:
        """GET, SET, ADD and a one-key WAIT of plain connection `c`, decoded and executed in
        place (the same checks as `protocol.parse_common` and `_handle`; a WAIT that must wait
        registers its waiter as `_wait` does and has no reply yet); anything else — another
        op, an incomplete frame, a length over a limit, the auth key, an ADD to a non-counter —
        returns None and takes the general path."""
        if pos + 9 > n:
            return None
        op = buf[pos]
        if op == _SET or op == _ADD or op == _GET:
            s = pos + 9
        elif op == _WAIT:
            if pos + 17 > n or _u64(buf, pos + 1)[0] != 1:
                return None
            s = pos + 17
        else:
            return None
        kl = _u64(buf, s - 8)[0]
        e = s + kl
        if kl > self._max_key or e > n:
            return None
        key = buf[s:e]  # bytes when buf is (a fresh read); a buffered bytearray is copied:
        if type(key) is not bytes:
            key = bytes(key)
        if op == _SET:
            if e + 8 > n or key == AUTH_KEY:
                return None
            vl = _u64(buf, e)[0]
            ve = e + 8 + vl
            if vl > self._max_value or ve > n:
                return None
            v = buf[e + 8 : ve]
            self.table.set(key, v if type(v) is bytes else bytes(v))
            return None, ve
        if op == _ADD:
            if e + 8 > n:
                return None
            try:
                return _i64_pack(self.table.add(key, _i64(buf, e)[0])), e + 8
            except ValueError:
                return None  # the general path drops the connection, saying why
        if op == _GET:
            v = self._table_data.get(key)
            return (_EMPTY_VALUE if v is None else _u64_pack(len(v)) + v), e
        if key in self._table_data:  # WAIT for one key that is there (else register a waiter)
            return _STOP, e
        return self._wait_keys(c, -1, (key,)), e

    def _data(self, c: Conn, req: P.Request, tag: int) -> bytes:
        try:
            return P.encode_reply(req.op, apply(self.table, req))
        except ValueError as e:  # e.g. ADD to a key that holds no integer
            raise DropConnection(f"{P.op_name(req.op)} failed: {e}") from None

    def _set(self, c: Conn, req: P.Request, tag: int) -> bytes | None:
        if req.keys[0] == AUTH_KEY:
            return self._auth(c, req.values[0])
        return self._data(c, req, tag)

    def _multi_set(self, c: Conn, req: P.Request, tag: int) -> bytes:
        if AUTH_KEY in req.keys:
            raise DropConnection("MULTI_SET of the reserved key /ftrun/auth")
        return self._data(c, req, tag)

    def _append(self, c: Conn, req: P.Request, tag: int) -> bytes:
        key, value = req.keys[0], req.values[0]
        cur = self.table.get(key)
        most = self.limits.max_value_bytes
        if cur is not None and len(cur) + len(value) > most:
            raise DropConnection(
                f"APPEND would grow {key[:60]!r} to {len(cur) + len(value)} "
                f"bytes: at most {most} allowed"
            )
        return self._data(c, req, tag)

    def _validate(self, c: Conn, req: P.Request, tag: int) -> None:
        check_validate(req)

    def _ping(self, c: Conn, req: P.Request, tag: int) -> bytes:
        if req.num == P.CAPS_NONCE:  # a client asking for the extensions (protocol doc)
            return P.encode_reply(Op.PING, P.CAPS_NONCE ^ P.CAP_WAIT_VALUES)
        return P.encode_reply(Op.PING, req.num)

    def _mux(self, c: Conn, req: P.Request, tag: int) -> bytes:
        if req.num != P.MUX_MAGIC or tag >= 0:
            raise DropConnection(f"bad FT_MUX request (magic {req.num:#x})")
        c.mux = True
        return P.encode_reply(Op.FT_MUX, P.MUX_MAGIC)

    # -- waits -------------------------------------------------------------------------

    def _wait(self, c: Conn, req: P.Request, tag: int) -> bytes | None:
        """WAIT or BARRIER: STOP_WAITING now, or a waiter that answers when it fires."""
        if req.op == Op.WAIT:
            return self._wait_keys(c, tag, req.keys)
        if req.op == Op.FT_WAIT_VALUES:
            wake = _WakeValues(self, c, tag, req.keys)
            if self._registered(c, tag, self.table.wait(req.keys, wake)) is None:
                return None
            return self._answer(wake)
        wake = _Wake(self, c, tag)
        try:
            w = self.table.barrier(req.keys[0], req.num, wake)
        except ValueError as e:
            raise DropConnection(f"BARRIER failed: {e}") from None
        return self._registered(c, tag, w)

    def _wait_keys(self, c: Conn, tag: int, keys: tuple) -> bytes | None:
        """WAIT for `keys`: STOP_WAITING now, or a registered waiter (no reply yet)."""
        return self._registered(c, tag, self.table.wait(keys, _Wake(self, c, tag)))

    def _registered(self, c: Conn, tag: int, w) -> bytes | None:
        """Make waiter `w` (None: satisfied already) the current one of c (or of its tag)."""
        if w is None:
            return P.STOP_WAITING_REPLY
        if tag >= 0:
            c.mux_waiters[tag] = w
        else:
            if c.waiter is not None and not c.waiter.done:
                self.table.cancel(c.waiter)
            c.waiter = w
        return None

    def _answer(self, wake: "_Wake") -> bytes:
        """What a satisfied waiter is answered (untagged): STOP_WAITING, and for FT_WAIT_VALUES
        the values its keys hold now (b"" for one deleted since)."""
        if type(wake) is not _WakeValues:
            return P.STOP_WAITING_REPLY
        data = self._table_data
        return P.enc_wait_values([data.get(k, b"") for k in wake.keys])

    def _tagged_answer(self, wake: "_Wake", tag: int) -> bytes:
        answer = self._answer(wake)
        return answer if tag < 0 else P.enc_tag(tag) + answer

    def _deliver(self, c: Conn, wake: "_Wake", tag: int) -> None:
        """Answer the waiter of `c` whose callback is `wake` with STOP_WAITING, unless it is no
        longer the connection's current waiter: a CANCEL_WAIT that arrived while this delivery
        was queued (a write of another thread) has answered it already, in the order torch's
        client expects."""
        if c.closed:
            return
        if tag >= 0:
            w = c.mux_waiters.get(tag)
            if w is None or w.fire is not wake:
                return
            del c.mux_waiters[tag]
        else:
            w = c.waiter
            if w is None or w.fire is not wake:
                return
            c.waiter = None
        self._send_now(c, self._tagged_answer(wake, tag))

    def _cancel(self, c: Conn, req: P.Request, tag: int) -> bytes:
        """CANCEL_WAIT. A waiter that fired but whose STOP_WAITING is still queued (fired by a
        write of another thread) is answered now, ahead of the cancel's reply: the client reads
        STOP_WAITING, then WAIT_CANCELED (before: the queued STOP_WAITING came after the cancel's
        reply and the next request of that client read it as its own reply)."""
        if c.mux:
            w = c.mux_waiters.pop(req.num, None)
        else:
            w, c.waiter = c.waiter, None
        if w is not None and not self.table.cancel(w):
            data = self._tagged_answer(w.fire, req.num if c.mux else -1)
            c.out.append(data)
            c.out_bytes += len(data)
        return P.encode_reply(Op.CANCEL_WAIT, P.WAIT_CANCELED)
