"""torchrun baseline worker for scripts/bench_recovery.py: what a torchrun user runs today.

Plain torch (no launcher.runtime): the same model as bench_recovery_worker.py, gradients
all-reduced by hand, a checkpoint every --checkpoint-every steps (rank 0, written atomically), and
on every (re)start the latest checkpoint is loaded and the steps since are recomputed. The
process group is built on a per-attempt store prefix: torch 2.13's torchrun reuses its store
across restarts, and without the prefix a restarted gloo job reads the dead attempt's addresses
(membership restarts keep the restart count, so the prefix counts this rank's starts instead).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--checkpoint-dir", required=True)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--step-time", type=float, default=0.0, help="sleep per step (slow steps)")
    a = ap.parse_args()
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=300),
    )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # the prefix counts this rank's starts, not TORCHELASTIC_RESTART_COUNT: an agent that
    # restarts for a membership change (another node's worker failed) keeps its count while the
    # failed node's agent counts one more. Every rank starts once per restart-all: prefixes agree.
    starts = store.add(f"bench/starts/{rank}", 1)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"attempt{starts}", store), rank=rank, world_size=world
    )
    torch.manual_seed(7)
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, a.hidden), torch.nn.ReLU()]
    for _ in range(a.layers - 2):
        layers += [torch.nn.Linear(a.hidden, a.hidden), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(a.hidden, 1))
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    start = 0
    latest = os.path.join(a.checkpoint_dir, "latest.pt")
    if os.path.exists(latest):
        ck = torch.load(latest, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start = ck["step"] + 1
    log = open(os.path.join(os.environ["OUT_DIR"], f"steps.{rank}.jsonl"), "a", buffering=1)
    params = list(model.parameters())
    for step in range(start, a.steps):
        g = torch.Generator().manual_seed(step * 100 + rank)
        loss = model(torch.randn(8, 64, generator=g)).pow(2).mean()
        if a.step_time:
            time.sleep(a.step_time)
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[off : off + n].view_as(p))
            off += n
        opt.step()
        opt.zero_grad()
        if rank == 0 and a.checkpoint_every and (step + 1) % a.checkpoint_every == 0:
            os.makedirs(a.checkpoint_dir, exist_ok=True)
            tmp = latest + ".tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, latest)
        dist.barrier() if a.checkpoint_every and (step + 1) % a.checkpoint_every == 0 else None
        log.write(json.dumps({"step": step, "time": time.time(), "pid": os.getpid()}) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
