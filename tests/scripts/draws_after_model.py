"""Test worker: a native loop (`rt.steps` + `rt.allreduce_gradients`) whose script draws from
torch's default generator after building its model, as many scripts do.

After the model (with dropout) it draws its dataset from the default generator, outside the
registered state; every step draws its batch indices from the same generator, and dropout draws
its masks. A replacement that skipped its random init would draw another dataset, so it must run
its init. Deterministic: the same --seed gives bit-identical parameters, with or without faults.
Writes the final parameters to --out ('{rank}' for every rank)."""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import torch  # noqa: E402

import launcher.runtime as ftr  # noqa: E402

SAMPLES = 256


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rt = ftr.init(backend="gloo")
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
    )
    # drawn after the model, from the same generator: the dataset, outside the registered state
    inputs = torch.randn(SAMPLES, 16)
    targets = inputs[:, :1] * 0.5 - inputs[:, 1:2] + 0.1 * torch.randn(SAMPLES, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rt.register(model=model, optimizer=opt)
    for step in rt.steps(args.steps):
        with step:
            with step.phase("forward"):
                if args.step_time:
                    time.sleep(args.step_time)
                # every rank draws the whole step's indices (the generators stay in step) and
                # takes its own part
                idx = torch.randint(0, SAMPLES, (rt.world_size, args.batch))[rt.rank]
                loss = torch.nn.functional.mse_loss(model(inputs[idx]), targets[idx])
            with step.phase("backward"):
                loss.backward()
                rt.allreduce_gradients(model)
            with step.optimizer_update():
                opt.step()
                opt.zero_grad()
    if rt.rank == 0 or "{rank}" in args.out:
        path = args.out.format(rank=rt.rank)
        tmp = f"{path}.tmp{os.getpid()}"
        params = {k: v.clone() for k, v in model.state_dict().items()}
        torch.save({"params": params, "step": rt.committed_step}, tmp)
        os.replace(tmp, path)
    print(f"rank {rt.rank}: done, last step {rt.committed_step}", flush=True)
    rt.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
