"""launcher.runtime.wait_probe: is the training thread blocked in a C++ wait of DDP?

The probe looks at another thread from outside: its innermost Python frame must be one of the
waiting functions and its CPU clock must stand still. A thread sleeping inside such a function
is waiting; one computing inside it is not; one sleeping elsewhere is not.
"""

from __future__ import annotations

import threading
import time

from launcher.runtime.wait_probe import CppWaitProbe, StuckWaitAlarm, cpp_wait_codes


def _sleeps(stop: threading.Event) -> None:
    time.sleep(0.7)  # one call into C: the frame stays this one, the CPU clock stands still


def _spins(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def _probe_answers(target, codes) -> list[bool]:  # noqa: ANN001
    stop = threading.Event()
    t = threading.Thread(target=target, args=(stop,), daemon=True)
    t.start()
    try:
        time.sleep(0.05)
        probe = CppWaitProbe(codes, thread=t, quiet_s=0.05)
        answers = []
        for _ in range(4):
            answers.append(probe())
            time.sleep(0.1)
        return answers
    finally:
        stop.set()
        t.join(5)


def test_a_thread_blocked_inside_a_waiting_function_is_waiting():
    assert _probe_answers(_sleeps, [_sleeps.__code__])[1:] == [True, True, True]


def test_a_thread_computing_inside_it_or_blocked_elsewhere_is_not():
    assert not any(_probe_answers(_spins, [_spins.__code__]))
    assert not any(_probe_answers(_sleeps, [_spins.__code__]))


def test_the_functions_ddp_waits_in_are_found_in_this_torch():
    names = {c.co_name for c in cpp_wait_codes()}
    assert names == {"_engine_run_backward", "_pre_forward"}


class _Gate:
    """A thread in `hold()` sits in one C call (lock.acquire) until `open()`: its frame stays
    `hold`, its CPU clock stands still."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._opened = False

    def hold(self) -> None:
        self._lock.acquire(timeout=5.0)

    def open(self) -> None:
        if not self._opened:
            self._opened = True
            self._lock.release()


def _alarm_run(
    answered_after: float | None, release_after: float | None, cancel: bool = False
) -> list[int]:
    """A thread held in `_Gate.hold`; the alarm armed for generation 3 with 0.3 s. The thread is
    released, or the stop answered, after the given seconds (None: never); `cancel`: the alarm
    is cancelled right after it was armed. Returns the generations it reported stuck."""
    gate, stuck = _Gate(), []
    t = threading.Thread(target=gate.hold, daemon=True)
    t.start()
    t0 = time.monotonic()
    answered = lambda g: answered_after is not None and time.monotonic() - t0 >= answered_after  # noqa: E731
    alarm = StuckWaitAlarm([_Gate.hold.__code__], answered, stuck.append, thread=t, after_s=0.3)
    try:
        time.sleep(0.05)
        alarm.arm(3)
        if cancel:
            alarm.cancel()
        if release_after is not None:
            time.sleep(release_after)
            gate.open()
        time.sleep(0.6)
        return stuck
    finally:
        alarm.cancel()
        gate.open()
        t.join(5)


def test_a_wait_still_there_after_the_break_is_reported_stuck_once():
    assert _alarm_run(None, None) == [3]


def test_a_wait_that_ends_or_a_stop_answered_in_time_is_not():
    assert _alarm_run(None, 0.05) == []  # released (the usual case: milliseconds after the break)
    assert _alarm_run(0.1, None) == []  # the rank entered the round


def test_cancel_stops_a_pending_alarm():
    assert _alarm_run(None, None, cancel=True) == []
