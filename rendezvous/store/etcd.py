"""etcd v3 backend of the KV interface.

Owns: `EtcdKV`, a `KVStore` over an etcd v3 cluster through the `etcd3` client, plus what only
etcd offers and the membership code uses: leases (`grant_lease`, `put_with_lease`,
`refresh_lease`, `revoke_lease`), create-if-absent (`create`), consistent snapshots
(`get_prefix`) and watches (`watch_prefix`, `watch_key`), and guarded writes for fencing
(`put_if`, `compare_set_if`, `delete_if`: one transaction each), and the shared watch stream
(`_WatchHub`). Reaching etcd — the etcd3 client, endpoints, TLS/auth settings, failover and
retries — is `rendezvous.store.etcd_channel` (`EtcdKV` is an `EtcdChannel`; its `Endpoint`,
`EtcdConf`, `parse_endpoints` and `DEFAULT_PORT` are re-exported here).

Logical key `k` is stored as etcd key `f"{root}/{k}"`; the root names the job, so several jobs
can share one etcd. Counters are decimal ASCII, as in torch's TCPStore.

The `etcd3` 0.12 client's watch thread dies noisily ("Cannot invoke RPC: Channel closed!")
when the client is closed, so watches here use our own stream (`_WatchHub`) that is cancelled
before close (its other problem, the protobuf runtime, is `etcd_channel`'s).

Every failure surfaces as one line: `StoreAuthError` (credentials), `StoreTimeout`, or
`StoreError` (unreachable, protocol), never a gRPC traceback.
"""

from __future__ import annotations

import collections
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from rendezvous.kv import KVStore, StoreError, StoreTimeout
from rendezvous.store.etcd_channel import (
    DEFAULT_PORT,
    ETCD3,
    ETCD3_ERROR,
    Endpoint,
    EtcdChannel,
    EtcdConf,
    classify,
    parse_endpoints,
)

__all__ = [
    "DEFAULT_PORT",
    "Endpoint",
    "EtcdConf",
    "EtcdKV",
    "EtcdLease",
    "LeaseExpiredError",
    "WatchEvent",
    "WatchHandle",
    "parse_endpoints",
]

log = logging.getLogger(__name__)

if ETCD3 is not None:
    TX = ETCD3.transactions  # compare / put / get / delete of a transaction
    _RPC = ETCD3.etcdrpc


# --------------------------------------------------------------------------------------------
# Records returned to callers


@dataclass(frozen=True)
class EtcdLease:
    """A granted lease: keys put with it vanish `ttl` s after the last refresh."""

    id: int
    ttl: int


class LeaseExpiredError(StoreError):
    """The lease no longer exists (expired or revoked); keys attached to it are gone."""


@dataclass(frozen=True)
class WatchEvent:
    """One change under a watch. kind is "put" or "delete"; key is logical."""

    kind: str
    key: str
    value: bytes
    revision: int
    lease: int = 0


# --------------------------------------------------------------------------------------------
# Watches


class _Watch:
    """One subscription on the shared stream (re-created after a reconnect)."""

    def __init__(
        self,
        key: bytes,
        range_end: bytes | None,
        callback: Callable[[WatchEvent], None],
        start_revision: int,
    ) -> None:
        self.key = key
        self.range_end = range_end
        self.callback = callback
        self.next_rev = start_revision  # 0 = from now
        self.id: int | None = None
        self.created = threading.Event()
        self.error = ""
        self.cancelled = False


class WatchHandle:
    """Returned by `EtcdKV.watch_prefix/watch_key`; `cancel()` stops the callbacks."""

    def __init__(self, hub: "_WatchHub", watch: _Watch) -> None:
        self._hub = hub
        self._watch = watch

    def cancel(self) -> None:
        self._hub.cancel(self._watch)

    @property
    def error(self) -> str:
        """Why etcd ended this watch ("" while it is running)."""
        return self._watch.error


class _WatchHub:
    """One bidirectional Watch stream per EtcdKV, owned by one daemon thread.

    Subscriptions survive reconnects (they resume from the revision after the last event they
    saw). Callbacks run on the hub thread and must be quick and must not create watches."""

    def __init__(self, kv: "EtcdKV") -> None:
        self._kv = kv
        self._lock = threading.Lock()
        self._all: set[_Watch] = set()
        self._by_id: dict[int, _Watch] = {}
        self._pending: collections.deque[_Watch] = collections.deque()
        self._requests: queue.Queue | None = None
        self._call: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def watch(
        self,
        key: bytes,
        range_end: bytes | None,
        callback: Callable[[WatchEvent], None],
        start_revision: int,
        timeout: float,
    ) -> _Watch:
        if self._thread is not None and threading.current_thread() is self._thread:
            raise StoreError(
                "an etcd watch or wait() cannot start inside a watch callback "
                "(it would wait for its own thread); hand the work to another thread"
            )
        w = _Watch(key, range_end, callback, start_revision)
        with self._lock:
            if self._stop.is_set():
                raise StoreError("etcd client is closed")
            self._all.add(w)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="ftrun-etcd-watch", daemon=True
                )
                self._thread.start()
            elif self._requests is not None:
                self._send_create(w)
        if not w.created.wait(timeout):
            self.cancel(w)
            raise StoreTimeout(
                f"etcd did not confirm a watch on {key.decode(errors='replace')!r} "
                f"within {timeout:.1f}s"
            )
        if w.error:
            self.cancel(w)
            raise StoreError(f"etcd refused a watch on {key.decode(errors='replace')!r}: {w.error}")
        return w

    def cancel(self, w: _Watch) -> None:
        with self._lock:
            w.cancelled = True
            self._all.discard(w)
            if w.id is not None and self._by_id.get(w.id) is w:
                del self._by_id[w.id]
                self._send_cancel(w.id)

    def close(self) -> None:
        with self._lock:
            self._stop.set()
            if self._requests is not None:
                self._requests.put(None)
            call = self._call
        if call is not None:
            call.cancel()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5.0)

    # -- stream thread --------------------------------------------------------------------------

    def _send_create(self, w: _Watch) -> None:  # caller holds the lock
        assert self._requests is not None
        req = _RPC.WatchCreateRequest(key=w.key)
        if w.range_end is not None:
            req.range_end = w.range_end
        if w.next_rev:
            req.start_revision = w.next_rev
        self._pending.append(w)
        self._requests.put(_RPC.WatchRequest(create_request=req))

    def _send_cancel(self, watch_id: int) -> None:  # caller holds the lock
        if self._requests is not None:
            self._requests.put(
                _RPC.WatchRequest(cancel_request=_RPC.WatchCancelRequest(watch_id=watch_id))
            )

    def _run(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            stream_client = None
            try:
                stream_client, stub, creds, metadata = self._kv._watch_stub()
                requests: queue.Queue = queue.Queue()
                call = stub.Watch(iter(requests.get, None), credentials=creds, metadata=metadata)
            except (StoreError, ValueError) as exc:
                log.debug("etcd watch stream cannot start: %s", exc)
                self._stop.wait(backoff)
                backoff = min(1.0, backoff * 2)
                continue
            with self._lock:
                if self._stop.is_set():
                    requests.put(None)
                    call.cancel()
                    return
                self._requests, self._call = requests, call
                self._pending.clear()
                self._by_id.clear()
                for w in list(self._all):
                    w.id = None
                    self._send_create(w)
            try:
                for resp in call:
                    self._handle(resp)
                    backoff = 0.05
            except Exception as exc:  # grpc.RpcError (cancelled/unavailable) or channel closed
                if not self._stop.is_set():
                    log.debug("etcd watch stream broke: %s", classify(exc)[1])
            finally:
                with self._lock:
                    self._requests, self._call = None, None
                requests.put(None)
            if self._stop.is_set():
                return
            self._kv._stream_failed(stream_client)
            self._stop.wait(backoff)
            backoff = min(1.0, backoff * 2)

    def _handle(self, resp: Any) -> None:
        with self._lock:
            if resp.created:
                w = self._pending.popleft() if self._pending else None
                if w is None:
                    return
                if resp.canceled or resp.compact_revision:
                    w.error = resp.cancel_reason or f"revision compacted at {resp.compact_revision}"
                    self._all.discard(w)
                    w.created.set()
                    return
                if w.cancelled:
                    self._send_cancel(resp.watch_id)
                    return
                w.id = resp.watch_id
                self._by_id[resp.watch_id] = w
                w.created.set()
                return
            w = self._by_id.get(resp.watch_id)
            if w is None:
                return
            if resp.canceled or resp.compact_revision:
                w.error = resp.cancel_reason or f"revision compacted at {resp.compact_revision}"
                self._all.discard(w)
                self._by_id.pop(resp.watch_id, None)
                log.warning("etcd ended a watch on %s: %s", w.key.decode(errors="replace"), w.error)
                return
        for ev in resp.events:
            if w.cancelled:
                return
            w.next_rev = ev.kv.mod_revision + 1
            kind = "delete" if ev.type == 1 else "put"
            event = WatchEvent(
                kind,
                self._kv._logical(ev.kv.key),
                bytes(ev.kv.value),
                ev.kv.mod_revision,
                ev.kv.lease,
            )
            try:
                w.callback(event)
            except Exception:  # a broken callback must not kill the stream
                log.exception("etcd watch callback for %s failed", event.key)


# --------------------------------------------------------------------------------------------
# The store


class EtcdKV(EtcdChannel, KVStore):
    """`KVStore` on etcd v3. Thread-safe; one gRPC channel at a time, failing over between
    `endpoints` when one is unreachable (each request retries for up to
    `conf.request_timeout` s). Construction checks the connection and credentials."""

    def __init__(
        self, endpoints: str | Iterable[str | Endpoint], root: str, conf: EtcdConf | None = None
    ) -> None:
        if ETCD3 is None:
            raise StoreError(ETCD3_ERROR)
        eps = parse_endpoints(endpoints)
        if not isinstance(root, str) or not root.strip("/"):
            raise ValueError(
                f"etcd root {root!r} must be a non-empty key prefix such as /ftrun/job1"
            )
        self._root = root.rstrip("/")
        self._prefix = self._root + "/"
        self._prefix_b = self._prefix.encode()
        super().__init__(eps, conf, probe_key=self._prefix_b)
        self._hub = _WatchHub(self)
        self._connect()

    # -- connection ----------------------------------------------------------------------------

    @property
    def root(self) -> str:
        return self._root

    def __repr__(self) -> str:
        eps = ",".join(map(str, self._endpoints))
        return f"EtcdKV({eps}, root={self._root!r})"

    def close(self) -> None:
        if not self._shut():
            return
        self._hub.close()
        self._close_client()

    # -- keys ----------------------------------------------------------------------------------

    def _k(self, key: str) -> bytes:
        if not isinstance(key, str):
            raise TypeError(f"store key must be str, got {type(key).__name__}")
        return (self._prefix + key).encode()

    def _logical(self, raw: bytes) -> str:
        return (
            raw[len(self._prefix_b) :].decode(errors="replace")
            if raw.startswith(self._prefix_b)
            else raw.decode(errors="replace")
        )

    @staticmethod
    def _bytes(value: bytes | str) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    # -- KVStore -------------------------------------------------------------------------------

    def set(self, key: str, value: bytes) -> None:
        k, v = self._k(key), self._bytes(value)
        self._call("put", lambda c: c.put(k, v))

    def try_get(self, key: str) -> bytes | None:
        k = self._k(key)
        resp = self._call("get", lambda c: c.get_response(k))
        return bytes(resp.kvs[0].value) if resp.kvs else None

    def get(self, key: str, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        while True:
            value = self.try_get(key)
            if value is not None:
                return value
            if not self.wait([key], max(0.0, deadline - time.monotonic())):
                raise StoreTimeout(f"key {key!r} did not appear in etcd within {timeout:.1f}s")

    def add(self, key: str, amount: int) -> int:
        k = self._k(key)
        resp = self._call("get", lambda c: c.get_response(k))
        kvs = list(resp.kvs)
        while True:
            if kvs:
                raw = bytes(kvs[0].value)
                try:
                    cur = int(raw)
                except ValueError:
                    raise StoreError(
                        f"add on {key!r}: it holds {raw[:40]!r}, not a counter"
                    ) from None
                rev = kvs[0].mod_revision
                cmp = lambda: TX.Mod(k) == rev  # noqa: E731
            else:
                cur = 0
                cmp = lambda: TX.Version(k) == 0  # noqa: E731
            new = cur + int(amount)
            ok, responses = self._call(
                "add",
                lambda c: c.transaction(
                    compare=[cmp()], success=[TX.Put(k, str(new).encode())], failure=[TX.Get(k)]
                ),
            )
            if ok:
                return new
            kvs = _range_kvs(responses)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        k, exp, des = self._k(key), self._bytes(expected), self._bytes(desired)
        for _ in range(1000):
            ok, responses = self._call(
                "compare_set",
                lambda c: c.transaction(
                    compare=[TX.Value(k) == exp], success=[TX.Put(k, des)], failure=[TX.Get(k)]
                ),
            )
            if ok:
                return des
            kvs = _range_kvs(responses)
            if kvs:
                return bytes(kvs[0].value)
            if exp != b"":
                return exp
            ok, responses = self._call(
                "compare_set",
                lambda c: c.transaction(
                    compare=[TX.Version(k) == 0], success=[TX.Put(k, des)], failure=[TX.Get(k)]
                ),
            )
            if ok:
                return des
            kvs = _range_kvs(responses)
            if kvs and bytes(kvs[0].value) != b"":
                return bytes(kvs[0].value)
        raise StoreError(f"compare_set on {key!r} did not settle (key keeps changing)")

    def _snapshot(self, raw_keys: list[bytes], values: bool) -> tuple[dict[bytes, bytes], int]:
        """Which of `raw_keys` (sorted) exist, with their values when `values` (else b""), and
        the revision of that read: one request (a get of one key, else one range from the
        first key to the last; with `values` it carries the values of the keys between too)."""
        if len(raw_keys) == 1:
            resp = self._call("get", lambda c: c.get_response(raw_keys[0]))
        else:
            lo, hi = raw_keys[0], raw_keys[-1] + b"\0"
            req = lambda c: c.kvstub.Range(  # noqa: E731
                _RPC.RangeRequest(key=lo, range_end=hi, keys_only=not values),
                c.timeout,
                credentials=c.call_credentials,
                metadata=c.metadata,
            )
            resp = self._call("get", req)
        wanted = set(raw_keys)
        held = {bytes(kv.key): bytes(kv.value) if values else b"" for kv in resp.kvs}
        return {k: v for k, v in held.items() if k in wanted}, resp.header.revision

    def wait(self, keys: Iterable[str], timeout: float) -> bool:
        raw = sorted({self._k(k) for k in keys})
        return not raw or _watch_until_held(self, raw, timeout, values=False) is not None

    def wait_values(self, keys: list[str], timeout: float) -> list[bytes] | None:
        """One read and, while a key is missing, a watch whose events carry the values: the
        values come with the wake-up, no read after it (see `_watch_until_held`)."""
        raw = [self._k(k) for k in keys]
        if not raw:
            return []
        held = _watch_until_held(self, sorted(set(raw)), timeout, values=True)
        return None if held is None else [held[k] for k in raw]

    def delete(self, key: str) -> bool:
        k = self._k(key)
        resp = self._call("delete", lambda c: c.delete(k, return_response=True))
        return resp.deleted >= 1

    def keys(self, prefix: str = "") -> list[str]:
        k = self._k(prefix)
        resp = self._call(
            "list",
            lambda c: c.kvstub.Range(
                _RPC.RangeRequest(key=k, range_end=_prefix_end(k), keys_only=True),
                c.timeout,
                credentials=c.call_credentials,
                metadata=c.metadata,
            ),
        )
        return sorted(self._logical(bytes(kv.key)) for kv in resp.kvs)

    def delete_prefix(self, prefix: str) -> int:
        k = self._k(prefix)
        resp = self._call("delete_prefix", lambda c: c.delete_prefix(k))
        return int(resp.deleted)

    def clear_except(self, keep_prefix: str) -> int:
        if keep_prefix == "":
            return 0
        keep = self._k(keep_prefix)
        ops = [
            TX.Delete(self._prefix_b, range_end=keep),
            TX.Delete(_prefix_end(keep), range_end=_prefix_end(self._prefix_b)),
        ]
        _ok, responses = self._call(
            "clear", lambda c: c.transaction(compare=[], success=ops, failure=[])
        )
        return sum(
            int(r.response_delete_range.deleted)
            for r in responses
            if hasattr(r, "response_delete_range")
        )

    # -- etcd extras: snapshot, create, leases, watches ---------------------------------------

    def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]:
        """Every key under `prefix` with its value, and the etcd revision of that snapshot
        (watch from revision + 1 to see every later change exactly once)."""
        k = self._k(prefix)
        resp = self._call(
            "list",
            lambda c: c.kvstub.Range(
                _RPC.RangeRequest(key=k, range_end=_prefix_end(k)),
                c.timeout,
                credentials=c.call_credentials,
                metadata=c.metadata,
            ),
        )
        return (
            {self._logical(bytes(kv.key)): bytes(kv.value) for kv in resp.kvs},
            int(resp.header.revision),
        )

    def create(self, key: str, value: bytes, lease: EtcdLease | None = None) -> bool:
        """Put `key` only if it does not exist (atomically); True when this call created it."""
        k, v = self._k(key), self._bytes(value)
        lid = lease.id if lease is not None else 0
        ok, _ = self._call(
            "create",
            lambda c: c.transaction(
                compare=[TX.Version(k) == 0], success=[TX.Put(k, v, lease=lid)], failure=[]
            ),
        )
        return bool(ok)

    def put_if(self, key: str, value: bytes, guard_key: str, guard_value: bytes) -> bool:
        """Set `key` only if `guard_key` holds exactly `guard_value` (one transaction); True
        when written. Fences writes by an agent whose node record is gone or replaced."""
        k, v = self._k(key), self._bytes(value)
        g, gv = self._k(guard_key), self._bytes(guard_value)
        ok, _ = self._call(
            "put_if",
            lambda c: c.transaction(
                compare=[TX.Value(g) == gv], success=[TX.Put(k, v)], failure=[]
            ),
        )
        return bool(ok)

    def delete_if(self, key: str, value: bytes) -> bool:
        """Delete `key` only while it holds exactly `value`; True when deleted."""
        k, v = self._k(key), self._bytes(value)
        ok, _ = self._call(
            "delete_if",
            lambda c: c.transaction(compare=[TX.Value(k) == v], success=[TX.Delete(k)], failure=[]),
        )
        return bool(ok)

    def compare_set_if(
        self, key: str, expected: bytes, desired: bytes, guard_key: str, guard_value: bytes
    ) -> bytes | None:
        """`compare_set` (torch semantics) that only happens while `guard_key` holds exactly
        `guard_value`; None when the guard fails (nothing written)."""
        k, exp, des = self._k(key), self._bytes(expected), self._bytes(desired)
        g, gv = self._k(guard_key), self._bytes(guard_value)
        guard = TX.Value(g) == gv
        cond = (TX.Version(k) == 0) if exp == b"" else (TX.Value(k) == exp)
        ok, _ = self._call(
            "compare_set_if",
            lambda c: c.transaction(compare=[guard, cond], success=[TX.Put(k, des)], failure=[]),
        )
        if ok:
            return des
        ok, responses = self._call(
            "compare_set_if",
            lambda c: c.transaction(compare=[guard], success=[TX.Get(k)], failure=[]),
        )
        if not ok:
            return None
        kvs = _range_kvs(responses)
        if kvs:
            return bytes(kvs[0].value)
        return exp

    def grant_lease(self, ttl: float) -> EtcdLease:
        """A new lease of `ttl` seconds (rounded up to whole seconds, at least 1)."""
        if not ttl > 0:
            raise ValueError(f"lease ttl={ttl!r} must be > 0 seconds")
        secs = max(1, math.ceil(ttl))
        lease = self._call("lease grant", lambda c: c.lease(secs))
        if int(lease.ttl) > secs:
            log.info(
                "etcd granted a %ds lease (asked for %ds; its minimum follows the "
                "election timeout)",
                lease.ttl,
                secs,
            )
        return EtcdLease(int(lease.id), int(lease.ttl))

    def put_with_lease(self, key: str, value: bytes, lease: EtcdLease) -> None:
        """Set `key`; it is deleted when `lease` expires or is revoked."""
        k, v = self._k(key), self._bytes(value)
        self._call("put", lambda c: c.put(k, v, lease=lease.id))

    def refresh_lease(self, lease: EtcdLease) -> int:
        """Keep `lease` alive; return its renewed TTL. Raises LeaseExpiredError when gone."""
        responses = self._call("lease refresh", lambda c: list(c.refresh_lease(lease.id)))
        ttl = int(responses[0].TTL) if responses else 0
        if ttl <= 0:
            raise LeaseExpiredError(f"etcd lease {lease.id:x} has expired")
        return ttl

    def revoke_lease(self, lease: EtcdLease) -> None:
        """End `lease` now, deleting its keys. A lease that is already gone is fine."""
        try:
            self._call("lease revoke", lambda c: c.revoke_lease(lease.id))
        except StoreError as exc:
            if "not found" not in str(exc):
                raise

    def watch_prefix(
        self, prefix: str, callback: Callable[[WatchEvent], None], start_revision: int = 0
    ) -> WatchHandle:
        """Call `callback(WatchEvent)` for every put/delete under `prefix` (from
        `start_revision` when > 0, else from now) until `cancel()`. Callbacks run on the watch
        thread in revision order; keep them short and do not create watches inside them."""
        k = self._k(prefix)
        w = self._hub.watch(
            k, _prefix_end(k), callback, start_revision, timeout=self._conf.request_timeout
        )
        return WatchHandle(self._hub, w)

    def watch_key(
        self, key: str, callback: Callable[[WatchEvent], None], start_revision: int = 0
    ) -> WatchHandle:
        """Like watch_prefix for exactly one key."""
        w = self._hub.watch(
            self._k(key), None, callback, start_revision, timeout=self._conf.request_timeout
        )
        return WatchHandle(self._hub, w)

    def wait_deleted(self, key: str, timeout: float) -> bool:
        """Block until `key` does not exist; True when gone, False on timeout."""
        k = self._k(key)
        deadline = time.monotonic() + max(0.0, timeout)
        resp = self._call("get", lambda c: c.get_response(k))
        if not resp.kvs:
            return True
        if timeout <= 0:
            return False
        gone = threading.Event()

        def on_event(ev: WatchEvent) -> None:
            if ev.kind == "delete":
                gone.set()

        w = _watch_within(self, k, None, on_event, int(resp.header.revision) + 1, deadline)
        if w is None:
            return False
        try:
            return gone.wait(max(0.0, deadline - time.monotonic()))
        finally:
            self._hub.cancel(w)


def _watch_until_held(
    kv: EtcdKV, raw: list[bytes], timeout: float, values: bool
) -> dict[bytes, bytes] | None:
    """Until every key of `raw` (sorted, raw) exists at once: a snapshot (`EtcdKV._snapshot`),
    then a watch over their range from the revision after it, each event putting or removing
    a key (with its value when `values`). Every key's value (b"" unless `values`); None when
    `timeout` s ran out."""
    deadline = time.monotonic() + max(0.0, timeout)
    held, rev = kv._snapshot(raw, values)
    if len(held) == len(raw):
        return held
    if timeout <= 0:
        return None
    wanted = set(raw)
    cond = threading.Condition()

    def on_event(ev: WatchEvent) -> None:
        kb = kv._k(ev.key)
        if kb in wanted:
            with cond:
                if ev.kind == "put":
                    held[kb] = ev.value if values else b""
                else:
                    held.pop(kb, None)
                cond.notify_all()

    hi = None if len(raw) == 1 else raw[-1] + b"\0"
    w = _watch_within(kv, raw[0], hi, on_event, rev + 1, deadline)
    if w is None:
        return None
    try:
        with cond:
            while len(held) < len(raw):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                cond.wait(left)
            return dict(held)
    finally:
        kv._hub.cancel(w)


def _watch_within(
    kv: EtcdKV,
    key: bytes,
    range_end: bytes | None,
    callback: Callable[[WatchEvent], None],
    start_revision: int,
    deadline: float,
) -> _Watch | None:
    """The watch of a wait that ends at `deadline`; None when etcd confirmed it too late for
    the wait (the wait timed out: a short wait polled on a loaded machine, e.g. the
    controller's status wait in 0.02 s slices). StoreTimeout only when etcd did not confirm it
    within its whole request timeout."""
    left = deadline - time.monotonic()
    try:
        return kv._hub.watch(
            key,
            range_end,
            callback,
            start_revision,
            timeout=max(0.1, min(kv._conf.request_timeout, left)),
        )
    except StoreTimeout:
        if left >= kv._conf.request_timeout:
            raise
        return None


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key that starts with `prefix`."""
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\0"


def _range_kvs(responses: list[Any]) -> list[Any]:
    """The KeyValue messages of the first range response in an etcd3 txn result."""
    for r in responses:
        if isinstance(r, list):
            return [_KV(v, m.mod_revision) for v, m in r]
    return []


class _KV:
    """A (value, mod_revision) pair from etcd3's txn range results."""

    __slots__ = ("value", "mod_revision")

    def __init__(self, value: bytes, mod_revision: int) -> None:
        self.value = value
        self.mod_revision = mod_revision
