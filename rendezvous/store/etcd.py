"""etcd v3 backend of the KV interface.

Owns: `EtcdKV`, a `KVStore` over an etcd v3 cluster through the `etcd3` client, plus what only
etcd offers and the membership code uses: leases (`grant_lease`, `put_with_lease`,
`refresh_lease`, `revoke_lease`), create-if-absent (`create`), consistent snapshots
(`get_prefix`) and watches (`watch_prefix`, `watch_key`), and guarded writes for fencing
(`put_if`, `compare_set_if`, `delete_if`: one transaction each). Also owns the TLS/auth settings
(`EtcdConf.from_rdzv_conf`); endpoint strings are parsed by `rendezvous.store.endpoints`
(`parse_endpoints` here only applies etcd's default port).

Logical key `k` is stored as etcd key `f"{root}/{k}"`; the root names the job, so several jobs
can share one etcd. Counters are decimal ASCII, as in torch's TCPStore.

Two problems of the `etcd3` 0.12 client are handled here so users never meet them:
  * its generated protobuf code only loads with the pure-Python protobuf runtime, so
    `PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python` is set while etcd3 is imported (and the
    previous value restored, so child processes are not slowed down);
  * its watch thread dies noisily ("Cannot invoke RPC: Channel closed!") when the client is
    closed, so watches here use our own stream (`_WatchHub`) that is cancelled before close.

Every failure surfaces as one line: `StoreAuthError` (credentials), `StoreTimeout`, or
`StoreError` (unreachable, protocol), never a gRPC traceback.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import queue
import ssl
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from rendezvous.kv import KVStore, StoreAuthError, StoreError, StoreTimeout
from rendezvous.store.endpoints import ETCD_DEFAULT_PORT
from rendezvous.store.endpoints import Endpoint as AnyEndpoint
from rendezvous.store.endpoints import parse_endpoints as parse_endpoint_list

log = logging.getLogger(__name__)

DEFAULT_PORT = ETCD_DEFAULT_PORT
_PB_ENV = "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"


def _load_etcd3() -> tuple[Any, str]:
    """Import etcd3 (and grpc) with the pure-Python protobuf runtime.

    Returns (etcd3 module, "") or (None, one-line reason)."""
    impl = ""
    if "google.protobuf.internal.api_implementation" in sys.modules:
        impl = sys.modules["google.protobuf.internal.api_implementation"].Type()
    old = os.environ.get(_PB_ENV)
    os.environ[_PB_ENV] = "python"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import etcd3  # noqa: PLC0415
            import etcd3.etcdrpc  # noqa: PLC0415
            import etcd3.transactions  # noqa: PLC0415
            import grpc  # noqa: F401, PLC0415
        return etcd3, ""
    except ImportError as exc:
        return None, f"the etcd backend needs the etcd3 package (pip install etcd3): {exc}"
    except TypeError as exc:
        if impl and impl != "python":
            return None, (
                f"etcd3 cannot load: google.protobuf was imported with the {impl!r} runtime "
                f"before rendezvous.store.etcd; set {_PB_ENV}=python in the environment, or import "
                "rendezvous.store.etcd before anything that uses protobuf"
            )
        return None, f"etcd3 cannot load its protobuf code: {str(exc).splitlines()[0]}"
    finally:
        if old is None:
            os.environ.pop(_PB_ENV, None)
        else:
            os.environ[_PB_ENV] = old


_ETCD3, _ETCD3_ERROR = _load_etcd3()
if _ETCD3 is not None:
    import grpc

    _TX = _ETCD3.transactions
    _RPC = _ETCD3.etcdrpc


# --------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class Endpoint(AnyEndpoint):
    """One etcd client endpoint (port 2379 unless given)."""

    port: int = DEFAULT_PORT


def parse_endpoints(spec: str | Iterable[str | AnyEndpoint]) -> list[Endpoint]:
    """Parse "h1[:p],h2[:p],[v6]:p" (or a list of such strings or Endpoints) into etcd
    endpoints (port 2379 by default), with the one parser of `rendezvous.store.endpoints`.
    Raises ValueError (`EndpointError`) naming the bad entry."""
    return [
        ep if isinstance(ep, Endpoint) else Endpoint(ep.host, ep.port)
        for ep in parse_endpoint_list(spec, DEFAULT_PORT, what="etcd endpoint")
    ]


_CONF_KEYS = ("protocol", "cacert", "cert", "key", "user", "password")


@dataclass(frozen=True)
class EtcdConf:
    """TLS and authentication settings for `EtcdKV` (from `--rdzv_conf`)."""

    protocol: str = "http"
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    request_timeout: float = 10.0  # per request; also bounds retries on an unreachable etcd

    def __post_init__(self) -> None:
        if self.protocol not in ("http", "https"):
            raise ValueError(
                f"rdzv_conf protocol={self.protocol!r} is not valid; use http or https"
            )
        tls = [n for n in ("cacert", "cert", "key") if getattr(self, n)]
        if tls and self.protocol != "https":
            raise ValueError(f"rdzv_conf {'/'.join(tls)} need protocol=https (got protocol=http)")
        if bool(self.cert) != bool(self.key):
            raise ValueError(
                "rdzv_conf cert and key must be given together (client certificate "
                "and its private key)"
            )
        for name in tls:
            path = getattr(self, name)
            if not os.path.isfile(path):
                raise ValueError(f"rdzv_conf {name}={path!r}: no such file")
        if bool(self.user) != bool(self.password):
            raise ValueError("rdzv_conf user and password must be given together")
        if not self.request_timeout > 0:
            raise ValueError(f"etcd request_timeout={self.request_timeout!r} must be > 0 seconds")

    @classmethod
    def from_rdzv_conf(cls, conf: Mapping[str, object]) -> "EtcdConf":
        """Pick cacert, cert, key, user, password, protocol from a `--rdzv_conf` dict (other
        keys belong to other components and are ignored). Setting cacert/cert/key without
        `protocol` implies https."""
        vals: dict[str, Any] = {}
        for name in _CONF_KEYS:
            v = conf.get(name)
            if v is None or v == "":
                continue
            if not isinstance(v, str):
                raise ValueError(f"rdzv_conf {name}={v!r} must be a string")
            vals[name] = v.strip()
        if "protocol" in vals:
            vals["protocol"] = vals["protocol"].lower()
        elif any(n in vals for n in ("cacert", "cert", "key")):
            vals["protocol"] = "https"
        return cls(**vals)

    def ca_file(self) -> str | None:
        """CA bundle to verify the server with (https only): cacert or the system bundle."""
        if self.protocol != "https":
            return None
        if self.cacert:
            return self.cacert
        paths = ssl.get_default_verify_paths()
        for cand in (paths.cafile, paths.openssl_cafile, "/etc/ssl/certs/ca-certificates.crt"):
            if cand and os.path.isfile(cand):
                return cand
        raise ValueError("rdzv_conf protocol=https: no system CA bundle found; pass cacert=<file>")


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
# Error classification


def _rpc_error(exc: BaseException) -> Any:
    """The grpc.RpcError behind `exc` (etcd3 re-raises its own classes without details)."""
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 5:
        if isinstance(cur, grpc.RpcError):
            return cur
        cur = cur.__context__
        seen += 1
    return None


def _classify(exc: BaseException) -> tuple[str, str]:
    """-> (kind, detail) with kind in unavailable|timeout|auth|token|closed|other."""
    rpc = _rpc_error(exc)
    if rpc is not None and hasattr(rpc, "code"):
        code = rpc.code()
        detail = (rpc.details() or "").strip() or str(code)
        low = detail.lower()
        if "invalid auth token" in low or ("auth token" in low and "expired" in low):
            return "token", detail
        if (
            code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
            or "authentication failed" in low
            or "user name is empty" in low
            or "permission denied" in low
            or "invalid user id or password" in low
        ):
            return "auth", detail
        if code == grpc.StatusCode.UNAVAILABLE:
            return "unavailable", detail
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "timeout", detail
        return "other", detail
    if isinstance(exc, ValueError) and "channel closed" in str(exc).lower():
        return "closed", "client closed"
    name = type(exc).__name__
    if name == "ConnectionFailedError":
        return "unavailable", "connection failed"
    if name == "ConnectionTimeoutError":
        return "timeout", "request timed out"
    return "other", f"{name}: {str(exc).splitlines()[0] if str(exc) else ''}"


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
                    log.debug("etcd watch stream broke: %s", _classify(exc)[1])
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


class EtcdKV(KVStore):
    """`KVStore` on etcd v3. Thread-safe; one gRPC channel at a time, failing over between
    `endpoints` when one is unreachable (each request retries for up to
    `conf.request_timeout` s). Construction checks the connection and credentials."""

    def __init__(
        self, endpoints: str | Iterable[str | Endpoint], root: str, conf: EtcdConf | None = None
    ) -> None:
        if _ETCD3 is None:
            raise StoreError(_ETCD3_ERROR)
        self._endpoints = parse_endpoints(endpoints)
        if not isinstance(root, str) or not root.strip("/"):
            raise ValueError(
                f"etcd root {root!r} must be a non-empty key prefix such as /ftrun/job1"
            )
        self._root = root.rstrip("/")
        self._prefix = self._root + "/"
        self._prefix_b = self._prefix.encode()
        self._conf = conf or EtcdConf()
        self._ca_file = self._conf.ca_file()
        self._lock = threading.Lock()
        self._client: Any = None
        self._index = 0
        self._closed = False
        self._hub = _WatchHub(self)
        self._connect()

    # -- connection ----------------------------------------------------------------------------

    @property
    def endpoints(self) -> list[Endpoint]:
        return list(self._endpoints)

    @property
    def root(self) -> str:
        return self._root

    def __repr__(self) -> str:
        eps = ",".join(map(str, self._endpoints))
        return f"EtcdKV({eps}, root={self._root!r})"

    def _new_client(self, ep: Endpoint) -> Any:
        c = self._conf
        options = [
            ("grpc.enable_http_proxy", 0),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
        ]
        client = _ETCD3.client(
            host=f"[{ep.host}]" if ":" in ep.host else ep.host,
            port=ep.port,
            ca_cert=self._ca_file,
            cert_key=c.key,
            cert_cert=c.cert,
            timeout=c.request_timeout,
            user=c.user,
            password=c.password,
            grpc_options=options,
        )
        if not client.uses_secure_channel:
            # gRPC refuses call credentials on plaintext channels; the token also travels as
            # metadata, which is what etcd reads.
            client.call_credentials = None
        return client

    def _connect(self) -> None:
        """Find a reachable endpoint (in order), authenticate, and probe one read."""
        errors: list[str] = []
        deadline = time.monotonic() + self._conf.request_timeout
        delay = 0.05
        while True:
            for i in range(len(self._endpoints)):
                idx = (self._index + i) % len(self._endpoints)
                ep = self._endpoints[idx]
                client = None
                try:
                    client = self._new_client(ep)
                    client.get_response(self._prefix_b)
                except Exception as exc:  # noqa: BLE001 - classified below
                    if client is not None:
                        client.close()
                    kind, detail = _classify(exc)
                    if kind in ("auth", "token"):
                        who = (
                            f"user {self._conf.user!r}"
                            if self._conf.user
                            else "this client (no user given)"
                        )
                        raise StoreAuthError(
                            f"etcd at {ep} refused {who}: {detail} "
                            "(check rdzv_conf user=/password=)"
                        ) from None
                    errors.append(f"{ep}: {detail}")
                    continue
                with self._lock:
                    if self._closed:
                        spare = client
                    elif self._client is not None:  # another thread connected first
                        spare = client
                    else:
                        self._client, self._index, spare = client, idx, None
                if spare is not None:
                    spare.close()
                return
            if time.monotonic() + delay >= deadline:
                break
            time.sleep(delay)
            delay = min(0.5, delay * 2)
        tried = ", ".join(errors[-len(self._endpoints) :])
        raise StoreError(f"etcd unreachable within {self._conf.request_timeout:.0f}s ({tried})")

    def _current(self) -> Any:
        with self._lock:
            if self._closed:
                raise StoreError("etcd client is closed")
            if self._client is not None:
                return self._client
        self._connect()
        with self._lock:
            return self._client

    def _drop(self, client: Any, rotate: bool) -> None:
        """Forget `client` (if still current) so the next call reconnects, maybe elsewhere."""
        with self._lock:
            if self._client is not client or client is None:
                return
            self._client = None
            if rotate:
                self._index = (self._index + 1) % len(self._endpoints)
        client.close()

    def _stream_failed(self, client: Any) -> None:
        if not self._closed:
            self._drop(client, rotate=len(self._endpoints) > 1)

    def _watch_stub(self) -> tuple[Any, Any, Any, Any]:
        client = self._current()
        return client, _RPC.WatchStub(client.channel), client.call_credentials, client.metadata

    def _call(self, what: str, fn: Callable[[Any], Any]) -> Any:
        """Run fn(client), reconnecting/failing over on transient errors until the deadline."""
        deadline = time.monotonic() + self._conf.request_timeout
        delay = 0.05
        reauth = False
        while True:
            try:
                client = self._current()
            except StoreError:
                if time.monotonic() + delay >= deadline or self._closed:
                    raise
                time.sleep(delay)
                delay = min(0.5, delay * 2)
                continue
            try:
                return fn(client)
            except Exception as exc:  # noqa: BLE001 - classified below
                kind, detail = _classify(exc)
            if self._closed:
                raise StoreError(f"etcd {what}: client is closed") from None
            ep = self._endpoints[self._index]
            if kind == "token" and not reauth:
                reauth = True
                self._drop(client, rotate=False)
                continue
            if kind in ("auth", "token"):
                raise StoreAuthError(f"etcd at {ep} refused {what}: {detail}") from None
            if kind in ("unavailable", "closed") and time.monotonic() + delay < deadline:
                self._drop(client, rotate=len(self._endpoints) > 1)
                time.sleep(delay)
                delay = min(0.5, delay * 2)
                continue
            if kind == "timeout":
                raise StoreTimeout(f"etcd {what} at {ep} timed out: {detail}") from None
            raise StoreError(f"etcd {what} at {ep} failed: {detail}") from None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._hub.close()
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

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
                cmp = lambda: _TX.Mod(k) == rev  # noqa: E731
            else:
                cur = 0
                cmp = lambda: _TX.Version(k) == 0  # noqa: E731
            new = cur + int(amount)
            ok, responses = self._call(
                "add",
                lambda c: c.transaction(
                    compare=[cmp()], success=[_TX.Put(k, str(new).encode())], failure=[_TX.Get(k)]
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
                    compare=[_TX.Value(k) == exp], success=[_TX.Put(k, des)], failure=[_TX.Get(k)]
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
                    compare=[_TX.Version(k) == 0], success=[_TX.Put(k, des)], failure=[_TX.Get(k)]
                ),
            )
            if ok:
                return des
            kvs = _range_kvs(responses)
            if kvs and bytes(kvs[0].value) != b"":
                return bytes(kvs[0].value)
        raise StoreError(f"compare_set on {key!r} did not settle (key keeps changing)")

    def _missing(self, raw_keys: list[bytes]) -> tuple[set[bytes], int]:
        """Which of raw_keys do not exist, and the revision at which that was true."""
        if len(raw_keys) == 1:
            resp = self._call("get", lambda c: c.get_response(raw_keys[0]))
            present = {bytes(kv.key) for kv in resp.kvs}
        else:
            lo, hi = min(raw_keys), max(raw_keys) + b"\0"
            req = lambda c: c.kvstub.Range(  # noqa: E731
                _RPC.RangeRequest(key=lo, range_end=hi, keys_only=True),
                c.timeout,
                credentials=c.call_credentials,
                metadata=c.metadata,
            )
            resp = self._call("get", req)
            present = {bytes(kv.key) for kv in resp.kvs}
        return {k for k in raw_keys if k not in present}, resp.header.revision

    def wait(self, keys: Iterable[str], timeout: float) -> bool:
        raw = sorted({self._k(k) for k in keys})
        if not raw:
            return True
        deadline = time.monotonic() + max(0.0, timeout)
        missing, rev = self._missing(raw)
        if not missing:
            return True
        if timeout <= 0:
            return False
        wanted = set(raw)
        state = {k: (k not in missing) for k in raw}
        cond = threading.Condition()

        def on_event(ev: WatchEvent) -> None:
            kb = self._k(ev.key)
            if kb in wanted:
                with cond:
                    state[kb] = ev.kind == "put"
                    cond.notify_all()

        lo = raw[0]
        hi = None if len(raw) == 1 else raw[-1] + b"\0"
        w = self._hub.watch(
            lo,
            hi,
            on_event,
            rev + 1,
            timeout=max(0.1, min(self._conf.request_timeout, deadline - time.monotonic())),
        )
        try:
            with cond:
                while not all(state.values()):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    cond.wait(left)
            return True
        finally:
            self._hub.cancel(w)

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
            _TX.Delete(self._prefix_b, range_end=keep),
            _TX.Delete(_prefix_end(keep), range_end=_prefix_end(self._prefix_b)),
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
                compare=[_TX.Version(k) == 0], success=[_TX.Put(k, v, lease=lid)], failure=[]
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
                compare=[_TX.Value(g) == gv], success=[_TX.Put(k, v)], failure=[]
            ),
        )
        return bool(ok)

    def delete_if(self, key: str, value: bytes) -> bool:
        """Delete `key` only while it holds exactly `value`; True when deleted."""
        k, v = self._k(key), self._bytes(value)
        ok, _ = self._call(
            "delete_if",
            lambda c: c.transaction(
                compare=[_TX.Value(k) == v], success=[_TX.Delete(k)], failure=[]
            ),
        )
        return bool(ok)

    def compare_set_if(
        self, key: str, expected: bytes, desired: bytes, guard_key: str, guard_value: bytes
    ) -> bytes | None:
        """`compare_set` (torch semantics) that only happens while `guard_key` holds exactly
        `guard_value`; None when the guard fails (nothing written)."""
        k, exp, des = self._k(key), self._bytes(expected), self._bytes(desired)
        g, gv = self._k(guard_key), self._bytes(guard_value)
        guard = _TX.Value(g) == gv
        cond = (_TX.Version(k) == 0) if exp == b"" else (_TX.Value(k) == exp)
        ok, _ = self._call(
            "compare_set_if",
            lambda c: c.transaction(compare=[guard, cond], success=[_TX.Put(k, des)], failure=[]),
        )
        if ok:
            return des
        ok, responses = self._call(
            "compare_set_if",
            lambda c: c.transaction(compare=[guard], success=[_TX.Get(k)], failure=[]),
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

        w = self._hub.watch(
            k,
            None,
            on_event,
            int(resp.header.revision) + 1,
            timeout=max(0.1, min(self._conf.request_timeout, deadline - time.monotonic())),
        )
        try:
            return gone.wait(max(0.0, deadline - time.monotonic()))
        finally:
            self._hub.cancel(w)


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
