"""Peer state transfer between real gloo processes: the received state is bit-identical."""
from __future__ import annotations

import pytest
import torch

from helpers_runtime import master_store, run_workers, worker_logs

WORKER = r"""
import os, random, sys, json
import numpy as np, torch, torch.distributed as dist
from launcher.runtime.collectives import Graveyard, Interruptible
from launcher.runtime.devices import DeviceAdapter
from launcher.runtime.signals import StopSignal
from launcher.runtime.state import Registered
from launcher.runtime.transfer import recv_state, send_state

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
dist.init_process_group("gloo", store=dist.PrefixStore("t", store), rank=rank, world_size=world)
hidden = int(os.environ["HIDDEN"])
torch.manual_seed(100 + rank)  # different initial weights on every rank
model = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.ReLU(),
                            torch.nn.Dropout(0.2), torch.nn.Linear(hidden, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
pos = {"batch": 0}
ema = torch.zeros(4)
reg = Registered([model], [opt], [sched], (lambda: dict(pos), lambda p: pos.update(p)), {"ema": ema})

def train(n, seed):
    for i in range(n):
        g = torch.Generator().manual_seed(seed + i)
        x = torch.randn(8, 16, generator=g)
        model(x).pow(2).mean().backward()
        opt.step(); sched.step(); opt.zero_grad()
        ema.add_(1.0); pos["batch"] += 1

coll = Interruptible(StopSignal(), Graveyard(), lambda: 0, 60.0, lambda e, w: None)
dev = DeviceAdapter()
if rank == 0:
    train(3, 1)
    random.seed(5); np.random.seed(6); torch.manual_seed(7)
    snap = reg.snapshot(3, dev)
    for dst in range(1, world):
        stats = send_state(coll, reg.full_state(snap), dst)
        print("sent", stats.nbytes, stats.tensors, f"{stats.seconds:.4f}", flush=True)
else:
    if rank == 2:
        train(2, 50)  # a 'dirty' survivor: optimizer state exists, values differ
    live = reg.live_tensors()
    param_ptrs = [p.data_ptr() for p in model.parameters()]
    state, stats = recv_state(coll, 0, live)
    reg.load_full_state(state, dev)
    assert [p.data_ptr() for p in model.parameters()] == param_ptrs  # written in place
    assert state["step"] == 3
    print("received", stats.nbytes, stats.tensors, f"{stats.seconds:.4f}", flush=True)
# one more identical step everywhere, then dump everything
train(1, 999)
out = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
       "draw": (random.random(), float(np.random.rand()), torch.rand(3)), "pos": dict(pos), "ema": ema}
torch.save(out, f"out{rank}.pt")
dist.barrier()
"""


def _equal(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.mark.parametrize("hidden", [8, 600])  # 600: tensors above the packing threshold
def test_state_transfer_is_bit_identical(tmp_path, hidden):
    store = master_store()
    procs = run_workers(WORKER, 3, tmp_path, store, {"HIDDEN": str(hidden)})
    codes = [p.wait(timeout=90) for p in procs]
    assert codes == [0, 0, 0], worker_logs(tmp_path, 3)
    outs = [torch.load(tmp_path / f"out{r}.pt", weights_only=False) for r in range(3)]
    for r in (1, 2):
        _equal(outs[0], outs[r], f"rank{r}")
    assert outs[0]["pos"] == {"batch": 4} and outs[0]["sched"]["last_epoch"] == 4
    assert "received" in (tmp_path / "worker1.log").read_text()
