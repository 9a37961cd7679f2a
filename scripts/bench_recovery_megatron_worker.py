"""Benchmark worker for scripts/bench_recovery.py: megatron-core GPT through framework callbacks.

The framework-callbacks path of the recovery benchmark: the loop of
scripts/examples/megatron_train.py (TP=2 x DP=2 on 4 ranks, megatron's own parallel_state
groups, a torch Adam, gradients all-reduced over megatron's data-parallel group) reporting step
start, phases and the optimizer-update window to `launcher.runtime.callbacks`. About 170 MB of
parameters + Adam state per rank with --hidden 1088 --layers 2. Writes the same records as
bench_recovery_worker.py ($OUT_DIR/steps.<rank>.jsonl per completed step, starts.<rank>.jsonl when
this process begins its first step; each step line carries "phases": seconds of its forward,
backward, gradient all-reduce and optimizer update) and, through the runtime, a durable
checkpoint every --checkpoint-every steps, so the same script runs under ftrun (process-level
recovery) and under torchrun (restart-all from the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

# installed packages first, as a Megatron script's leading imports: ftrun's fork server imports
# them once for the node before it forks the ranks and the spares (launcher.workers.job_imports)
import torch
from megatron.core import parallel_state

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(1, HERE)  # scripts/, also in a spare
sys.path.insert(0, os.path.join(HERE, "examples"))

import megatron_train as mt  # noqa: E402  (scripts/examples: the example's CPU model and groups)
from bench_torchrun_group import init_attempt_group  # noqa: E402

from launcher.runtime import callbacks as ftcb  # noqa: E402
from launcher.runtime.megatron import rebuild_parallel_state  # noqa: E402


def mark(step: int) -> dict:
    return {"step": step, "time": time.time(), "pid": os.getpid()}


def lap(phases: dict, name: str, since: float) -> float:
    """Seconds of one part of the step into `phases` (the bench's first-step split)."""
    now = time.perf_counter()
    phases[name] = round(now - since, 5)
    return now


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=1088)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--checkpoint-dir", required=True)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--step-time", type=float, default=0.0, help="sleep per step (slow steps)")
    return ap.parse_args(argv)


def train(
    a: argparse.Namespace, hooks: Any, model: Any, opt: Any, sched: Any, pos: dict, start: int
) -> None:
    """The framework's own loop from `start`; one record per completed step."""
    out = os.environ["OUT_DIR"]
    dp_rank = parallel_state.get_data_parallel_rank()
    mask = torch.triu(torch.ones(mt.SEQ, mt.SEQ, dtype=torch.bool), 1).view(1, 1, mt.SEQ, mt.SEQ)
    positions = torch.arange(mt.SEQ).unsqueeze(0).expand(a.batch, -1)
    with open(os.path.join(out, f"steps.{hooks.rank}.jsonl"), "a", buffering=1) as log:
        for step in range(start, a.steps):
            if not pos.get("started"):  # this process trains (again): its first step begins
                pos["started"] = True
                with open(os.path.join(out, f"starts.{hooks.rank}.jsonl"), "a") as f:
                    f.write(json.dumps(mark(step)) + "\n")
            hooks.step_start(step)
            hooks.phase("forward")
            phases, t = {}, time.perf_counter()
            g = torch.Generator().manual_seed(a.seed * 7919 + pos["batch"] * 31 + dp_rank)
            pos["batch"] += 1
            tokens = torch.randint(0, mt.VOCAB, (a.batch, mt.SEQ), generator=g)
            loss = model(tokens, positions, mask, labels=torch.roll(tokens, -1, dims=1)).mean()
            if a.step_time:
                time.sleep(a.step_time)
            t = lap(phases, "forward", t)
            hooks.phase("backward")
            loss.backward()
            t = lap(phases, "backward", t)
            mt.allreduce_gradients(model)
            t = lap(phases, "allreduce", t)
            hooks.optimizer_update_start()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            hooks.optimizer_update_end()
            lap(phases, "optimizer", t)
            hooks.step_end()
            log.write(json.dumps({**mark(step), "phases": phases}) + "\n")


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    init_attempt_group()  # plain torchrun only: a restart-all's group on a fresh store prefix
    hooks = ftcb.attach(backend="gloo")  # before megatron builds its groups
    if hooks.world_size != 2 * mt.TP:
        raise SystemExit(f"needs WORLD_SIZE=4 (TP=2 x DP=2), got {hooks.world_size}")
    mt.init_parallel_state(shared=True)
    model = mt.build_model(a, init=not hooks.receives_state)  # a replacement: values arrive
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    pos: dict = {"batch": 0}

    def rebuild_groups(generation: int) -> None:
        rebuild_parallel_state(
            model,
            tensor_model_parallel_size=mt.TP,
            distributed_timeout_minutes=mt.GROUP_TIMEOUT_MIN,
        )
        parallel_state._GLOBAL_MEMORY_BUFFER = mt.CpuMemoryBuffer()

    hooks.set_layout(dp=2, tp=mt.TP)  # replicas: [0, 2] and [1, 3]
    hooks.register(
        ftcb.FrameworkCallbacks(
            clean=lambda: opt.zero_grad(set_to_none=True), rebuild_groups=rebuild_groups
        ),
        model=model,
        optimizer=opt,
        scheduler=sched,
        data=(lambda: {"batch": pos["batch"]}, lambda p: pos.update(batch=p["batch"])),
        checkpoint_dir=a.checkpoint_dir,
        checkpoint_every=a.checkpoint_every,
    )
    hooks.run(lambda start: train(a, hooks, model, opt, sched, pos, start))
    hooks.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
