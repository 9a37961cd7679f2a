"""Test worker: a tiny data-parallel loop that owns its loop and process group, made fault
tolerant only through launcher.runtime.callbacks (try/except style, no hooks.run).

Each rank appends every callback it receives ({"cb", "arg", "pid", "generation"}) to
--events with '{rank}' replaced, and writes its final parameters to --out. Each step computes
the rank's micro-batches (`hooks.micro_batches`: [rank] until a live shrink; micro-batch j of a
step is seeded by the data position and j) and divides the gradient sum by the job's world size.
`--elastic` registers `resize` too: the loop then shrinks and grows live (its rebuild_groups
builds its group over the current world).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from launcher.runtime import callbacks as ftcb


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", required=True)
    ap.add_argument("--events", required=True)
    ap.add_argument("--step-time", type=float, default=0.0, help="seconds of sleep per step")
    ap.add_argument("--elastic", action="store_true", help="register resize (live shrink)")
    args = ap.parse_args()

    hooks = ftcb.attach(backend="gloo")
    world = hooks.world_size
    group: list = [dist.new_group(list(range(world)))]  # the framework's own data-parallel group
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    pos = {"batch": 0}
    log = open(args.events.format(rank=hooks.rank), "a", encoding="utf-8")

    def note(cb: str, arg: object = None) -> None:
        log.write(
            json.dumps({"cb": cb, "arg": arg, "pid": os.getpid(), "generation": hooks.generation})
            + "\n"
        )
        log.flush()

    def rebuild(generation: int) -> None:
        group[0] = dist.new_group(list(range(hooks.world_size)))  # the current world
        note("rebuild_groups", generation)

    hooks.register(
        ftcb.FrameworkCallbacks(
            stop=lambda reason: note("stop"),
            clean=lambda: note("clean"),
            rebuild_groups=rebuild,
            rollback=lambda s: note("rollback", s),
            commit=lambda s: note("commit", s),
            resize=(lambda old, new: note("resize", [old, new])) if args.elastic else None,
        ),
        model=model,
        optimizer=opt,
        data=(lambda: dict(pos), lambda p: pos.update(p)),
    )
    step = hooks.start()
    while step < args.steps:
        try:
            hooks.step_start(step)
            hooks.phase("forward")
            time.sleep(args.step_time)
            for j in hooks.micro_batches:
                g = torch.Generator().manual_seed(1000 * pos["batch"] + j)
                x = torch.randn(16, 8, generator=g)
                loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
                hooks.phase("backward")
                loss.backward()
            pos["batch"] += 1
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group[0])
                p.grad.div_(world)
            hooks.optimizer_update_start()
            opt.step()
            opt.zero_grad(set_to_none=True)
            hooks.optimizer_update_end()
            hooks.step_end()
            step += 1
        except Exception as exc:  # noqa: BLE001 - recover() re-raises what it cannot handle
            step = hooks.recover(exc)
    path = args.out.format(rank=hooks.rank)
    torch.save({"params": {k: v.clone() for k, v in model.state_dict().items()}}, path + ".tmp")
    os.replace(path + ".tmp", path)
    log.close()
    hooks.finish()


if __name__ == "__main__":
    main()
