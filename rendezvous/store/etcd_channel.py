"""How ftrun reaches an etcd v3 cluster: the etcd3 client, its settings and one connection.

Owns: loading the `etcd3` client (`ETCD3`, or why it cannot load: `ETCD3_ERROR`) with the
pure-Python protobuf runtime its generated code needs (`PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION`
is set while etcd3 is imported, then restored, so child processes are not slowed down); the
endpoints (`Endpoint`, `parse_endpoints`: etcd's default port on the one parser of
`rendezvous.store.endpoints`) and TLS/auth settings (`EtcdConf.from_rdzv_conf`); what a gRPC
failure means (`classify`); and `EtcdChannel`, the base of `rendezvous.store.etcd.EtcdKV`: one
client at a time, failing over between endpoints, re-authenticating once on an expired token,
and retrying a request (`_call`) until `conf.request_timeout`, so every failure surfaces as one
line (`StoreAuthError`, `StoreTimeout` or `StoreError`), never a gRPC traceback.
"""

from __future__ import annotations

import os
import ssl
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from rendezvous.kv import StoreAuthError, StoreError, StoreTimeout
from rendezvous.store.endpoints import ETCD_DEFAULT_PORT
from rendezvous.store.endpoints import Endpoint as AnyEndpoint
from rendezvous.store.endpoints import parse_endpoints as parse_endpoint_list

DEFAULT_PORT = ETCD_DEFAULT_PORT

_PB_ENV = "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"


def load_etcd3() -> tuple[Any, str]:
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


ETCD3, ETCD3_ERROR = load_etcd3()
if ETCD3 is not None:
    import grpc

    _RPC = ETCD3.etcdrpc


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


def classify(exc: BaseException) -> tuple[str, str]:
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
# The connection


class EtcdChannel:
    """One etcd3 client at a time to `endpoints` (tried in order; the next one after a failure),
    checked by a read of `probe_key` when it connects. Thread-safe."""

    def __init__(self, endpoints: list[Endpoint], conf: EtcdConf | None, probe_key: bytes) -> None:
        self._endpoints = endpoints
        self._probe_key = probe_key
        self._conf = conf or EtcdConf()
        self._ca_file = self._conf.ca_file()
        self._lock = threading.Lock()
        self._client: Any = None
        self._index = 0
        self._closed = False

    @property
    def endpoints(self) -> list[Endpoint]:
        return list(self._endpoints)

    def _new_client(self, ep: Endpoint) -> Any:
        c = self._conf
        options = [
            ("grpc.enable_http_proxy", 0),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
        ]
        client = ETCD3.client(
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
                    client.get_response(self._probe_key)
                except Exception as exc:  # noqa: BLE001 - classified below
                    if client is not None:
                        client.close()
                    kind, detail = classify(exc)
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
                kind, detail = classify(exc)
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

    def _shut(self) -> bool:
        """Mark the channel closed; False when it was closed already."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            return True

    def _close_client(self) -> None:
        """Close the current client (after `_shut`)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
