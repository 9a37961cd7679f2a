"""An unmodified torch DistributedDataParallel script (no launcher.runtime), for launcher tests.

Works under torchrun and ftrun alike (torchrun semantics: a failure restarts every worker, and
this script starts again from step 0). Deterministic per --seed. Optional one-shot crash:
--fail-rank R --fail-step S exits rank R with code 1 at step S, once per --fail-marker file.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=None)
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--fail-rank", type=int, default=-1)
    ap.add_argument("--fail-step", type=int, default=-1)
    ap.add_argument("--fail-marker", default=None, help="crash only while this file does not exist")
    args = ap.parse_args(argv)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(args.steps):
        if (
            rank == args.fail_rank
            and step == args.fail_step
            and args.fail_marker
            and not os.path.exists(args.fail_marker)
        ):
            open(args.fail_marker, "w").close()
            print(f"rank {rank}: failing on purpose at step {step}", flush=True)
            os._exit(1)
        g = torch.Generator().manual_seed(args.seed * 1000 + step * 10 + rank)
        x = torch.randn(4, 8, generator=g)
        loss = (model(x) - x[:, :1]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.step_time:
            time.sleep(args.step_time)
    if args.out and rank == 0:
        torch.save({k: v.clone() for k, v in model.module.state_dict().items()}, args.out)
    print(
        f"rank {rank}: done, restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '?')}",
        flush=True,
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
