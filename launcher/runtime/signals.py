"""The stop signal shared by the agent channel thread and the training thread.

Owns: `StopSignal` (the newest generation the agent asked this worker to move to, set from the
channel thread, read and waited on by the main thread) and the `StopRequested` exception that
unwinds the training step when a stop arrives.
"""

from __future__ import annotations

import threading
from typing import Callable


class StopRequested(Exception):
    """Raised inside a step when the agent asked this rank to stop for a recovery round."""

    def __init__(self, generation: int, where: str = "") -> None:
        super().__init__(
            f"stop requested for generation {generation}" + (f" ({where})" if where else "")
        )
        self.generation = generation
        self.where = where


class StopSignal:
    """Thread-safe 'move to generation g' request; only ever increases."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._target = -1
        self._listeners: list[Callable[[int], None]] = []

    def on_request(self, listener: Callable[[int], None]) -> None:
        """Call `listener(generation)` on the requesting thread after every newer request (the
        runtime breaks waits there that the training thread cannot leave by itself)."""
        self._listeners.append(listener)

    def request(self, generation: int) -> bool:
        """Record a stop for `generation`; True when it is newer than any earlier request."""
        with self._cond:
            if generation <= self._target:
                return False
            self._target = generation
            self._cond.notify_all()
        for listener in list(self._listeners):
            listener(generation)
        return True

    @property
    def target(self) -> int:
        return self._target  # one int, only ever replaced whole: no lock needed to read it

    def newer_than(self, generation: int) -> bool:
        """Checked at every phase edge and collective: a plain read, no lock."""
        return self._target > generation

    def wait_newer(self, generation: int, timeout: float) -> bool:
        """Block up to `timeout` s until a stop newer than `generation` exists."""
        with self._cond:
            return self._cond.wait_for(lambda: self._target > generation, timeout=timeout)

    def wait_either(self, generation: int, done: Callable[[], bool], timeout: float) -> None:
        """Block up to `timeout` s until `done()` or a stop newer than `generation`; whoever
        makes `done()` true calls `wake()`."""
        with self._cond:
            self._cond.wait_for(lambda: self._target > generation or done(), timeout=timeout)

    def wake(self) -> None:
        """Wake every waiter (what a `wait_either` waits for may have happened)."""
        with self._cond:
            self._cond.notify_all()
