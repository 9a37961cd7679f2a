"""Is the training thread blocked in a collective wait that torch runs in C++?

Owns: `CppWaitProbe`. DDP's own reducer under rt.ddp waits for its all-reduces inside
`loss.backward()` (and for its bucket-rebuild broadcast inside DDP's `_pre_forward`), in C++,
where no Python code runs to tell the agent "this rank waits on its peers" as the runtime's own
waits do (`Interruptible`'s on_busy). The agent's hang watch needs that to blame the hung rank
and not the peers waiting for it. The probe answers from outside, at no cost to the step: the
training thread's innermost Python frame is one of the waiting functions, and its CPU clock
has not moved for `quiet_s` (a backward that computes moves it; one blocked on a socket does
not). The agent channel's writer thread asks it a few times a second (see AgentChannel).
"""
from __future__ import annotations

import sys
import threading
import time
from types import CodeType
from typing import Iterable

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

    def __init__(self, codes: Iterable[CodeType], thread: threading.Thread | None = None,
                 quiet_s: float = QUIET_S) -> None:
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
