"""Endpoint strings: the one parser of `host[:port]` for the CLI and the store backends.

Owns: `Endpoint` (host and port, `target` gives the "host:port" / "[v6]:port" form),
`parse_endpoint` (exactly one endpoint: `--rdzv-endpoint` of the embedded store) and
`parse_endpoints` (a comma-separated list: etcd). Accepted forms of one entry:

    host                 host:port             [v6addr]          [v6addr]:port
    http://host:port/    https://[v6addr]:port

A missing port means the caller's default. Bad input raises `EndpointError` (a `ValueError`)
with one line naming the entry, what is wrong and the forms allowed; callers prefix the flag.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

ETCD_DEFAULT_PORT = 2379
SCHEMES = ("http", "https")
FORMS = "host[:port] or [ipv6]:port"
_HOST_RE = re.compile(r"^[\w.%:-]+$")  # names, IPv4, IPv6 (with a %zone) once unbracketed
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class EndpointError(ValueError):
    """An endpoint string is malformed; str() is the one-line message."""


@dataclass(frozen=True)
class Endpoint:
    """One network endpoint."""

    host: str
    port: int

    @property
    def target(self) -> str:
        """ "host:port" ("[v6addr]:port" for IPv6), as gRPC and URLs want it."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return self.target


def _strip_scheme(item: str, raw: str, what: str) -> str:
    m = _SCHEME_RE.match(item)
    if m is None:
        return item
    if m.group(1).lower() not in SCHEMES:
        raise EndpointError(
            f"{what} {raw!r}: scheme {m.group(1)!r} is not supported; "
            f"use {' or '.join(s + '://' for s in SCHEMES)} or none"
        )
    return item[m.end() :]


def _split_host_port(item: str, raw: str, what: str) -> tuple[str, str]:
    """(host, port text or "") of one entry without scheme."""
    if item.startswith("["):
        end = item.find("]")
        if end < 0:
            raise EndpointError(f"{what} {raw!r}: missing ']' after the IPv6 address")
        host, rest = item[1:end], item[end + 1 :]
        if not host:
            raise EndpointError(f"{what} {raw!r}: empty IPv6 address")
        if rest and not rest.startswith(":"):
            raise EndpointError(f"{what} {raw!r}: expected ':port' after ']'")
        return host, rest[1:]
    if item.count(":") > 1:
        raise EndpointError(f"{what} {raw!r}: write IPv6 addresses as [addr]:port")
    host, _, port = item.partition(":")
    if not host:
        raise EndpointError(f"{what} {raw!r}: missing host; use {FORMS}")
    return host, port


def parse_endpoint(
    text: str, default_port: int, what: str = "endpoint", min_port: int = 1
) -> Endpoint:
    """Parse exactly one endpoint (see the module docstring for the forms).

    `what` names the value in errors (e.g. "--rdzv-endpoint"); ports must be in
    `min_port`..65535 (0 only where the caller treats it as "pick a free port")."""
    raw = text
    item = _strip_scheme(text.strip(), raw, what).rstrip("/")
    if not item:
        raise EndpointError(f"{what} {raw!r} is empty; use {FORMS}")
    if "," in item:
        raise EndpointError(f"{what} {raw!r}: expected one {FORMS}, not a list")
    host, port_s = _split_host_port(item, raw, what)
    if not _HOST_RE.match(host):
        raise EndpointError(
            f"{what} {raw!r}: host {host!r} may only hold letters, digits "
            "and . - _ (IPv6 in brackets)"
        )
    if port_s == "":
        return Endpoint(host, default_port)
    if not port_s.isdigit() or not min_port <= int(port_s) <= 65535:
        raise EndpointError(f"{what} {raw!r}: port {port_s!r} is not a number in {min_port}..65535")
    return Endpoint(host, int(port_s))


def parse_endpoints(
    spec: str | Iterable[str | Endpoint],
    default_port: int,
    what: str = "endpoint",
    min_port: int = 1,
) -> list[Endpoint]:
    """Parse "h1[:p],h2[:p],[v6]:p" (or a list of such strings or `Endpoint`s, kept as they
    are) into endpoints, in order. Raises `EndpointError` naming the bad entry."""
    items = [spec] if isinstance(spec, str) else list(spec)
    out: list[Endpoint] = []
    for chunk in items:
        if isinstance(chunk, Endpoint):
            out.append(chunk)
            continue
        for part in str(chunk).split(","):
            if part.strip():
                out.append(parse_endpoint(part, default_port, what, min_port))
    if not out:
        raise EndpointError(f"no {what} given in {spec!r}; use host[:port][,host[:port]...]")
    return out
