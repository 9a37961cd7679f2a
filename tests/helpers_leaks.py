"""What tests leave behind: ports the test process still listens on, child processes still alive.

Owns: `Holdings` (a snapshot of both), `holdings_now()` and `LeakWatch`, the pytest plugin
tests/conftest.py registers. It takes a snapshot before each test and one after its teardown,
and keeps what the test added. At the end of the session (module- and session-scoped fixtures
have been torn down by then, so anything a fixture owns is gone) the terminal summary lists what
is still held and which test started it: a store, proxy, etcd or agent a test never stopped.
Such a store keeps answering on its port for the rest of the run, where a later test may take
it for its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest

LISTEN = "0A"  # TCP state in /proc/net/tcp*


@dataclass(frozen=True)
class Holdings:
    sockets: frozenset[int] = frozenset()  # socket inodes of this process
    children: frozenset[tuple[int, int, str]] = frozenset()  # (pid, start time, command)

    def __sub__(self, other: Holdings) -> Holdings:
        return Holdings(self.sockets - other.sockets, self.children - other.children)

    def __and__(self, other: Holdings) -> Holdings:
        return Holdings(self.sockets & other.sockets, self.children & other.children)

    def __bool__(self) -> bool:
        return bool(self.sockets or self.children)

    def listening_only(self) -> Holdings:
        """The same, its sockets cut down to the listening ones (reads /proc/net: slow, so only
        for what a test left)."""
        if not self.sockets:
            return self
        ports = listening_ports()
        return Holdings(frozenset(i for i in self.sockets if i in ports), self.children)

    def describe(self) -> str:
        ports = listening_ports()
        listening = [f"listening on port {ports[i]}" for i in sorted(self.sockets) if i in ports]
        procs = [f"child pid {pid} ({cmd})" for pid, _, cmd in sorted(self.children)]
        return "; ".join(listening + procs)


def listening_inodes(table: str) -> dict[int, int]:
    """{socket inode: port} of the LISTEN sockets in one /proc/net/tcp* table's text."""
    out = {}
    for line in table.splitlines()[1:]:
        cols = line.split()
        if len(cols) > 9 and cols[3] == LISTEN:
            out[int(cols[9])] = int(cols[1].rsplit(":", 1)[1], 16)
    return out


def listening_ports() -> dict[int, int]:
    """{socket inode: port} of every listening TCP socket of this network namespace."""
    out: dict[int, int] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name, encoding="ascii") as f:
                out.update(listening_inodes(f.read()))
        except OSError:
            continue
    return out


def own_socket_inodes() -> frozenset[int]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return frozenset(inodes)


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def live_descendants(pid: int) -> frozenset[tuple[int, int, str]]:
    """(pid, start time, command) of every live (not zombie) descendant of `pid`, from the
    kernel's /proc/<pid>/task/<tid>/children lists."""
    out, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        try:
            tids = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tids:
            for child in map(int, _read(f"/proc/{parent}/task/{tid}/children").split()):
                stat = _read(f"/proc/{child}/stat").rsplit(")", 1)[-1].split()
                if len(stat) < 20 or stat[0] == "Z":
                    continue
                command = _read(f"/proc/{child}/cmdline").replace("\0", " ").strip()[:120]
                out.add((child, int(stat[19]), command))
                todo.append(child)
    return frozenset(out)


def holdings_now() -> Holdings:
    return Holdings(own_socket_inodes(), live_descendants(os.getpid()))


@dataclass(eq=False)  # pytest keeps plugins in sets
class LeakWatch:
    """The pytest plugin: what each test added and did not release (see the module doc)."""

    added: dict[str, Holdings] = field(default_factory=dict)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        before = holdings_now()
        yield
        added = holdings_now() - before
        if added and (added := added.listening_only()):
            self.added[item.nodeid] = added

    def still_held(self) -> dict[str, Holdings]:
        now = holdings_now()
        return {test: left for test, h in self.added.items() if (left := h & now)}

    def pytest_terminal_summary(self, terminalreporter) -> None:
        left = self.still_held()
        if not left:
            return
        terminalreporter.section("left running by tests (stop what a test starts)", yellow=True)
        for test, held in left.items():
            terminalreporter.line(f"{test}: {held.describe()}")
