"""Bucketed gradient all-reduce overlapped with backward (launcher.runtime.buckets).

Unit: the layout is deterministic (reverse parameter order, small first bucket, dtype splits).
Multi-process (real gloo, 2 ranks): every bucket's all-reduce is issued during backward from the
second use on; the result equals the per-parameter all-reduce bit for bit (also with gradient
accumulation and an unused parameter); a stop interrupts the wait within a second, the bucket
buffers are abandoned and the same object works again in a new process group."""

from __future__ import annotations

import time

import torch
from helpers_runtime import master_store, run_workers, worker_logs

from launcher.runtime.buckets import FlatBucket, bucket_layout


def test_layout_is_reverse_order_with_a_small_first_bucket_and_dtype_splits():
    params = [
        torch.zeros(1000),
        torch.zeros(1000),
        torch.zeros(10, dtype=torch.float64),
        torch.zeros(300),
        torch.zeros(300),
        torch.zeros(300),
    ]
    # 4000-byte params; first cap 2000 bytes, then 5000 bytes
    layout = bucket_layout(params, bucket_bytes=5000, first_bucket_bytes=2000)
    assert layout == [[5, 4], [3], [2], [1, 0]]
    assert layout == bucket_layout(
        params, bucket_bytes=5000, first_bucket_bytes=2000
    )  # deterministic
    assert sorted(i for b in layout for i in b) == list(range(len(params)))


def test_flat_bucket_packs_gradients_and_zeros_for_missing_ones():
    a, b = torch.arange(6.0).view(2, 3), torch.ones(4)
    fb = FlatBucket([a, b])
    flat = fb.pack([a, None])
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 0, 0, 0, 0]
    assert fb.views[0].shape == (2, 3) and fb.views[1].shape == (4,)
    kept = fb.drop()
    assert fb.flat is None and kept[1] is flat


WORKER = r"""
import os, sys, threading, time
import torch, torch.distributed as dist
from launcher.runtime.buckets import GradComm, OverlappedAllReduce
from launcher.runtime.collectives import Graveyard, Interruptible
from launcher.runtime.signals import StopRequested, StopSignal

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
dist.init_process_group("gloo", store=dist.PrefixStore("g0", store), rank=rank, world_size=world)
stop, graveyard, gen = StopSignal(), Graveyard(), [0]

def watch():  # stands in for the agent channel: an out-of-band stop
    while not store.check(["stop"]):
        time.sleep(0.005)
    stop.request(1)
threading.Thread(target=watch, daemon=True).start()

def on_error(exc, what):
    if stop.wait_newer(gen[0], 30):
        raise StopRequested(stop.target, "after error")

coll = Interruptible(stop, graveyard, lambda: gen[0], 60.0, on_error)
in_backward, launches = [False], []

class Probe(GradComm):
    def all_reduce_async(self, flat):
        launches.append(in_backward[0])
        return super().all_reduce_async(flat)

torch.manual_seed(0)
unused = torch.nn.Linear(3, 3)  # defined first: its bucket is the last one
model = torch.nn.Sequential(
    torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128), torch.nn.Tanh(),
    torch.nn.Linear(128, 128), torch.nn.Tanh(), torch.nn.Linear(128, 4),
)
params = list(unused.parameters()) + list(model.parameters())
sync = OverlappedAllReduce(
    params, Probe(coll, lambda: None, world, 0), average=True, bucket_bytes=40_000
)
nb = len(sync.layout)
assert nb >= 3, sync.layout

def backward(step, passes=1):
    for k in range(passes):
        g = torch.Generator().manual_seed(100 * step + 10 * k + rank)
        loss = model(torch.randn(8, 32, generator=g)).square().mean()
        in_backward[0] = True
        loss.backward()
        in_backward[0] = False

def check(step):
    raw = [None if p.grad is None else p.grad.clone() for p in params]
    sync.finish()
    for p, r in zip(params, raw):
        want = torch.zeros_like(p) if r is None else r
        dist.all_reduce(want)
        want /= world
        assert torch.equal(p.grad, want), f"step {step}: {tuple(p.shape)} differs"

def rebuild_and_check():  # after a stop: a new group of generation 1, the buckets sum right in it
    graveyard.keep(*dist.distributed_c10d._world.pg_map.keys())
    dist.destroy_process_group()
    gen[0] = 1
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("g1", store), rank=rank, world_size=world
    )
    for p in params:
        p.grad = None
    backward(1)
    check(1)

MODE = os.environ["MODE"]
if MODE == "sum":
    for step in range(4):
        for p in params:
            p.grad = None
        del launches[:]
        backward(step, passes=2 if step == 3 else 1)
        check(step)
        # hooks are installed at construction: all but the unused bucket fly in backward
        if step < 3:
            assert launches == [True] * (nb - 1) + [False], (step, launches)
    print("sum ok", flush=True)
elif MODE == "stop":
    for p in params:
        p.grad = None
    if rank == 0:
        backward(0)  # rank 1 never joins: rank 0's launched all-reduces cannot complete
        store.set("waiting", b"1")
        try:
            sync.finish()
            raise AssertionError("finish() returned without its peer")
        except StopRequested:
            store.set("left", repr(time.time()).encode())
        assert len(graveyard) >= nb - 1 and all(b.flat is None for b in sync._buckets[:nb - 1])
    else:
        store.wait(["stop"])
    rebuild_and_check()
    print("rebuilt ok", flush=True)
elif MODE == "stop-in-backward":
    # a stop that arrives while backward runs aborts it at the next gradient instead of letting
    # it compute the rest (the survivors' time to stop holds up every recovery round)
    last = model[-1].weight  # its gradient is the first one ready
    def request_stop(_p):
        stop.request(1)

    handle = last.register_post_accumulate_grad_hook(request_stop)
    for p in params:
        p.grad = None
    try:
        backward(0)
        raise AssertionError("backward ran to the end despite the stop")
    except StopRequested as exc:
        assert "backward" in str(exc), exc
    done = sum(p.grad is not None for p in params)
    assert done < len(params) - len(list(unused.parameters())), f"{done} of {len(params)} gradients"
    handle.remove()
    sync.abandon()
    rebuild_and_check()
    print(f"aborted after {done} gradients; rebuilt ok", flush=True)
sys.stdout.flush()
os._exit(0)
"""


def run(tmp_path, mode: str, on_waiting=None) -> tuple[list[int], object]:
    store = master_store()
    procs = run_workers(WORKER, 2, tmp_path, store, {"MODE": mode})
    try:
        if on_waiting is not None:
            on_waiting(store)
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return codes, store


def test_all_reduces_fly_during_backward_and_equal_the_per_parameter_sum(tmp_path):
    codes, _ = run(tmp_path, "sum")
    assert codes == [0, 0], worker_logs(tmp_path, 2)
    assert "sum ok" in (tmp_path / "worker0.log").read_text()


def test_a_stop_interrupts_the_wait_and_the_buckets_work_again_in_a_new_group(tmp_path):
    t_stop: list[float] = []

    def stop_when_waiting(store):
        store.wait(["waiting"])
        time.sleep(0.3)  # rank 0 is blocked in finish()
        t_stop.append(time.time())
        store.set("stop", b"1")

    codes, store = run(tmp_path, "stop", stop_when_waiting)
    assert codes == [0, 0], worker_logs(tmp_path, 2)
    left = float(store.get("left").decode())
    assert left - t_stop[0] < 1.0, f"left {left - t_stop[0]:.3f} s after the stop"
    assert "rebuilt ok" in (tmp_path / "worker0.log").read_text()


def test_a_stop_during_backward_aborts_it_at_the_next_gradient(tmp_path):
    codes, _ = run(tmp_path, "stop-in-backward")
    assert codes == [0, 0], worker_logs(tmp_path, 2)
    for r in (0, 1):
        assert "rebuilt ok" in (tmp_path / f"worker{r}.log").read_text()
