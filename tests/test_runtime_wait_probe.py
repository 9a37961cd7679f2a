"""launcher.runtime.wait_probe: is the training thread blocked in a C++ wait of DDP?

The probe looks at another thread from outside: its innermost Python frame must be one of the
waiting functions and its CPU clock must stand still. A thread sleeping inside such a function
is waiting; one computing inside it is not; one sleeping elsewhere is not.
"""
from __future__ import annotations

import threading
import time

from launcher.runtime.wait_probe import CppWaitProbe, cpp_wait_codes


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
