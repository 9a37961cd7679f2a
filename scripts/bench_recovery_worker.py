"""Benchmark worker for scripts/bench_recovery.py: a data-parallel MLP on launcher.runtime.

About 100 MB of parameters + Adam state with the defaults (hidden 1024, 9 layers). Appends one
JSON line per completed step to $OUT_DIR/steps.<rank>.jsonl ({"step", "time", "pid"}) and one
when this process begins its first step to $OUT_DIR/starts.<rank>.jsonl ({"step", "time",
"pid"}: training again after a restart; the step lines also carry "phases": seconds of its
forward, backward, gradient all-reduce and optimizer step and the training thread's CPU seconds
in the step, `main_cpu`, the first step after a repair against the others'), saves a durable
checkpoint every --checkpoint-every steps (what torchrun's restart-all reloads), and runs under
ftrun (process-level recovery) and under torchrun (restart from the checkpoint). Two paths: the
native loop (`rt.steps` + `rt.allreduce_gradients`, the default) and `--ddp` (the model wrapped
by `rt.ddp`, whose bucket all-reduces overlap backward). `--micro-batches` (native loop): every
step consumes micro-batches 0..N-1 of the original world, this rank `rt.micro_batches` of them
(its own; after a live shrink, elastic-training, also the lost replicas'), each seeded by (step,
micro-batch) whoever computes it, gradients accumulated and averaged over N: the global batch
survives a shrink."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))  # scripts/, also in a spare

import torch  # noqa: E402
from bench_torchrun_group import init_attempt_group  # noqa: E402

import launcher.runtime as ftr  # noqa: E402


def mark(step: int) -> dict:
    return {"step": step, "time": time.time(), "pid": os.getpid()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--checkpoint-dir", required=True)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument(
        "--replica-groups", default="", help="JSON list of replica groups (default: all ranks)"
    )
    ap.add_argument("--ddp", action="store_true", help="wrap the model with rt.ddp")
    ap.add_argument(
        "--micro-batches",
        action="store_true",
        help="compute rt.micro_batches each step (the global batch kept through a live shrink)",
    )
    a = ap.parse_args()
    init_attempt_group()  # plain torchrun only: a restart-all's group on a fresh store prefix
    rt = ftr.init(backend="gloo")
    torch.manual_seed(7)
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, a.hidden), torch.nn.ReLU()]
    for _ in range(a.layers - 2):
        layers += [torch.nn.Linear(a.hidden, a.hidden), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(a.hidden, 1))
    model = torch.nn.Sequential(*layers)
    if a.ddp:
        model = rt.ddp(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    pos = {"batch": 0}
    if a.replica_groups:
        rt.set_replica_groups(json.loads(a.replica_groups))
    rt.register(
        model=model,
        optimizer=opt,
        data=(lambda: dict(pos), lambda p: pos.update(p)),
        checkpoint_dir=a.checkpoint_dir,
        checkpoint_every=a.checkpoint_every,
    )
    out = os.environ["OUT_DIR"]
    log = open(os.path.join(out, f"steps.{rt.rank}.jsonl"), "a", buffering=1)
    started = False
    for step in rt.steps(a.steps):
        if not started:  # this process trains (again): its first step begins
            started = True
            with open(os.path.join(out, f"starts.{rt.rank}.jsonl"), "a") as f:
                f.write(json.dumps(mark(step.index)) + "\n")
        if a.micro_batches:
            micro_step(rt, step, model, opt, list(rt.micro_batches), a.step_time)
        else:
            plain_step(rt, step, model, opt, pos, a)
        if not step.interrupted:
            log.write(json.dumps({**mark(step.index), "phases": PHASES}) + "\n")
    log.close()
    rt.finish()
    return 0


# seconds of the last step's parts (forward, backward, allreduce, optimizer), logged with it
PHASES: dict[str, float] = {}


class Clock:
    """Times the parts of one step into PHASES; `main_cpu`: the CPU time the training thread
    spent in the step so far (kernel time included: page faults show there, where the wall
    time of a part also holds waiting on the other ranks)."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.cpu = time.thread_time()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        PHASES[name] = round(now - self.t, 5)
        PHASES["main_cpu"] = round(time.thread_time() - self.cpu, 5)
        self.t = now


def micro_step(rt, step, model, opt, micro: list[int], step_time: float) -> None:
    """One step over this rank's micro-batches (read before the step: a shrink changes them)."""
    with step:
        with step.phase("forward"):
            opt.zero_grad(set_to_none=True)
            if step_time:
                time.sleep(step_time)
        clock = Clock()
        with step.phase("backward"):
            for j in micro:
                g = torch.Generator().manual_seed(step.index * 100 + j)
                x = torch.randn(8, 64, generator=g)
                model(x).pow(2).mean().backward()
            clock.lap("backward")
            rt.allreduce_gradients(model)  # averages over every micro-batch of the step
            clock.lap("allreduce")
        with step.optimizer_update():
            opt.step()
            clock.lap("optimizer")


def plain_step(rt, step, model, opt, pos: dict, a: argparse.Namespace) -> None:
    """One step of this rank's own batch (its data position: `pos`)."""
    with step:
        clock = Clock()
        with step.phase("forward"):
            g = torch.Generator().manual_seed(pos["batch"] * 100 + rt.rank)
            pos["batch"] += 1
            x = torch.randn(8, 64, generator=g)
            loss = model(x).pow(2).mean()
            if a.step_time:
                time.sleep(a.step_time)
        clock.lap("forward")
        with step.phase("backward"):
            loss.backward()  # with rt.ddp: its bucket all-reduces too
            clock.lap("backward")
            if not a.ddp:
                rt.allreduce_gradients(model)
                clock.lap("allreduce")
        with step.optimizer_update():
            opt.step()
            clock.lap("optimizer")
            opt.zero_grad()


if __name__ == "__main__":
    sys.exit(main())
