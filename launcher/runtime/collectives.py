"""Collectives a rank can always leave.

Owns: waiting on asynchronous torch.distributed work while watching the stop signal, and the
`Graveyard` that keeps abandoned works and process groups referenced for the rest of the
process (dropping the last reference to a gloo group with a stuck op blocks in its destructor
until the op times out). gloo ops cannot be aborted: a stopped rank abandons them; NCCL/HCCL
groups are additionally aborted through the device adapter.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from launcher.runtime.signals import StopRequested, StopSignal


class CollectiveError(RuntimeError):
    """A collective failed (peer gone, connection reset, timeout)."""


# what the errors of a failed backend collective say (gloo's transport, a timed-out or closed pair)
_BACKEND_MARKERS = (
    "/gloo/",
    "ProcessGroupGloo",
    "Connection closed by peer",
    "Connection reset by peer",
    "NCCL",
    "HCCL",
)


def is_backend_failure(exc: BaseException) -> bool:
    """Did a collective fail inside the communication backend (a peer gone, a timeout)?"""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    text = str(exc)
    return any(marker in text for marker in _BACKEND_MARKERS)


class Graveyard:
    """Abandoned works and groups, referenced until the process ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[Any] = []

    def keep(self, *objs: Any) -> None:
        with self._lock:
            self._items.extend(o for o in objs if o is not None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


BUSY_AFTER_S = 0.05  # a wait this long is reported through on_busy; shorter ones say nothing
SLICE_S = 0.005  # a sliced wait checks the stop signal at least this often
SLICE_MIN_S = 0.001  # work.wait(timeout) takes whole milliseconds


class _Busy:
    """Tells `on_busy` once a wait has lasted BUSY_AFTER_S, and again when it ends."""

    def __init__(self, on_busy: Callable[[bool], None]) -> None:
        self._on_busy = on_busy
        self._since = time.monotonic()
        self._told = False

    def due(self) -> float:
        """When tick() next has something to say (monotonic time; inf once it told)."""
        return float("inf") if self._told else self._since + BUSY_AFTER_S

    def tick(self, now: bool = False) -> None:
        """`now`: the wait turns into waiting for the agent (a failed collective): say so at
        once."""
        if not self._told and (now or time.monotonic() - self._since >= BUSY_AFTER_S):
            self._told = True
            self._on_busy(True)

    def done(self) -> None:
        if self._told:
            self._on_busy(False)


class Interruptible:
    """Issues collectives with async_op=True and waits for them while watching `stop`.

    `generation()` is the rank's current generation: a stop for a newer one interrupts the wait
    (StopRequested). `on_error(exc, what)` decides what a failed collective means; it raises.
    `on_busy(True)` is called once a wait lasts BUSY_AFTER_S and `on_busy(False)` when it ends
    (the heartbeat tells the agent's hang check that the rank waits on its peers rather than
    hangs itself).

    `sliced` (gloo only; the runtime turns it on for gloo): wait in the work's own blocking
    `wait(timeout)`, SLICE_S at a time, checking the stop between slices and telling on_busy as
    the other wait does -- the thread sleeps in C++ as torch DDP's does. Otherwise (NCCL/HCCL,
    whose wait() does not block the host; the default here) a callback on the work's future wakes
    a condition variable; on gloo that costs ~0.16 ms more CPU per wait than the sliced wait (a
    Python callback on gloo's thread, two thread hand-offs; measured per rank, 2 pinned ranks,
    a 0.56 MB all_reduce), several percent of a small model's step. (The sliced wait was off for
    a while: survivors of a recovered hang were killed as hung. The cause was the agent's hang
    watch, in both waits -- see launcher.hang.hang_watch -- not this wait.)
    """

    def __init__(
        self,
        stop: StopSignal,
        graveyard: Graveyard,
        generation: Callable[[], int],
        timeout: float,
        on_error: Callable[[BaseException, str], None],
        abort: Callable[[], None] | None = None,
        on_busy: Callable[[bool], None] | None = None,
        sliced: bool = False,
    ) -> None:
        self._sliced = sliced
        self._stop = stop
        self._on_busy = on_busy or (lambda busy: None)
        self._graveyard = graveyard
        self._generation = generation
        self.timeout = timeout
        self._on_error = on_error
        self._abort = abort

    def check_stop(self, where: str) -> None:
        """Raise StopRequested when a stop for a newer generation is pending (a plain read:
        cheap enough for every gradient hook)."""
        if self._stop.newer_than(self._generation()):
            raise StopRequested(self._stop.target, where)

    def wait(self, work: Any, what: str, keep: tuple[Any, ...] = ()) -> None:
        busy = _Busy(self._on_busy)
        try:
            if work.is_completed():  # already done (common at the end of backward): no wait
                self._finish(work, what, keep, busy)
            else:
                self._wait(work, what, keep, busy)
        finally:
            busy.done()

    def _finish(self, work: Any, what: str, keep: tuple[Any, ...], busy: _Busy) -> None:
        """A completed work: its wait() returns at once, or raises its error."""
        try:
            work.wait()
        except RuntimeError as exc:
            self._graveyard.keep(work, *keep)
            busy.tick(now=True)
            self._on_error(exc, what)
            raise CollectiveError(f"{what} failed: {exc}") from exc

    def _wait(self, work: Any, what: str, keep: tuple[Any, ...], busy: _Busy) -> None:
        deadline = time.monotonic() + self.timeout
        gen = self._generation()
        if self._sliced:
            while not work.is_completed():
                now = self._check(work, what, keep, busy, gen, deadline)
                try:
                    work.wait(
                        timedelta(
                            seconds=max(SLICE_MIN_S, min(deadline, busy.due(), now + SLICE_S) - now)
                        )
                    )
                except RuntimeError:
                    pass  # the slice ran out, or the work failed: is_completed() tells which
            self._finish(work, what, keep, busy)
            return
        done, poll = self._completion(work)
        while True:
            if done() or work.is_completed():  # the future may complete a moment before the work
                self._finish(work, what, keep, busy)
                return
            now = self._check(work, what, keep, busy, gen, deadline)
            self._stop.wait_either(gen, done, max(0.0, min(deadline, busy.due(), now + poll) - now))

    def _check(
        self, work: Any, what: str, keep: tuple[Any, ...], busy: _Busy, gen: int, deadline: float
    ) -> float:
        """Between two waits for an unfinished work: leave on a stop (StopRequested) or past the
        deadline (CollectiveError), tell on_busy once the wait is long; returns the time."""
        if self._stop.newer_than(gen):
            self._graveyard.keep(work, *keep)
            if self._abort is not None:
                self._abort()
            raise StopRequested(self._stop.target, f"left {what}")
        now = time.monotonic()
        if now > deadline:
            self._graveyard.keep(work, *keep)
            exc = TimeoutError(f"{what} did not complete within {self.timeout:.0f} s")
            busy.tick(now=True)
            self._on_error(exc, what)
            raise CollectiveError(str(exc)) from exc
        busy.tick()
        return now

    def _completion(self, work: Any) -> tuple[Callable[[], bool], float]:
        """(done, poll): a flag the work's future sets, waking the waiter, when the work
        completes, so the wait blocks until completion or a stop instead of polling; a backend
        without futures is polled every `poll` seconds."""
        flag = [False]

        def on_done(_fut: Any) -> None:
            flag[0] = True
            self._stop.wake()

        try:
            work.get_future().add_done_callback(on_done)
        except RuntimeError:
            return (lambda: bool(work.is_completed())), 0.001
        return (lambda: flag[0]), float("inf")

    def abandon(self, *objs: Any) -> None:
        """Keep works (and the tensors they write) this rank no longer waits for."""
        self._graveyard.keep(*objs)

    # ---- the collectives the runtime and scripts use ---------------------------------
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: Any = dist.ReduceOp.SUM,
        group: Any = None,
        what: str = "all_reduce",
    ) -> torch.Tensor:
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
        self.wait(work, what, (group, tensor))
        return tensor

    def broadcast(
        self, tensor: torch.Tensor, src: int, group: Any = None, what: str = "broadcast"
    ) -> torch.Tensor:
        work = dist.broadcast(tensor, src=src, group=group, async_op=True)
        self.wait(work, what, (group, tensor))
        return tensor

    def all_gather(
        self,
        out: list[torch.Tensor],
        tensor: torch.Tensor,
        group: Any = None,
        what: str = "all_gather",
    ) -> list[torch.Tensor]:
        work = dist.all_gather(out, tensor, group=group, async_op=True)
        self.wait(work, what, (group, tensor, out))
        return out

    def barrier(self, group: Any = None, what: str = "barrier") -> None:
        self.all_reduce(torch.zeros(1), group=group, what=what)

    def wait_blocking(self, works: list[Any], what: str, keep: tuple[Any, ...] = ()) -> None:
        """For works whose is_completed() only turns true inside wait() (gloo send/recv): a
        daemon thread blocks in wait() while this thread watches the stop signal."""
        busy = _Busy(self._on_busy)
        try:
            self._wait_blocking(works, what, keep, busy)
        finally:
            busy.done()

    def _wait_blocking(
        self, works: list[Any], what: str, keep: tuple[Any, ...], busy: _Busy
    ) -> None:
        done = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                for w in works:
                    w.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                errors.append(exc)
            finally:
                done.set()
                self._stop.wake()  # the waiting thread sleeps until this (or a stop) wakes it

        waiter = threading.Thread(target=run, name="ftrun-p2p-wait", daemon=True)
        waiter.start()
        deadline = time.monotonic() + self.timeout
        gen = self._generation()
        while not done.is_set():
            busy.tick()
            if self._stop.newer_than(gen):
                self._graveyard.keep(waiter, *works, *keep)
                if self._abort is not None:
                    self._abort()
                raise StopRequested(self._stop.target, f"left {what}")
            now = time.monotonic()
            if now > deadline:
                self._graveyard.keep(waiter, *works, *keep)
                exc = TimeoutError(f"{what} did not complete within {self.timeout:.0f} s")
                busy.tick(now=True)
                self._on_error(exc, what)
                raise CollectiveError(str(exc)) from exc
            # sleeps (no polling: the CPUs belong to the transfer) until the works complete, a
            # stop arrives, the busy report is due or the deadline passes
            self._stop.wait_either(gen, done.is_set, max(0.0, min(deadline, busy.due()) - now))
        if errors:
            self._graveyard.keep(*works, *keep)
            busy.tick(now=True)
            self._on_error(errors[0], what)
            raise CollectiveError(f"{what} failed: {errors[0]}") from errors[0]

    def send(self, tensors: list[torch.Tensor], dst: int, what: str = "send") -> None:
        """Send tensors to `dst` in order (posted together, waited together)."""
        self.wait_blocking([dist.isend(t, dst) for t in tensors], what, tuple(tensors))

    def recv(self, tensors: list[torch.Tensor], src: int, what: str = "recv") -> list[torch.Tensor]:
        self.wait_blocking([dist.irecv(t, src) for t in tensors], what, tuple(tensors))
        return tensors
