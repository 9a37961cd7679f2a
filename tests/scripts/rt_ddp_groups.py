"""Test worker: rt.ddp on a GroupHandle's data-parallel groups (two replica pairs).

Four ranks: pairs {0, 2} and {1, 3} each train their own model (seeded by pair) with
`rt.ddp(model, process_group=<the "dp" handle>)` and declare themselves replicas of each other
(`rt.set_replica_groups`), so a lost rank is repaired from its pair; a job-wide gradient norm
(an all-reduce over every rank at the end of backward) keeps the pairs in step. Small buckets
(several per step). Writes the final parameters to --out ('{rank}' for every rank)."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import torch  # noqa: E402

import launcher.runtime as ftr  # noqa: E402

PAIRS = [[0, 2], [1, 3]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rt = ftr.init(backend="gloo")
    dp = rt.new_group("dp", PAIRS)
    rt.set_replica_groups(PAIRS)
    pair = next(i for i, ranks in enumerate(PAIRS) if rt.rank in ranks)
    torch.manual_seed(100 + pair)
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 1),
    )
    model = rt.ddp(net, process_group=dp, bucket_cap_mb=0.01)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    pos = {"batch": 0}
    rt.register(model=model, optimizer=opt, data=(lambda: dict(pos), lambda p: pos.update(p)))
    for step in rt.steps(args.steps):
        with step:
            with step.phase("forward"):
                g = torch.Generator().manual_seed(1000 * pos["batch"] + rt.rank)
                pos["batch"] += 1
                x = torch.randn(8, 16, generator=g)
                loss = torch.nn.functional.mse_loss(model(x), x[:, :1])
            with step.phase("backward"):
                opt.zero_grad()
                loss.backward()
                # the job-wide gradient norm (as Megatron clips by it) keeps both pairs in step
                sq = torch.stack([p.grad.pow(2).sum() for p in model.parameters()]).sum()
                grad_norm = rt.all_reduce(sq).sqrt()
            with step.optimizer_update():
                opt.step()
    print(f"rank {rt.rank}: done, job-wide gradient norm {float(grad_norm):.6f}", flush=True)
    out = args.out.format(rank=rt.rank)
    tmp = f"{out}.tmp{os.getpid()}"
    torch.save({"params": {k: v.clone() for k, v in model.module.state_dict().items()}}, tmp)
    os.replace(tmp, out)
    rt.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
