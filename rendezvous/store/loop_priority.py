"""The scheduling priority of the store's event-loop thread.

Owns: `loop_nice(environ)`, the nice value that thread asks for (`FTRUN_STORE_NICE`, default
-10; 0 keeps the inherited priority), rejected in one line when it is not an integer in
-20..0 (`check_nice` does the same for a value given in code); and
`raise_thread_priority(nice)`, which applies it to the calling thread only (Linux keeps a nice
value per thread: `setpriority(PRIO_PROCESS, <thread id>)`), never makes a thread less
important than it already is, and returns why when the OS refuses (no CAP_SYS_NICE and an
RLIMIT_NICE that does not allow it): the loop then runs at the priority it inherited.

Why: a store is the one serialization point of a rendezvous. Every rank's set / add / wait goes
through one loop thread; when hundreds of client threads are runnable at once (the ranks of the
host node initialising their process groups, or a wake-up storm after the last rank arrived),
the fair scheduler gives that thread one runnable thread's share of a core, and every client
then waits on it. A higher weight lets the loop run as soon as it has work; it uses little CPU
(it sleeps in epoll_wait otherwise), so the ranks lose nothing they would have used. Only the
loop thread changes: the process's other threads (an agent's supervision, its workers, which
it starts from other threads) keep their priority.

`LoopPriority` is what a loop thread holds: the raised priority while it serves at most
`MAX_RAISED_CONNECTIONS` (1024) connections, the inherited one above that. With thousands of
clients the loop always has work, so a higher weight cannot make it start sooner; it would only
preempt its own clients where they share its host (two runs with 4096 torch clients on the
2-core test machine were 10-25 % slower at nice -10 than at nice 0, within that size's spread
there). Above the bound a store behaves exactly as it did before the priority existed. A real
job's master serves its node's ranks and one proxy link per node, far below it.

A node proxy (`rendezvous.store.proxy.StoreProxy`) keeps its inherited priority unless given a
`nice`: it serves the ranks of its own host, so raised it preempts them at each of their
requests, wakes once per request instead of once per burst and splits their rounds (with 64
proxies of 64 clients on 2 cores: 2.5x the upstream requests, 1.6x torch's pattern time;
about 1.0x at the inherited priority).
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Mapping

ENV = "FTRUN_STORE_NICE"
DEFAULT_NICE = -10
# Above this many connections a loop keeps its inherited priority (see LoopPriority).
MAX_RAISED_CONNECTIONS = 1024
_ALLOWED = "must be an integer from -20 (the highest priority) to 0 (keep the inherited priority)"


def loop_nice(environ: Mapping[str, str] | None = None) -> int:
    """The nice value for a loop thread from `FTRUN_STORE_NICE` (default -10). ValueError in
    one line naming the variable, the value and what is allowed."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV, "").strip()
    if raw == "":
        return DEFAULT_NICE
    try:
        v = int(raw)
    except ValueError:
        v = None
    if v is None or not -20 <= v <= 0:
        raise ValueError(f"{ENV}={raw!r}: {_ALLOWED}")
    return v


def check_nice(nice: int) -> int:
    """`nice` when it is an allowed loop nice value, else ValueError in one line."""
    if isinstance(nice, bool) or not isinstance(nice, int) or not -20 <= nice <= 0:
        raise ValueError(f"nice={nice!r}: {_ALLOWED}")
    return nice


def raise_thread_priority(nice: int) -> str | None:
    """Give the calling thread nice value `nice` when that is a higher priority than it has;
    0, or a thread already at `nice` or higher, is left alone. Returns None on success (or
    nothing to do), else one line saying why the OS refused."""
    if nice == 0:
        return None
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        if current <= nice:
            return None
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as e:
        return (
            f"cannot raise the loop thread's priority to nice {nice} ({e.strerror}; it "
            f"needs CAP_SYS_NICE or RLIMIT_NICE): it runs at the inherited priority"
        )
    return None


class LoopPriority:
    """The calling loop thread's priority, kept by `update(connections)`: nice `nice` while
    it serves at most `max_connections`, its inherited nice above that. Made and used on the
    loop thread only. A refusal is reported once through `log` and not tried again."""

    def __init__(
        self, nice: int, log: Callable[[str], None], max_connections: int = MAX_RAISED_CONNECTIONS
    ) -> None:
        self.nice = check_nice(nice)
        self.max_connections = max_connections
        self._log = log
        self._tid = threading.get_native_id()
        self.inherited = os.getpriority(os.PRIO_PROCESS, self._tid)
        self.raised = False

    def update(self, connections: int) -> None:
        want = self.nice < self.inherited and connections <= self.max_connections
        if want == self.raised:
            return
        if want:
            why = raise_thread_priority(self.nice)
            if why:
                self.nice = self.inherited  # refused: never asked again
                self._log(why)
                return
            self.raised = True
            return
        try:
            os.setpriority(os.PRIO_PROCESS, self._tid, self.inherited)
            self.raised = False
        except OSError as e:  # pragma: no cover - lowering one's own priority is always allowed
            self._log(f"cannot return the loop thread to nice {self.inherited}: {e.strerror}")
