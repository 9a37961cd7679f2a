"""Who hosts the embedded store with `--rdzv-backend c10d`: torchrun's is_host rule, plus
joining as a client when another agent of the same run already holds the endpoint's port.

Owns: `is_local_address` (is this address one of this host's?), `wants_to_host` (the
`--rdzv-conf is_host` override, else the endpoint's address is local), and `host_or_join`,
which starts the store or, when the port is already bound by a store of the same run, returns
a client to it. With the same command on every node, exactly one agent hosts the store: the
first on the endpoint's host to bind the port; every other agent (on other hosts, or a second
agent on the same host) becomes a client.

`host_or_join(...)` returns `Hosted(server, kv, hosting)`: `server` is the `StoreServer` this
agent owns (None when it joined as a client), `kv` the store to use (`server.kv` or a
`StoreClient`), `hosting` whether this agent is the store host (pass it to Membership as
`hosts_store`, so that losing it is reported as `StoreHostLostError`).
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from typing import Any, Mapping

from rendezvous.kv import KVStore, StoreError
from rendezvous.nodes.keys import RUN_ID_KEY
from rendezvous.store.client import StoreClient
from rendezvous.store.server import StoreServer

log = logging.getLogger("ftrun.membership")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def is_local_address(host: str) -> bool:
    """True when `host` (a name or an address) resolves to an address of this machine: one a
    socket can bind to."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_UNSPEC, socket.SOCK_DGRAM)
    except socket.gaierror:
        return False
    for fam, _, _, _, addr in infos:
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            try:
                s.bind((addr[0], 0))
                return True
            except OSError:
                continue
    return False


def wants_to_host(endpoint_host: str, rdzv_conf: Mapping[str, object]) -> bool:
    """torchrun's rule: `--rdzv-conf is_host=true|false` decides; else host the store when the
    endpoint's address is this machine's. ValueError (one line) for a bad is_host value."""
    raw = rdzv_conf.get("is_host")
    if raw not in (None, ""):
        v = str(raw).strip().lower()
        if v in _TRUE:
            return True
        if v in _FALSE:
            return False
        raise ValueError(f"--rdzv-conf is_host={raw!r}: must be true or false")
    return is_local_address(endpoint_host)


@dataclass
class Hosted:
    server: StoreServer | None
    kv: KVStore
    hosting: bool


def host_or_join(
    host: str,
    port: int,
    run_id: str,
    want_host: bool,
    token: str | None = None,
    timeout: float = 60.0,
    probe_timeout: float = 15.0,
    **server_kw: Any,
) -> Hosted:
    """Host the store on host:port when `want_host`, else (or when a store of the same run
    already holds the port) connect to it as a client. StoreError in one line when the port is
    taken by something else (nothing answers as a store within `probe_timeout` s: the agent
    that won the port may be slow to answer its first connection on a loaded host) or by
    another run's store."""
    if want_host:
        server = StoreServer(host="0.0.0.0", port=port, token=token, **server_kw)
        try:
            server.start()
            log.info("hosting the store for run %s on port %d", run_id, server.port)
            return Hosted(server, server.kv, True)
        except StoreError as exc:
            if "address already in use" not in str(exc):
                raise
        owner = _store_run(host, port, token, probe_timeout)
        if owner is None:
            raise StoreError(
                f"--rdzv-endpoint {host}:{port}: the port is in use on this host "
                "by something that is not an ftrun/torch store"
            )
        if owner not in ("", run_id):
            raise StoreError(
                f"--rdzv-endpoint {host}:{port}: the port is in use by the store "
                f"of run {owner!r}, not {run_id!r}"
            )
        log.info(
            "port %d is held by another agent of run %s: joining its store as a client",
            port,
            run_id,
        )
    return Hosted(None, StoreClient(host, port, token=token, timeout=timeout), False)


def _store_run(host: str, port: int, token: str | None, within: float) -> str | None:
    """The run id of the store at host:port ("" while none is written), or None when no store
    answers there within `within` s."""
    end = time.monotonic() + within
    while True:
        try:
            with StoreClient(host, port, token=token, timeout=1.0) as kv:
                raw = kv.try_get(RUN_ID_KEY)
            return raw.decode(errors="replace") if raw is not None else ""
        except (StoreError, OSError):  # refused, or no store handshake (socket timeout)
            if time.monotonic() >= end:
                return None
            time.sleep(0.1)
