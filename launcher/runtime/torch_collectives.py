"""torch.distributed collectives a stop can interrupt, for frameworks that call them directly.

Owns: `CollectiveRouting`, which (while installed) replaces the collective functions on the
`torch.distributed` package (all_reduce, broadcast, all_gather, reduce_scatter, ... the calls
megatron-core's tensor-parallel layers, cross entropy and gradient reductions make) by wrappers
that issue the same call with `async_op=True` and wait through the runtime's `Interruptible`:
a stop for a newer generation makes the rank leave (StopRequested), a failed collective waits
for the agent's stop (see StepPath.on_collective_error). A caller that asked for `async_op=True`
gets a work whose `wait()` is interruptible the same way.

Why a patch: a blocking gloo collective cannot be left from Python. Neither a signal, nor
`abort()`/`shutdown()` of the group, nor destroying it from another thread wakes the waiting
thread (checked on torch 2.13: the op only ends when a peer's process dies or the group
timeout expires), and megatron calls `torch.distributed.<op>` itself. Only the package
attributes are replaced: torch's internal calls (`distributed_c10d.<op>`) and functions bound
before installation are untouched. The patch is process-global because torch's API is; it is
installed once per process by `launcher.runtime.callbacks.attach` and removed by `uninstall()`.
"""

from __future__ import annotations

import functools
import inspect
import threading
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from launcher.runtime.collectives import Interruptible

# Most collectives of a training step finish within milliseconds: wait for them on the work's
# own condition variable first (wakes the moment they complete; polling would oversleep), then
# hand the wait to the runtime's stop-watching poll. A stop is seen at most this much later.
FAST_WAIT = timedelta(milliseconds=5)

ROUTED = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "all_to_all_single",
    "all_to_all",
    "barrier",
    "reduce",
    "gather",
    "scatter",
)


class InterruptibleWork:
    """An async work whose wait() watches the stop signal; everything else is the work's."""

    def __init__(self, work: Any, coll: Interruptible, what: str, keep: tuple[Any, ...]) -> None:
        self._work = work
        self._coll = coll
        self._what = what
        self._keep = keep

    def wait(self, timeout: Any = None) -> bool:
        if self._work.is_completed():
            return self._work.wait()
        wait_routed(self._coll, self._work, self._what, self._keep)
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def wait_routed(coll: Interruptible, work: Any, what: str, keep: tuple[Any, ...]) -> None:
    """Wait up to FAST_WAIT on the work itself, then through `coll` (stop, errors, timeout)."""
    try:
        work.wait(FAST_WAIT)
        return
    except RuntimeError:
        pass  # timed out (still running) or failed (completed): `coll` tells them apart
    coll.wait(work, what, keep)


def _async_index(fn: Callable[..., Any]) -> int:
    params = list(inspect.signature(fn).parameters)
    return params.index("async_op")


class CollectiveRouting:
    """Install/uninstall the interruptible wrappers on `torch.distributed`."""

    _lock = threading.Lock()
    _active: "CollectiveRouting | None" = None  # torch.distributed is one per process

    def __init__(self, coll: Interruptible) -> None:
        self._coll = coll
        self._originals: dict[str, Callable[..., Any]] = {}

    @property
    def installed(self) -> bool:
        return bool(self._originals)

    def install(self) -> "CollectiveRouting":
        with CollectiveRouting._lock:
            if CollectiveRouting._active is not None:
                raise RuntimeError(
                    "torch.distributed collectives are already routed through a runtime; "
                    "attach() once per process"
                )
            for name in ROUTED:
                orig = getattr(dist, name)
                self._originals[name] = orig
                setattr(dist, name, self._wrap(name, orig))
            CollectiveRouting._active = self
        return self

    def uninstall(self) -> None:
        with CollectiveRouting._lock:
            for name, orig in self._originals.items():
                setattr(dist, name, orig)
            self._originals.clear()
            if CollectiveRouting._active is self:
                CollectiveRouting._active = None

    def _wrap(self, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        index = _async_index(orig)
        coll = self._coll

        @functools.wraps(orig)
        def routed(*args: Any, **kwargs: Any) -> Any:
            if len(args) > index:
                wanted = bool(args[index])
                args = args[:index] + (True,) + args[index + 1 :]
            else:
                wanted = bool(kwargs.get("async_op", False))
                kwargs["async_op"] = True
            work = orig(*args, **kwargs)
            if work is None:  # this rank is not in the group: torch did nothing
                return None
            keep = args + tuple(kwargs.values())
            if wanted:
                return InterruptibleWork(work, coll, name, keep)
            wait_routed(coll, work, name, keep)
            return None

        routed.__ftrun_routed__ = True  # type: ignore[attr-defined]
        return routed
