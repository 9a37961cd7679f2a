"""Progress of a worker as the kernel sees it: process state, CPU time and I/O of its process tree.

Owns: reading `/proc/<pid>/stat` (state, parent, utime+stime) and `/proc/<pid>/io` (rchar,
wchar: every byte read or written, output to the console or a log file included) for a worker
and all its descendants, and `SilenceWatch`, which tells for each worker that does not use
launcher.runtime (so sends no heartbeats) since when its process tree has shown no progress at
all: no byte read or written and no more CPU time than an idle poller's (`IDLE_CPU_SHARE` of one
CPU: a communication library's event-loop thread wakes on its timers even in a process that
hangs, and one clock tick every few seconds must not restart the silence clock). A rank blocked
in a collective on a hung peer is silent too; which silent rank is blamed is
`launcher.control.decision.blame_local`'s.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

SAMPLE_INTERVAL = 1.0  # seconds between /proc samples of a worker tree
IDLE_CPU_SHARE = 0.02  # a tree using at most this share of one CPU (and doing no I/O) is silent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # /proc CPU times are in these


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state letter, parent pid, utime + stime in clock ticks), None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    try:
        return fields[0], int(fields[1]), int(fields[11]) + int(fields[12])
    except (IndexError, ValueError):
        return None


def proc_state(pid: int | None) -> str:
    """The process state letter (R, S, D, T, Z, ...), "" when unknown."""
    st = proc_stat(pid) if pid else None
    return st[0] if st else ""


def proc_io(pid: int) -> int:
    """rchar + wchar of one process (0 when unreadable)."""
    total = 0
    try:
        with open(f"/proc/{pid}/io", encoding="utf-8") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("rchar", "wchar"):
                    total += int(value)
    except (OSError, ValueError):
        return 0
    return total


Table = dict[int, tuple[str, int, int]]  # pid -> (state, parent pid, CPU ticks)


def process_table() -> Table:
    """One scan of /proc: every process's state, parent and CPU ticks."""
    table: Table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_stat(int(name))
            if st is not None:
                table[int(name)] = st
    return table


def descendants(pid: int, table: Table | None = None) -> list[int]:
    """`pid` and every process below it."""
    table = process_table() if table is None else table
    tree, frontier = [pid], {pid}
    while frontier:
        frontier = {p for p, st in table.items() if st[1] in frontier and p not in tree}
        tree.extend(sorted(frontier))
    return tree


def tree_progress(pid: int, table: Table | None = None) -> tuple[int, int] | None:
    """(CPU ticks, I/O bytes) summed over the process tree of `pid`; None when it is gone.
    `table`: a `process_table()` shared by several calls (one /proc scan per sample)."""
    table = process_table() if table is None else table
    if pid not in table:
        return None
    cpu = io = 0
    for p in descendants(pid, table):
        cpu += table[p][2]
        io += proc_io(p)
    return cpu, io


@dataclass
class Silence:
    """One worker's progress as sampled."""

    pid: int
    mark: tuple[int, int] | None = None  # (CPU ticks, I/O bytes) at the last sample
    at: float = 0.0  # when the last sample was taken
    since: float = 0.0  # when the tree last progressed (or sampling began)

    def observe(self, mark: tuple[int, int], now: float) -> None:
        """Restart the clock when, since the last sample, the tree did I/O or used more CPU than
        an idle poller would (measured per sample: a long silence gives no credit to a burst)."""
        if self.mark is None:
            self.mark, self.at = mark, now
            return
        idle_ticks = 1 + IDLE_CPU_SHARE * CLOCK_TICKS * max(0.0, now - self.at)
        if mark[1] != self.mark[1] or mark[0] < self.mark[0] or mark[0] - self.mark[0] > idle_ticks:
            self.since = now
        self.mark, self.at = mark, now


@dataclass
class SilenceWatch:
    """Since when each watched worker (rank -> pid) shows no progress in its process tree."""

    interval: float = SAMPLE_INTERVAL
    _seen: dict[int, Silence] = field(default_factory=dict)
    _last_sample: float = 0.0

    def sample(self, pids: dict[int, int], now: float | None = None) -> None:
        """Sample the workers of `pids` (rank -> pid), at most every `interval` s."""
        now = time.time() if now is None else now
        if now - self._last_sample < self.interval:
            return
        self._last_sample = now
        for rank in [r for r in self._seen if r not in pids]:
            del self._seen[rank]
        table = process_table() if pids else {}
        for rank, pid in pids.items():
            s = self._seen.get(rank)
            if s is None or s.pid != pid:
                s = self._seen[rank] = Silence(pid, at=now, since=now)
            mark = tree_progress(pid, table)
            if mark is not None:
                s.observe(mark, now)

    def note(self, rank: int, pid: int, mark: tuple[int, int], now: float) -> None:
        """Record one observation directly (tests, or a caller that sampled itself)."""
        s = self._seen.get(rank)
        if s is None or s.pid != pid:
            s = self._seen[rank] = Silence(pid, at=now, since=now)
        s.observe(mark, now)

    def silent_for(self, rank: int, now: float | None = None) -> float:
        """Seconds since `rank`'s tree last progressed (0 when not watched)."""
        s = self._seen.get(rank)
        now = time.time() if now is None else now
        return 0.0 if s is None else now - s.since

    def forget(self, rank: int) -> None:
        self._seen.pop(rank, None)
