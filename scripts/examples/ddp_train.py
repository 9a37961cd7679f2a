"""Data-parallel MLP trained with launcher.runtime (process-level recovery under ftrun).

Deterministic: the same --seed gives bit-identical parameters, with or without faults. Every
rank holds the full model (plain DDP: every rank is a replica of every other). Runs under
`ftrun` (recovery) and under plain `torchrun` (no recovery).

    ftrun --nproc_per_node 4 scripts/examples/ddp_train.py --steps 50 --out /tmp/params.pt
    --hidden 1024 --layers 8   -> about 100 MB of parameters + Adam state (benchmarks)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import torch  # noqa: E402

import launcher.runtime as ftr  # noqa: E402


def build_model(hidden: int, layers: int, inputs: int = 32) -> torch.nn.Module:
    mods: list[torch.nn.Module] = [
        torch.nn.Linear(inputs, hidden),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
    ]
    for _ in range(layers - 2):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(hidden, 1))
    return torch.nn.Sequential(*mods)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument(
        "--out", default=None, help="write final parameters here (rank 0; '{rank}' for every rank)"
    )
    ap.add_argument("--checkpoint-dir", default=None)
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument(
        "--step-time", type=float, default=0.0, help="extra seconds per step (sleep in forward)"
    )
    ap.add_argument(
        "--fixed-projection",
        action="store_true",
        help="draw a fixed random input projection "
        "after building the model, kept outside the registered state (a replacement must not "
        "skip its parameter init then: see launcher.runtime.skip_init)",
    )
    args = ap.parse_args(argv)
    if args.layers < 2:
        ap.error(f"--layers {args.layers} must be >= 2")

    rt = ftr.init(backend="gloo")
    torch.manual_seed(args.seed)  # replicas share the seed (and so their dropout masks)
    model = build_model(args.hidden, args.layers)
    proj = torch.randn(32, 32) if args.fixed_projection else None  # same on every rank (seeded)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    pos = {"batch": 0}

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + pos["batch"] * 1009 + rt.rank)
        pos["batch"] += 1
        x = torch.randn(args.batch, 32, generator=g)
        if proj is not None:
            x = x @ proj
        return x, x[:, :1] * 0.5 - x[:, 1:2]

    rt.register(
        model=model,
        optimizer=opt,
        scheduler=sched,
        data=(lambda: dict(pos), lambda p: pos.update(p)),
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
    )
    loss = torch.zeros(())
    for step in rt.steps(args.steps):
        with step:
            with step.phase("forward"):
                if args.step_time:
                    time.sleep(args.step_time)
                x, y = next_batch()
                loss = torch.nn.functional.mse_loss(model(x), y)
            with step.phase("backward"):
                loss.backward()
                rt.allreduce_gradients(model)
            with step.optimizer_update():
                opt.step()
                sched.step()
                opt.zero_grad()
    if args.out and (rt.rank == 0 or "{rank}" in args.out):
        path = args.out.format(rank=rt.rank)
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save(
            {
                "params": {k: v.clone() for k, v in model.state_dict().items()},
                "step": rt.committed_step,
                "loss": float(loss.detach()),
            },
            tmp,
        )
        os.replace(tmp, path)
    print(
        f"rank {rt.rank}: done, last step {rt.committed_step}, loss {float(loss.detach()):.6f}",
        flush=True,
    )
    rt.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
