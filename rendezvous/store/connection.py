"""A client connection as the store's event loop (`rendezvous.store.server.LoopServer`) and the
node proxy (`rendezvous.store.proxy`) hold it.

Owns: `Conn` (a connection's state: socket, buffers, handshake/auth, waiters, reply slots),
`DropConnection` (the exception that closes one with a log line), `check_validate` (the
handshake rule) and `peer_str` (a peer address as the log lines and the C read path write it).
"""

from __future__ import annotations

import socket
from collections import deque

from rendezvous.store import protocol as P


class Conn:
    """One client connection of a loop server: its socket, input buffer, queued output, handshake
    and auth state, its waiters (plain or by mux tag) and the proxy's reply slots."""

    __slots__ = (
        "sock",
        "fd",
        "peer",
        "buf",
        "out",
        "out_bytes",
        "validated",
        "authed",
        "mux",
        "waiter",
        "mux_waiters",
        "since",
        "partial_since",
        "closed",
        "want_write",
        "slots",
        "more",
    )

    def __init__(self, sock: socket.socket, peer: str, authed: bool, now: float) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.buf = b""
        self.out: list = []
        self.out_bytes = 0
        self.validated = False
        self.authed = authed
        self.mux = False
        self.waiter = None
        self.mux_waiters: dict = {}
        self.since = now
        self.partial_since = 0.0
        self.closed = False
        self.want_write = False
        self.slots: deque = deque()  # proxy: replies in request order, filled as they arrive
        self.more = False  # stopped at the per-turn request budget with requests left over


class DropConnection(Exception):
    """Close this connection; the message is the log line."""


def peer_str(addr) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        h = addr[0]
        if h.startswith("::ffff:"):
            h = h[7:]
        return f"[{h}]:{addr[1]}" if ":" in h else f"{h}:{addr[1]}"
    return str(addr)


def check_validate(req: P.Request) -> None:
    """The handshake rule: VALIDATE with torch's magic, and it comes first (DropConnection
    saying what came instead)."""
    if req.op != P.Op.VALIDATE:
        raise DropConnection(f"first message was {P.op_name(req.op)}, expected VALIDATE")
    if req.num != P.VALIDATION_MAGIC:
        raise DropConnection(f"VALIDATE with magic {req.num:#x}, expected {P.VALIDATION_MAGIC:#x}")
