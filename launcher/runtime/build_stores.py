"""A group build that a newer stop can leave: each build of the groups gets a store connection
of its own, shut down when a stop for a newer generation arrives.

Owns: `BuildStores`. Building a gloo group reads every rank's address from the store, waiting up
to the store timeout (120 s by default) for each; a rank that dies after the round's repair plan
was published, before it built its groups, left its peers in that wait, in C++, where neither a
Python thread nor a signal reaches them: the next round's stop arrived at once, but the
survivors only went to it when the wait timed out (seen: a second SIGKILL 30 ms after the first
round's plan, the survivors' statuses for the next round missing for 120 s, then restart-all).
With its own connection per build, the stop's handler (the agent channel's reader thread) shuts
that connection down (`interrupt`): the build's wait fails within milliseconds and the recovery
round goes on to the newer generation. A finished build's connection stays open while its
generation runs (the default group's store: groups created later read it) and is shut by the
next stop too, so at most one idle connection per rank stays open (its descriptor is kept: the
groups in the graveyard may still hold the store object). What a failed build leaves inside
torch is `World.build`'s to undo.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from launcher.runtime.group_sockets import (
    GroupSocket,
    listening_ports,
    new_connected_sockets,
    open_sockets,
    shutdown,
)


class BuildStores:
    """Store connections of the group builds, by generation; thread-safe.

    `open(generation)` (the training thread, before it builds that generation's groups) returns
    a new store client from `connect()`; `finished(generation)` says that build ended (built or
    failed); `interrupt(target)` (any thread: a stop for `target`) shuts down the connections of
    every generation older than `target` and returns the generations whose build was still
    running (left by the interrupt). A stop that arrived while `open` connected (`stop_target()`
    newer) interrupts at once."""

    def __init__(self, connect: Callable[[], Any], stop_target: Callable[[], int]) -> None:
        self._connect = connect
        self._stop_target = stop_target
        self._lock = threading.Lock()
        self._by_generation: dict[int, list[GroupSocket]] = {}
        self._building: set[int] = set()

    def open(self, generation: int) -> Any:
        before = open_sockets()
        store = self._connect()
        found = new_connected_sockets(before, open_sockets(), listening_ports(before))
        with self._lock:
            self._by_generation.setdefault(generation, []).extend(found)
            self._building.add(generation)
        target = self._stop_target()
        if target > generation:
            self.interrupt(target)
        return store

    def finished(self, generation: int) -> None:
        with self._lock:
            self._building.discard(generation)

    def interrupt(self, target: int) -> list[int]:
        with self._lock:
            older = sorted(g for g in self._by_generation if g < target)
            left = [g for g in older if g in self._building]
            doomed = [s for g in older for s in self._by_generation.pop(g)]
        for sock in doomed:
            shutdown(sock)
        return left

    def open_generations(self) -> list[int]:
        """Generations whose build connection is still open (for tests and logs)."""
        with self._lock:
            return sorted(self._by_generation)
