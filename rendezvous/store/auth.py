"""Job-token authentication for the store's backend port.

Owns: the reserved auth key, token verification, and token sources (file, environment,
generation).

Threat model
------------
- The *backend* port (the embedded `StoreServer` on the leader, reachable from every node)
  accepts only peers that hold the job token, a shared secret. Anyone who can reach that port
  without the token could read or rewrite rendezvous state (plans, generations, peer
  addresses) and hijack or wreck the job, so a server started with a token refuses every op
  from an unauthenticated connection and closes it with one log line naming the peer.
- The token is not a transport secret: it travels in clear over TCP. It protects against
  other jobs, stray clients and unprivileged users on the network, not against an attacker who
  can sniff or man-in-the-middle the cluster network (use a private network or etcd with TLS).
- Per-node *proxies* listen on loopback only. Local workers (unmodified torch code) connect to
  them without a token; the proxy authenticates upstream. Local users on a node can reach the
  proxy, so the node itself is the trust boundary, exactly as for torchrun's own store.
- Token files must not be readable by other users (mode 0600 or stricter); a group- or
  world-readable file is refused.

Wire mechanism (works with torch's own C++ client, no patching): right after the VALIDATE/PING
handshake the client SETs the reserved key `/ftrun/auth` (logical key "ftrun/auth") to the
token. The server never stores that key. SET has no reply, so a client that wants confirmation
follows it with a PING: a wrong token closes the connection before the PING is answered.
From torch: `TCPStore(host, port, is_master=False).set("ftrun/auth", token)`.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path

AUTH_LOGICAL_KEY = "ftrun/auth"
AUTH_KEY = b"/" + AUTH_LOGICAL_KEY.encode()
TOKEN_ENV = "FTRUN_JOB_TOKEN"
MAX_TOKEN_BYTES = 4096


class TokenError(ValueError):
    """A token source is unusable (missing, empty, unsafe permissions)."""


def token_matches(expected: str | bytes, presented: bytes) -> bool:
    """Constant-time comparison of the presented token with the expected one."""
    if isinstance(expected, str):
        expected = expected.encode()
    return hmac.compare_digest(expected, presented)


def generate_token() -> str:
    """A fresh random job token (64 hex characters)."""
    return secrets.token_hex(32)


def check_token(token: str) -> str:
    if not isinstance(token, str) or not token.strip():
        raise TokenError(f"job token {token!r}: must be a non-empty string")
    if len(token.encode()) > MAX_TOKEN_BYTES:
        raise TokenError(f"job token of {len(token.encode())} bytes: at most {MAX_TOKEN_BYTES}")
    return token.strip()


def load_token_file(path: str | os.PathLike) -> str:
    """Read a token from `path`, refusing files other users can read."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise TokenError(f"token file {str(p)!r} does not exist") from None
    if not stat.S_ISREG(st.st_mode):
        raise TokenError(f"token file {str(p)!r} is not a regular file")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TokenError(
            f"token file {str(p)!r} has mode {stat.S_IMODE(st.st_mode):04o}: other users can "
            f"access it; run `chmod 600 {p}`"
        )
    return check_token(p.read_text(encoding="utf-8"))


def write_token_file(path: str | os.PathLike, token: str) -> Path:
    """Atomically write `token` to `path` with mode 0600."""
    p = Path(path)
    check_token(token)
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, token.encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, p)
    return p


def token_from_env(env: dict | None = None) -> str | None:
    """The token in $FTRUN_JOB_TOKEN, or None when unset/empty."""
    v = (os.environ if env is None else env).get(TOKEN_ENV, "")
    return check_token(v) if v.strip() else None


def resolve_token(token_file: str | None = None, env: dict | None = None) -> str | None:
    """Token from `token_file` if given, else from $FTRUN_JOB_TOKEN, else None."""
    if token_file:
        return load_token_file(token_file)
    return token_from_env(env)
