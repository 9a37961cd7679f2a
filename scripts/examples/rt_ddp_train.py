"""A stock torch DDP training loop with process-level recovery: `rt.ddp(module)` in place of
`DistributedDataParallel(module)`, inside the runtime's step loop.

The model is wrapped exactly as with torch DDP (`model(x)`, `loss.backward()`, `opt.step()`,
`model.module`, `model.no_sync()` all work); DDP's gradient all-reduces overlap backward and go
through the runtime, so a stop interrupts them and a failed rank is repaired from a replica.
Deterministic: the same --seed gives the same parameters as plain DDP under torchrun
(tests/scripts/ddp_reference.py), with or without faults. Runs under `ftrun` (recovery) and
under plain `torchrun` (no recovery).

    ftrun --nproc_per_node 4 scripts/examples/rt_ddp_train.py --steps 50 --out /tmp/params{rank}.pt
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import torch  # noqa: E402

import launcher.runtime as ftr  # noqa: E402


def build_model(hidden: int, layers: int, norm: bool, inputs: int = 32) -> torch.nn.Module:
    mods: list[torch.nn.Module] = [torch.nn.Linear(inputs, hidden)]
    if norm:
        mods.append(torch.nn.BatchNorm1d(hidden))  # buffers: DDP broadcasts them every forward
    mods += [torch.nn.ReLU(), torch.nn.Dropout(0.1)]
    for _ in range(layers - 2):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(hidden, 1))
    return torch.nn.Sequential(*mods)


def make_batch(seed: int, index: int, rank: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch `index` of `rank`: a pure function of its arguments (restartable data)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index * 1009 + rank)
    x = torch.randn(batch, 32, generator=g)
    return x, x[:, :1] * 0.5 - x[:, 1:2]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument(
        "--norm", action="store_true", help="add a BatchNorm1d (buffers broadcast by DDP)"
    )
    ap.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP's bucket_cap_mb")
    ap.add_argument(
        "--accum",
        type=int,
        default=1,
        help="micro-batches per step: the first accum-1 backwards under model.no_sync()",
    )
    ap.add_argument("--keep-grads", action="store_true", help="opt.zero_grad(set_to_none=False)")
    ap.add_argument(
        "--out", default=None, help="write final parameters here ('{rank}' for every rank)"
    )
    ap.add_argument(
        "--pause",
        default=None,
        metavar="RANK,STEP,SECONDS",
        help="rank RANK sleeps SECONDS at the end of step STEP's forward, while its peers wait in "
        "DDP's all-reduce (a fault plan can fire at its backward then)",
    )
    ap.add_argument(
        "--checkpoint-dir", default=None, help="durable checkpoints (a restart-all resumes there)"
    )
    ap.add_argument("--checkpoint-every", type=int, default=0)
    args = ap.parse_args(argv)
    if args.layers < 2:
        ap.error(f"--layers {args.layers} must be >= 2")
    if args.accum < 1:
        ap.error(f"--accum {args.accum} must be >= 1")
    if args.pause is not None:
        try:
            rank, step, seconds = args.pause.split(",")
            args.pause = (int(rank), int(step), float(seconds))
        except ValueError:
            ap.error(f"--pause {args.pause!r} must be RANK,STEP,SECONDS (e.g. 1,2,1.0)")
    return args


def save(path: str, model: torch.nn.Module, step: int, loss: torch.Tensor) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(
        {
            "params": {k: v.clone() for k, v in model.state_dict().items()},
            "step": step,
            "loss": float(loss.detach()),
        },
        tmp,
    )
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    rt = ftr.init(backend="gloo")
    torch.manual_seed(args.seed)  # replicas share the seed (and so their dropout masks)
    # torch: model = DistributedDataParallel(build_model(...), bucket_cap_mb=...)
    model = rt.ddp(
        build_model(args.hidden, args.layers, args.norm), bucket_cap_mb=args.bucket_cap_mb
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    pos = {"batch": 0}
    rt.register(
        model=model,
        optimizer=opt,
        data=(lambda: dict(pos), lambda p: pos.update(p)),
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
    )
    loss = torch.zeros(())
    for step in rt.steps(args.steps):
        with step:
            with step.phase("forward"):
                if args.accum > 1:
                    opt.zero_grad(set_to_none=not args.keep_grads)
                    for _ in range(args.accum - 1):  # gradients accumulate locally, no all-reduce
                        with model.no_sync():
                            x, y = make_batch(args.seed, pos["batch"], rt.rank, args.batch)
                            pos["batch"] += 1
                            torch.nn.functional.mse_loss(model(x), y).backward()
                x, y = make_batch(args.seed, pos["batch"], rt.rank, args.batch)
                pos["batch"] += 1
                loss = torch.nn.functional.mse_loss(model(x), y)
                if args.pause and args.pause[:2] == (rt.rank, step.index):
                    time.sleep(args.pause[2])
            with step.phase("backward"):
                if args.accum == 1:
                    opt.zero_grad(set_to_none=not args.keep_grads)
                loss.backward()  # bucket all-reduces overlap this, through the runtime
            with step.optimizer_update():
                opt.step()
    if args.out and (rt.rank == 0 or "{rank}" in args.out):
        save(args.out.format(rank=rt.rank), model.module, rt.committed_step, loss)
    print(
        f"rank {rt.rank}: done, last step {rt.committed_step}, loss {float(loss.detach()):.6f}",
        flush=True,
    )
    rt.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
