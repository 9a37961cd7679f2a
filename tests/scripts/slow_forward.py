"""A training loop whose forward is slow (40 modules of 50 ms), native (`rt.allreduce_gradients`)
or, with `--ddp`, under `rt.ddp`: rank 1 SIGKILLs itself early in step 1's forward (`--ddp`:
step 2's, after DDP's bucket rebuild in step 1's forward, which waits for every rank), the first
time only; every rank logs each module call ($OUT_DIR/calls.<rank>.jsonl: step, generation,
time) so a test sees where a survivor's forward stopped, and its final parameters
($OUT_DIR/params.<rank>.pt). Every rank trains on the same input, so the result
equals `train_alone` (one process, the same steps, no launcher)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

import launcher.runtime as ftr

MODULES = 40
MODULE_S = 0.05


class Slow(torch.nn.Module):
    def __init__(self, log) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log()
        time.sleep(MODULE_S)
        return torch.tanh(self.lin(x))


def build(log) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Slow(log) for _ in range(MODULES)))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train_alone(steps: int) -> dict[str, torch.Tensor]:
    """The fault-free result without sleeps (the averaged gradients of equal inputs are the
    gradients of one)."""
    global MODULE_S
    MODULE_S, was = 0.0, MODULE_S
    try:
        model, opt = build(lambda: None)
        for _ in range(steps):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        return model.state_dict()
    finally:
        MODULE_S = was


def kill_step(ddp: bool) -> int:
    return 2 if ddp else 1


def main() -> int:
    rt = ftr.init(backend="gloo")
    out = open(os.path.join(os.environ["OUT_DIR"], f"calls.{rt.rank}.jsonl"), "a", buffering=1)
    where = {"step": -1}

    def log() -> None:
        rec = {"step": where["step"], "generation": rt.generation, "time": time.time()}
        out.write(json.dumps(rec) + "\n")

    model, opt = build(log)
    ddp = "--ddp" in sys.argv[1:]
    net = rt.ddp(model) if ddp else model
    rt.register(model=net, optimizer=opt)
    for step in rt.steps(3):
        with step:
            where["step"] = step.index
            with step.phase("forward"):
                if step.index == kill_step(ddp) and rt.rank == 1 and not rt.replacement:
                    time.sleep(0.3)  # rank 0 is a few modules into its forward
                    os.kill(os.getpid(), signal.SIGKILL)
                loss = net(torch.ones(2, 4)).sum()
            with step.phase("backward"):
                loss.backward()
                if not ddp:
                    rt.allreduce_gradients(model)
            with step.optimizer_update():
                opt.step()
                opt.zero_grad()
    out.close()
    path = os.path.join(os.environ["OUT_DIR"], f"params.{rt.rank}.pt")
    torch.save(model.state_dict(), f"{path}.tmp")
    os.replace(f"{path}.tmp", path)
    rt.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
