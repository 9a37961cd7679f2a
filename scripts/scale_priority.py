"""CPU priority of the simulation in scripts/bench_scale.py.

Owns: `check_sim_nice` (the `--sim-nice` value: an integer 0..19, 0 keeps the inherited
priority), `lower_thread_priority(nice)` (the calling thread's nice value raised by `nice`;
threads it starts afterwards inherit it), `niced(fn, nice)` (a callable that lowers the thread
that calls it first: for pool and helper threads that build simulated nodes), `run_niced(fn,
nice)` (`fn` on a helper thread of lowered priority: every thread `fn` starts inherits it) and
`process_nice(pid)` / `thread_nices(pid)` (what a process and its threads run at, as read back).

Why: on a cluster the store server, the leader's agent with its controller and every other
node run on machines of their own. Here they share 2 cores, and thousands of simulated agents'
and ranks' threads are runnable during a round: at the same priority the store, the probe and
the controller queue behind them. Linux keeps a nice value per thread and a new thread inherits
its creator's, so the simulation's processes (`scale_hosts.serve`) lower their main thread
before they start anything, and the simulated nodes of the benchmark's own process are built
on lowered threads, while the benchmark's main thread, the store, the leader's process (its
agent, controller and ranks) and the fan-out probe keep theirs: the simulation gets the cores
the control plane leaves, as other machines would have had their own. Lowering a priority
needs no privilege.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, TypeVar

T = TypeVar("T")
MAX_NICE = 19
DEFAULT_SIM_NICE = 10  # weight 110 against nice 0's 1024: the control plane first, ~10:1


def check_sim_nice(value: int) -> int:
    """`value` if it is a valid --sim-nice, else ValueError naming what is allowed."""
    if not isinstance(value, int) or not 0 <= value <= MAX_NICE:
        raise ValueError(
            f"--sim-nice: an integer from 0 (the inherited priority) to {MAX_NICE} "
            f"(the lowest), not {value!r}"
        )
    return value


def lower_thread_priority(nice: int) -> int:
    """Raise the calling thread's nice value by `nice` (never below what it is); its nice
    value afterwards."""
    tid = threading.get_native_id()
    now = os.getpriority(os.PRIO_PROCESS, tid)
    if nice > 0:
        os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, now + nice))
    return os.getpriority(os.PRIO_PROCESS, tid)


def niced(fn: Callable[..., T], nice: int) -> Callable[..., T]:
    """`fn` lowering the thread that calls it by `nice` first (for threads of their own)."""

    def call(*args, **kw) -> T:
        lower_thread_priority(nice)
        return fn(*args, **kw)

    return call


def run_niced(fn: Callable[[], T], nice: int, timeout: float = 600.0) -> T:
    """`fn()` on a helper thread lowered by `nice` (the threads `fn` starts inherit it); its
    result, or its exception raised here. TimeoutError if it has not returned in `timeout`."""
    if nice <= 0:
        return fn()
    out: dict[str, object] = {}

    def body() -> None:
        try:
            out["value"] = niced(fn, nice)()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            out["error"] = e

    t = threading.Thread(target=body, name="sim-niced-start", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"a lowered helper thread did not return within {timeout:g} s")
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["value"]  # type: ignore[return-value]


def thread_nices(pid: int) -> list[int]:
    """The nice value of every thread of process `pid` (from /proc), sorted; [] if gone."""
    out = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out.append(int(fields[16]))  # field 19 of stat: nice (after pid and comm)
    return sorted(out)


def process_nice(pid: int) -> int:
    """The nice value of process `pid`'s main thread."""
    return os.getpriority(os.PRIO_PROCESS, pid)
