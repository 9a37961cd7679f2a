"""Free TCP ports for tests: one allocator per test process, below the kernel's ephemeral range.

Owns: `free_port()` and the `PortLane` behind it. A port the kernel hands out for `bind(0)`
comes from the ephemeral range, the same range every outgoing connection takes its local port
from, and the kernel may hand the same port out again as soon as it is released: between
`free_port()` and the bind of the server a test starts on it, a client connection of the
(parallel, shared) test run could take the port, or a later `free_port()` could return the port
of a store an earlier test has just closed. So ports come from the band of `BAND_WIDTH` ports
just below the ephemeral range, which the kernel never gives out by itself; each test process
walks the band from its own starting point (spread by its pid, so concurrent test processes
start far apart) and never hands a port out twice; a port is handed out only when nothing holds
it (IPv4 and IPv6, bound or in TIME_WAIT: the check binds it without SO_REUSEADDR).

The helpers re-export `free_port` (`from helpers_store import free_port` and the like).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from dataclasses import dataclass, field

BAND_WIDTH = 12000
LOWEST_PORT = 10000
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_low(path: str = EPHEMERAL_RANGE) -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 when unreadable)."""
    try:
        with open(path, encoding="utf-8") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def band_below(low: int, width: int = BAND_WIDTH, lowest: int = LOWEST_PORT) -> range:
    """The ports just below `low` (at most `width`, none below `lowest`); empty when there is no
    room (then the kernel picks)."""
    return range(max(lowest, low - width), max(lowest, low))


def lane_start(pid: int, size: int) -> int:
    """Where process `pid` starts in a band of `size` ports: pids spread over the band
    (Knuth's multiplicative hash), so concurrent test processes walk far-apart ports."""
    return (pid * 2654435761) % size if size else 0


def is_unheld(port: int) -> bool:
    """Nothing on this host holds `port`: it binds on 0.0.0.0 and (when this host has IPv6) on
    :: without SO_REUSEADDR, so a listener, a connection's local port or a TIME_WAIT all fail it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    try:
        s6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    except OSError:
        return True  # no IPv6 here
    with s6:
        s6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            s6.bind(("::", port))
        except OSError as e:
            return e.errno == getattr(os, "EADDRNOTAVAIL", 99)  # IPv6 without an address
    return True


@dataclass
class PortLane:
    """One test process's walk through `band`; `next()` gives each port at most once."""

    band: range
    pid: int  # the process walking it: a forked child starts its own walk
    offset: int
    given: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def for_this_process(cls) -> PortLane:
        band = band_below(ephemeral_low())
        return cls(band, os.getpid(), lane_start(os.getpid(), len(band)))

    def next(self) -> int:
        with self.lock:
            if self.pid != os.getpid():
                self.pid, self.offset = os.getpid(), lane_start(os.getpid(), len(self.band))
                self.given = 0
            while self.given < len(self.band):
                port = self.band[(self.offset + self.given) % len(self.band)]
                self.given += 1
                if is_unheld(port):
                    return port
        with socket.socket() as s:  # band used up (or empty): the kernel picks
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]


# One lane per process even when this module is imported under two names (`helpers_ports` by
# the helpers, `tests.helpers_ports` by a test): two lanes would walk the same ports.
_FIRST = sys.modules.setdefault("helpers_ports", sys.modules[__name__])
LANE: PortLane = PortLane.for_this_process() if _FIRST is sys.modules[__name__] else _FIRST.LANE


def free_port() -> int:
    """A TCP port nothing holds now, not handed out before by this process, outside the range
    the kernel takes connections' local ports from (see the module docstring)."""
    return LANE.next()
