"""Interruptible collectives: a survivor leaves a collective within 1 s of the stop signal while
a peer was SIGKILLed mid-collective (reporting itself busy while blocked), abandons the old group
safely and works in a new one."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch.distributed as dist
from helpers_runtime import master_store, run_workers, worker_logs

WORKER = r"""
import os, sys, threading, time
import torch, torch.distributed as dist
from launcher.runtime.collectives import Graveyard, Interruptible
from launcher.runtime.signals import StopRequested, StopSignal

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
dist.init_process_group("gloo", store=dist.PrefixStore("g0", store), rank=rank, world_size=world)
stop = StopSignal()

def watch():  # stands in for the agent channel: an out-of-band stop
    while not store.check(["stop"]):
        time.sleep(0.005)
    stop.request(1)
threading.Thread(target=watch, daemon=True).start()

def on_error(exc, what):  # like the runtime: a failed collective waits for the agent's stop
    if stop.wait_newer(0, 30):
        raise StopRequested(stop.target, "after error")

graveyard = Graveyard()
busy = []  # on_busy calls: True once a wait lasts BUSY_AFTER_S, False when it ends
sliced = os.environ["SLICED"] == "1"  # gloo's own wait in slices, or the future-callback wait
coll = Interruptible(
    stop, graveyard, lambda: 0, 120.0, on_error, on_busy=busy.append, sliced=sliced
)
t = torch.ones(1 << 16)
store.add("looping", 1)
try:
    while True:
        coll.all_reduce(t)
except StopRequested:
    left = time.time()
# blocked in the ring for 0.5 s before the stop: reported busy, then not busy when it left
assert busy[-2:] == [True, False] and busy == [i % 2 == 0 for i in range(len(busy))], busy
store.set(f"left/{rank}", repr(left))
# abandon generation 0 (kept referenced), rebuild among the survivors
graveyard.keep(*dist.distributed_c10d._world.pg_map.keys())
t0 = time.time()
dist.destroy_process_group()
destroy_s = time.time() - t0
survivors = [r for r in range(world) if r != int(os.environ["VICTIM"])]
dist.init_process_group("gloo", store=dist.PrefixStore("g1", store), rank=survivors.index(rank),
                        world_size=len(survivors))
x = torch.ones(3)
coll2 = Interruptible(stop, graveyard, lambda: 1, 60.0, on_error, sliced=sliced)
coll2.all_reduce(x)
print(f"destroy {destroy_s:.4f}s new-group sum {x.tolist()}", flush=True)
assert x.tolist() == [float(len(survivors))] * 3
sys.stdout.flush()
os._exit(0)  # abandoned groups: never run their destructors
"""


@pytest.mark.parametrize("sliced", [True, False], ids=["sliced-wait", "future-wait"])
def test_survivors_leave_within_one_second_of_stop(tmp_path, sliced):
    store = master_store()
    procs = run_workers(
        WORKER, 4, tmp_path, store, {"VICTIM": "2", "SLICED": "1" if sliced else "0"}
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (
            not store.check(["looping"]) or store.add("looping", 0) < 4
        ):
            time.sleep(0.05)
        time.sleep(0.3)
        os.kill(procs[2].pid, signal.SIGKILL)
        time.sleep(0.5)  # ranks not adjacent to the victim are now blocked in the ring
        t_stop = time.time()
        store.set("stop", b"1")
        codes = [p.wait(timeout=60) if i != 2 else p.wait(timeout=5) for i, p in enumerate(procs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes[2] == -signal.SIGKILL
    assert [codes[i] for i in (0, 1, 3)] == [0, 0, 0], worker_logs(tmp_path, 4)
    for r in (0, 1, 3):
        left = float(store.get(f"left/{r}").decode())
        print(f"rank {r} left its collective {left - t_stop:.4f} s after the stop")
        assert left - t_stop < 1.0, f"rank {r} left {left - t_stop:.3f} s after the stop"
    assert "new-group sum [3.0, 3.0, 3.0]" in (tmp_path / "worker0.log").read_text()


class _BlockingWork:
    """A gloo-like send/recv work whose wait() blocks until released (no futures)."""

    def __init__(self, release) -> None:
        self._release = release

    def wait(self) -> bool:
        self._release.wait(10)
        return True


def test_p2p_wait_sleeps_instead_of_polling() -> None:
    """wait_blocking used to wake every <= 2 ms while a state transfer ran (its thread took CPU
    time from the transfer on a busy node); it now sleeps until the works complete or a stop."""
    import threading

    from launcher.runtime.collectives import Graveyard, Interruptible
    from launcher.runtime.signals import StopRequested, StopSignal

    class CountingStop(StopSignal):
        checks = 0

        def newer_than(self, generation: int) -> bool:
            CountingStop.checks += 1
            return super().newer_than(generation)

    stop = CountingStop()
    busy: list[bool] = []
    coll = Interruptible(stop, Graveyard(), lambda: 0, 30.0, lambda e, w: None, on_busy=busy.append)
    release = threading.Event()
    threading.Timer(0.4, release.set).start()
    t0 = time.monotonic()
    coll.wait_blocking([_BlockingWork(release)], "state tensors")
    assert 0.35 < time.monotonic() - t0 < 2.0
    assert CountingStop.checks <= 5, f"{CountingStop.checks} wake-ups during a 0.4 s wait"
    assert busy == [True, False]  # the busy report still goes out after BUSY_AFTER_S
    # and a stop still ends the wait at once
    release2 = threading.Event()
    threading.Timer(0.1, lambda: stop.request(1)).start()
    t0 = time.monotonic()
    try:
        coll.wait_blocking([_BlockingWork(release2)], "state tensors")
        raise AssertionError("the stop did not interrupt the wait")
    except StopRequested:
        assert time.monotonic() - t0 < 1.0
    finally:
        release2.set()


def test_backend_failures_are_told_from_other_errors() -> None:
    from launcher.runtime.collectives import is_backend_failure

    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
        "closed by peer [127.0.0.1]:23450"
    )
    assert is_backend_failure(gloo)
    assert is_backend_failure(dist.DistBackendError("NCCL communicator was aborted"))
    assert not is_backend_failure(
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x4)")
    )
    assert not is_backend_failure(ValueError("bad batch"))


def test_stop_listeners_hear_each_newer_stop_once_on_the_requesting_thread() -> None:
    from launcher.runtime.signals import StopSignal

    heard: list[tuple[int, str]] = []
    stop = StopSignal()
    stop.on_request(lambda g: heard.append((g, threading.current_thread().name)))
    t = threading.Thread(
        target=lambda: (stop.request(2), stop.request(1), stop.request(2)), name="reader"
    )
    t.start()
    t.join(5)
    assert heard == [(2, "reader")]
