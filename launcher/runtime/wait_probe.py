"""Is the training thread blocked in a collective wait that torch runs in C++?

Owns: `CppWaitProbe` and `StuckWaitAlarm` (the same question asked once, a second after a stop
shut down the sockets such a wait uses: still there means it will not end). DDP's own reducer
under rt.ddp waits for its all-reduces inside `loss.backward()` (and for its bucket-rebuild
broadcast inside DDP's `_pre_forward`), in C++, where no Python code runs to tell the agent
"this rank waits on its peers" as the runtime's own waits do (`Interruptible`'s on_busy). The
agent's hang watch needs that to blame the hung rank and not the peers waiting for it. The
probe answers from outside, at no cost to the step: the training thread's innermost Python
frame is one of the waiting functions, and its CPU clock has not moved for `quiet_s` (a
backward that computes moves it; one blocked on a socket does not). The agent channel's writer
thread asks it a few times a second (see AgentChannel).
"""

from __future__ import annotations

import sys
import threading
import time
from types import CodeType
from typing import Callable, Iterable

QUIET_S = 0.05  # as long as Interruptible waits before it says it is busy (BUSY_AFTER_S)
PERIOD_S = 0.25  # how often the channel's writer asks while a probe is set


def cpp_wait_codes() -> list[CodeType]:
    """The Python functions inside which torch waits in C++ for DDP's collectives."""
    codes: list[CodeType] = []
    try:
        from torch.autograd import graph

        codes.append(graph._engine_run_backward.__code__)
    except (ImportError, AttributeError):
        pass
    try:
        from torch.nn.parallel import DistributedDataParallel

        codes.append(DistributedDataParallel._pre_forward.__code__)
    except (ImportError, AttributeError):
        pass
    return codes


class CppWaitProbe:
    """`probe()` is True while `thread` sits without CPU inside one of `codes` for >= quiet_s."""

    def __init__(
        self,
        codes: Iterable[CodeType],
        thread: threading.Thread | None = None,
        quiet_s: float = QUIET_S,
    ) -> None:
        thread = thread or threading.main_thread()
        if thread.ident is None:
            raise ValueError("the probed thread has not started")
        self._ident = thread.ident
        self._clock = time.pthread_getcpuclockid(thread.ident)
        self._codes = frozenset(codes)
        self._quiet_s = quiet_s
        self._cpu = -1.0
        self._since = time.monotonic()

    def __call__(self) -> bool:
        frame = sys._current_frames().get(self._ident)
        inside = frame is not None and frame.f_code in self._codes
        try:
            cpu = time.clock_gettime(self._clock)
        except OSError:  # the thread has ended
            return False
        now = time.monotonic()
        if not inside or cpu != self._cpu:
            self._cpu, self._since = cpu, now
            return False
        return now - self._since >= self._quiet_s


STUCK_AFTER_BREAK_S = 1.0  # a C++ wait this long after its sockets were shut down will not end


class StuckWaitAlarm:
    """After a stop shut down the old groups' sockets: is the training thread still in the same
    C++ wait `after_s` later, without having run at all? Such a wait will not end before the
    group's timeout: gloo never fails a send it had queued on a connection that then failed (a
    peer killed while this rank sent to it; see launcher.runtime.group_sockets). A released
    wait takes milliseconds. `arm(generation)` (the agent channel's reader, right after the
    break) samples the thread and starts a timer; when it fires and `answered(generation)` is
    still false and the thread has neither left the wait codes nor used any CPU, `on_stuck
    (generation)` is called (the runtime tells the agent, which replaces the rank at once
    instead of after FTRUN_HANG_STOP). The owner calls `cancel()` when it finishes."""

    def __init__(
        self,
        codes: Iterable[CodeType],
        answered: Callable[[int], bool],
        on_stuck: Callable[[int], None],
        thread: threading.Thread | None = None,
        after_s: float = STUCK_AFTER_BREAK_S,
    ) -> None:
        self._codes = list(codes)
        self._thread = thread or threading.main_thread()
        self._answered = answered
        self._on_stuck = on_stuck
        self._after_s = after_s
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def arm(self, generation: int) -> None:
        probe = CppWaitProbe(self._codes, self._thread, quiet_s=self._after_s * 0.9)
        probe()  # the first sample records where the thread is and its CPU clock
        timer = threading.Timer(self._after_s, self._fire, args=(generation, probe))
        timer.daemon = True
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = timer
        timer.start()

    def _fire(self, generation: int, probe: CppWaitProbe) -> None:
        if self._answered(generation):
            return
        if probe():  # inside the same wait codes, not one CPU tick since the break
            self._on_stuck(generation)

    def cancel(self) -> None:
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
