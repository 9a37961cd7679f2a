"""Hybrid layout: 2 data-parallel replicas x 2 tensor-parallel shards (4 ranks).

Each shard owns half of an MLP's hidden units (Megatron style): a column-parallel first layer
and a row-parallel second layer whose partial outputs are all_reduced in the TP group
({0,1} and {2,3}); gradients are averaged in the DP group ({0,2} and {1,3}). So rank r and
rank r+2 hold equal state and only they can repair each other. Deterministic per --seed; runs
under ftrun (recovery) and plain torchrun (no recovery).

    ftrun --nproc_per_node 4 scripts/examples/hybrid_train.py --steps 40 --out /tmp/p{rank}.pt
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import torch  # noqa: E402

import launcher.runtime as ftr  # noqa: E402

TP = 2


class ReduceFromTP(torch.autograd.Function):
    """Forward: sum the partial outputs over the TP group. Backward: identity."""

    @staticmethod
    def forward(
        ctx,
        partial: torch.Tensor,
        rt: ftr.Runtime,  # type: ignore[override]
        group: ftr.GroupHandle,
    ) -> torch.Tensor:
        out = partial.clone()
        rt.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None, None


class ShardedMLP(torch.nn.Module):
    def __init__(self, inputs: int, hidden: int, outputs: int) -> None:
        super().__init__()
        half = hidden // TP
        self.w1 = torch.nn.Parameter(torch.randn(half, inputs) / inputs**0.5)
        self.b1 = torch.nn.Parameter(torch.zeros(half))
        self.w2 = torch.nn.Parameter(torch.randn(outputs, half) / hidden**0.5)
        self.b2 = torch.nn.Parameter(torch.zeros(outputs))  # replicated across TP
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, rt: ftr.Runtime, tp: ftr.GroupHandle) -> torch.Tensor:
        h = self.drop(torch.relu(x @ self.w1.t() + self.b1))
        return ReduceFromTP.apply(h @ self.w2.t(), rt, tp) + self.b2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument(
        "--out", default=None, help="final parameters; '{rank}' is replaced by the rank"
    )
    ap.add_argument("--checkpoint-dir", default=None)
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument("--step-time", type=float, default=0.0)
    args = ap.parse_args(argv)

    rt = ftr.init(backend="gloo")
    if rt.world_size != 2 * TP:
        raise SystemExit(
            f"hybrid_train.py needs WORLD_SIZE=4 (2 replicas x 2 shards), got {rt.world_size}"
        )
    groups = rt.set_layout(dp=2, tp=TP)  # replicas: [0, 2] and [1, 3]
    tp_rank, dp_rank = rt.rank % TP, rt.rank // TP
    torch.manual_seed(args.seed + 101 * tp_rank)  # Megatron: seed per TP rank, shared across DP
    model = ShardedMLP(32, args.hidden, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    ema = torch.zeros(())  # a global tensor that depends on the iteration: repaired, rolled back
    pos = {"batch": 0}

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(args.seed * 7919 + pos["batch"] * 31 + dp_rank)
        pos["batch"] += 1
        x = torch.randn(args.batch, 32, generator=g)
        return x, torch.stack([x[:, i] * (i + 1) for i in range(4)], dim=1)

    rt.register(
        model=model,
        optimizer=opt,
        scheduler=sched,
        extra={"loss_ema": ema},
        data=(lambda: dict(pos), lambda p: pos.update(p)),
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
    )
    for step in rt.steps(args.steps):
        with step:
            with step.phase("forward"):
                if args.step_time:
                    time.sleep(args.step_time)
                x, y = next_batch()
                loss = torch.nn.functional.mse_loss(model(x, rt, groups["tp"]), y)
            with step.phase("backward"):
                loss.backward()
                rt.allreduce_gradients(model, group=groups["dp"])
                mean_loss = rt.all_reduce(loss.detach().clone(), group=groups["dp"]) / 2
            with step.optimizer_update():
                opt.step()
                sched.step()
                opt.zero_grad()
                ema.mul_(0.9).add_(0.1 * mean_loss)
    if args.out:
        path = args.out.format(rank=rt.rank)
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save(
            {
                "params": {k: v.clone() for k, v in model.state_dict().items()},
                "ema": ema.clone(),
                "step": rt.committed_step,
            },
            tmp,
        )
        os.replace(tmp, path)
    print(
        f"rank {rt.rank} (tp {tp_rank}, dp {dp_rank}): done, last step {rt.committed_step}, "
        f"ema {float(ema):.6f}",
        flush=True,
    )
    rt.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
