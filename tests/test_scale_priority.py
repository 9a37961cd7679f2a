"""scripts/scale_priority.py: the simulation's threads lowered, the caller's kept, what a
thread starts inheriting it; --sim-nice's bounds."""

from __future__ import annotations

import os
import sys
import threading

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "scripts")]

import scale_priority as SP  # noqa: E402


def _mine() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_sim_nice_bounds() -> None:
    assert SP.check_sim_nice(0) == 0 and SP.check_sim_nice(19) == 19
    for bad in (-1, 20, "5", 2.5):
        with pytest.raises(ValueError, match="--sim-nice: an integer from 0"):
            SP.check_sim_nice(bad)


def test_a_lowered_thread_and_what_it_starts_run_lower_the_caller_does_not() -> None:
    base = _mine()
    seen: dict[str, int] = {}

    def child() -> None:
        seen["child"] = _mine()

    def body() -> str:
        seen["helper"] = _mine()
        t = threading.Thread(target=child)
        t.start()
        t.join(10)
        seen["in /proc"] = max(SP.thread_nices(os.getpid()))
        return "done"

    assert SP.run_niced(body, 3) == "done"
    want = min(SP.MAX_NICE, base + 3)
    assert seen == {"helper": want, "child": want, "in /proc": want}
    assert _mine() == base  # the caller keeps its priority
    assert SP.process_nice(os.getpid()) == os.getpriority(os.PRIO_PROCESS, 0)


def test_run_niced_raises_the_helpers_error_and_runs_inline_at_zero() -> None:
    def fails() -> None:
        raise KeyError("in the helper")

    with pytest.raises(KeyError, match="in the helper"):
        SP.run_niced(fails, 2)
    assert SP.run_niced(threading.get_native_id, 0) == threading.get_native_id()
    got: list[int] = []
    t = threading.Thread(target=SP.niced(lambda: got.append(_mine()), 2))
    t.start()
    t.join(10)
    assert got == [min(SP.MAX_NICE, _mine() + 2)]
    assert SP.thread_nices(2**22 + 12345) == []  # no such process
