"""Test worker: an unmodified torch DDP (gloo) script, as users run under torchrun.

Trains a tiny MLP for --steps steps with a fixed seed; rank 0 writes the final loss and the
restart count to --out. With --crash-rank R, rank R exits with code 3 at --crash-step in the
first attempt (TORCHELASTIC_RESTART_COUNT == 0) only. With --started-dir, each rank creates
<dir>/rank<r> once its first step is done (tests wait for it before they fault a running job).
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP


@record
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="")
    p.add_argument("--crash-rank", type=int, default=-1)
    p.add_argument("--crash-step", type=int, default=3)
    p.add_argument("--crash-always", action="store_true")
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--started-dir", default="")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1234 + rank)
    loss = torch.tensor(0.0)
    for step in range(a.steps):
        if rank == a.crash_rank and step == a.crash_step and (restart == 0 or a.crash_always):
            raise RuntimeError(f"boom from rank {rank} at step {step}")
        x = torch.randn(8, 16, generator=g)
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if a.step_time:
            time.sleep(a.step_time)
        if step == 0 and a.started_dir:
            os.makedirs(a.started_dir, exist_ok=True)
            open(os.path.join(a.started_dir, f"rank{rank}"), "w").close()
    t = loss.detach().clone()
    dist.all_reduce(t)
    if rank == 0 and a.out:
        with open(a.out, "w") as f:
            json.dump({"loss": t.item() / world, "restart_count": restart, "world": world}, f)
    dist.destroy_process_group()
    # torch 2.13's gloo/DDP teardown at interpreter exit sometimes aborts ("terminate called
    # without an active exception", exit -6/-11) under torchrun and ftrun alike, after the
    # result is written: leave without running it, so the launchers are what the tests compare.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
