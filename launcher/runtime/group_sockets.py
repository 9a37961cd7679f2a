"""Breaking collective waits that torch runs in C++ (rt.ddp's reducer) when a stop arrives.

Owns: `SocketLedger`, the record of the connected TCP sockets each gloo process group opened
(found as the sockets that appear while the group is built), per generation, and
`break_before(generation)`, which shuts those sockets down (`shutdown(SHUT_RDWR)`) for every
generation older than the one a stop asks for.

Why: DDP's C++ reducer waits for its bucket all-reduces inside `loss.backward()` (and for its
bucket-rebuild broadcast inside the forward); a Python thread cannot leave that wait, and
neither `ProcessGroupGloo.abort()` nor a signal releases it (checked on torch 2.13). A shut-down
socket does: gloo's pair sees the connection closed and fails the work within a millisecond
("Connection closed by peer"), the wait raises, and the runtime turns that into the stop (see
StepPath.end). The peers' pairs on those sockets fail the same way (they are stopping too;
a peer that is not yet stopped takes it as a collective error and waits for its own stop).

Limit (gloo's, not ours): a send gloo had already queued on a connection before that connection
failed (a peer killed while this rank sent to it) is not failed when the pair closes -- gloo's
pair fails the bound buffers in its transmit queue, not the unbound ones collectives use -- so
that wait lasts the group's whole timeout, shutdown or not. The rank finds that out itself a
second after the stop (launcher.runtime.wait_probe.StuckWaitAlarm) and the agent replaces it
(launcher.hang.hang_watch; `FTRUN_HANG_STOP` after the stop when nothing said so earlier).

Safety: only connected TCP sockets that appeared while the group was built are recorded; gloo's
listening socket is left alone (shutting it down makes gloo abort the whole process), and so are
connections a listener that was already open accepted meanwhile (a TCPStore server in this
process serving a peer's new client has the same local port as its listener). Each
socket is recorded with its inode: a descriptor that has been closed and reused by another
socket since (a newer group, a store client) no longer has that inode and is skipped.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

_STREAM_FAMILIES = (socket.AF_INET, socket.AF_INET6)


@dataclass(frozen=True)
class GroupSocket:
    """One connected socket of a process group: its descriptor and the inode behind it."""

    fd: int
    inode: int


def open_sockets() -> dict[int, int]:
    """{fd: inode} of this process's open sockets."""
    out: dict[int, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            st = os.fstat(fd)
        except (ValueError, OSError):
            continue
        if stat.S_ISSOCK(st.st_mode):
            out[fd] = st.st_ino
    return out


def _dup_if_same(fd: int, inode: int) -> socket.socket | None:
    """A socket object on a duplicate of `fd`, when `fd` still is the socket `inode` (else None)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        if os.fstat(dup).st_ino != inode:
            os.close(dup)
            return None
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


def _stream_kind(fd: int, inode: int) -> tuple[str, int]:
    """("listening" | "connected" | "other", local port) of a socket descriptor."""
    s = _dup_if_same(fd, inode)
    if s is None:
        return "other", 0
    try:
        if s.family not in _STREAM_FAMILIES or s.type != socket.SOCK_STREAM:
            return "other", 0
        port = s.getsockname()[1]
        if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return "listening", port
        s.getpeername()
        return "connected", port
    except OSError:
        return "other", 0
    finally:
        s.close()


def listening_ports(sockets: dict[int, int]) -> set[int]:
    """Local ports of the listening TCP sockets among `sockets` ({fd: inode})."""
    kinds = (_stream_kind(fd, ino) for fd, ino in sockets.items())
    return {port for kind, port in kinds if kind == "listening"}


def new_connected_sockets(
    before: dict[int, int], after: dict[int, int], old_listeners: set[int] = frozenset()
) -> list[GroupSocket]:
    """The connected TCP sockets in `after` that were not open in `before`, except those
    accepted by a listener on one of the ports `old_listeners` (open before)."""
    found = []
    for fd, ino in sorted(after.items()):
        if before.get(fd) == ino:
            continue
        kind, port = _stream_kind(fd, ino)
        if kind == "connected" and port not in old_listeners:
            found.append(GroupSocket(fd, ino))
    return found


def shutdown(sock: GroupSocket) -> bool:
    """Shut `sock` down (both directions) if its descriptor still is that socket."""
    s = _dup_if_same(sock.fd, sock.inode)
    if s is None:
        return False
    try:
        s.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        s.close()


class SocketLedger:
    """Connected sockets of the process groups, by generation; thread-safe.

    `track(generation)` wraps the creation of groups; `break_before(g)` (any thread: the agent
    channel's reader calls it on a stop) shuts down the sockets of every generation < g and
    returns how many it shut; `forget(generation)` drops a generation whose groups are gone.
    `stop_target()` (optional): the generation the newest stop asks for -- a group finished
    after that stop arrived is broken at once (the stop's own break ran before it existed).
    """

    def __init__(self, stop_target: Callable[[], int] = lambda: -1) -> None:
        self._lock = threading.Lock()
        self._by_generation: dict[int, list[GroupSocket]] = {}
        self._stop_target = stop_target
        self.enabled = False  # set when something waits in C++ (DDP's own reducer under rt.ddp)

    @contextmanager
    def track(self, generation: int) -> Iterator[None]:
        before = open_sockets()
        old_listeners = listening_ports(before)
        yield
        found = new_connected_sockets(before, open_sockets(), old_listeners)
        with self._lock:
            self._by_generation.setdefault(generation, []).extend(found)
        if self.enabled and self._stop_target() > generation:
            self.break_before(self._stop_target())

    def sockets(self, generation: int) -> list[GroupSocket]:
        with self._lock:
            return list(self._by_generation.get(generation, []))

    def break_before(self, generation: int) -> int:
        with self._lock:
            doomed = [
                s for g, socks in self._by_generation.items() if g < generation for s in socks
            ]
        return sum(shutdown(s) for s in doomed)

    def forget(self, generation: int) -> None:
        """Drop the record of every generation <= `generation` (their groups were destroyed)."""
        with self._lock:
            for g in [g for g in self._by_generation if g <= generation]:
                del self._by_generation[g]
