"""Test worker: a native loop (`rt.steps` + `rt.allreduce_gradients`) whose script imports a
slow module (`slow_import`: seconds in a replacement, nothing in a first start), so that a cold
replacement is still importing when a warm spare becomes ready. Writes the final parameters to
--out ('{rank}' for every rank)."""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import slow_import  # noqa: E402,F401
import torch  # noqa: E402

import launcher.runtime as ftr  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    ap.add_argument("--out", required=True)
    ap.add_argument("--stop-file", default="", help="every rank stops after the step that sees it")
    ap.add_argument("--buffer-mb", type=int, default=0, help="MB held besides the state")
    args = ap.parse_args()
    rt = ftr.init(backend="gloo")
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    buffer = torch.ones(args.buffer_mb << 18)  # e.g. DDP's gradient buckets: not state
    rt.register(model=model)  # a plain update below: torch.optim imports torch._dynamo (seconds)
    stop = torch.zeros(1)
    for step in rt.steps(args.steps):
        with step:
            with step.phase("forward"):
                if args.step_time:
                    time.sleep(args.step_time)
                if args.stop_file:  # all ranks stop at the same step
                    stop.fill_(float(os.path.exists(args.stop_file)))
                    rt.all_reduce(stop)
                g = torch.Generator().manual_seed(step.index * 31 + rt.rank)
                x = torch.randn(4, 8, generator=g)
                loss = (model(x) - x[:, :1]).pow(2).mean()
            with step.phase("backward"):
                model.zero_grad()
                loss.backward()
                rt.allreduce_gradients(model)
            with step.optimizer_update(), torch.no_grad():
                for p in model.parameters():
                    p -= 0.05 * p.grad
        if stop.item() > 0:
            break
    torch.save(model.state_dict(), args.out.replace("{rank}", str(rt.rank)))
    del buffer
    rt.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
