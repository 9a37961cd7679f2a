"""Test worker: a data-parallel loop that keeps its global batch through a live shrink
(elastic-training, launcher.runtime.elastic).

Every step consumes micro-batches 0..N-1 (N: the job's original world size); micro-batch j of
step s is seeded by (s, j), whoever computes it. Each rank computes `rt.micro_batches` (its own,
plus a lost replica's after a shrink), accumulating gradients, then `rt.allreduce_gradients`
averages over the N micro-batches. After each committed step the rank appends {"step", "micro",
"rank", "pid", "world", "dp", "state"} to --consumed ('{rank}' replaced; "state": a digest of
the model and optimizer state at the start of the step); a resize callback appends
{"resize": [old, new], "pid"}. `--mode ddp` trains through `rt.ddp` instead (the micro-batches
accumulated under `no_sync()` but the last, whose backward DDP all-reduces); `--mode layout`
makes a DP=N/2 x TP=2 grid (`rt.set_layout`): the two tensor-parallel ranks of a data-parallel
replica hold different models (seeded 5 + tp index), gradients are averaged over the "dp" group
handle, and each step all-reduces the ranks' numbers over the "tp" handle (recorded as "tp" and
"tp_sum"); `--mode layout-ddp` is that grid training through `rt.ddp(model,
process_group=<the "dp" handle>)`. Rank 0 (or every rank with '{rank}' in --out) writes its
final parameters to --out.
`reference(steps, n, seed)` is the same training in one process.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import torch  # noqa: E402


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_003 * step + 17 * micro + 1)
    x = torch.randn(8, 16, generator=g)
    return x, x[:, :1] * 0.5 - x[:, 1:2]


def model_and_optimizer(seed: int = 5) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """The model's parameters and the optimizer's state, bit for bit."""
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
        buf = opt.state.get(p, {}).get("momentum_buffer")
        if buf is not None:
            h.update(buf.numpy().tobytes())
    return h.hexdigest()


def reference(steps: int, n: int, seed: int = 5) -> dict[str, torch.Tensor]:
    """The same training in one process: each step's gradient is the mean over its n
    micro-batches."""
    model, opt = model_and_optimizer(seed)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for j in range(n):
            x, y = batch(step, j)
            torch.nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():
            p.grad.div_(n)
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def main() -> None:
    import launcher.runtime as ftr

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--step-time", type=float, default=0.0)
    # a step's sleep while the world is smaller than at the start (the grow test: time for the
    # returning process to start before the job ends)
    ap.add_argument("--shrunk-step-time", type=float, default=None)
    ap.add_argument("--consumed", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=("native", "ddp", "layout", "layout-ddp"), default="native")
    args = ap.parse_args()

    rt = ftr.init(backend="gloo")
    full = int(os.environ.get("WORLD_SIZE", rt.world_size))  # the job's world size
    handles = rt.set_layout(dp=full // 2, tp=2) if args.mode.startswith("layout") else {}
    model, opt = model_and_optimizer(5 + rt.rank % 2 if handles else 5)
    log = open(args.consumed.format(rank=rt.rank), "a", encoding="utf-8")

    def note(**record: object) -> None:
        log.write(json.dumps(record) + "\n")
        log.flush()

    rt.on_resize = lambda old, new: note(resize=[old, new], pid=os.getpid())
    net = model
    if args.mode.endswith("ddp"):
        net = rt.ddp(model, process_group=handles.get("dp"))
    rt.register(model=net, optimizer=opt)
    for step in rt.steps(args.steps):
        micro = list(rt.micro_batches)
        at_start = digest(model, opt)
        with step:
            with step.phase("forward"):
                shrunk = args.shrunk_step_time is not None and rt.world_size < full
                time.sleep(args.shrunk_step_time if shrunk else args.step_time)
                opt.zero_grad(set_to_none=True)
            with step.phase("backward"):
                for i, j in enumerate(micro):
                    x, y = batch(step.index, j)
                    last = i == len(micro) - 1
                    # rt.ddp: DDP all-reduces in the backward of the last micro-batch only
                    quiet = (
                        net.no_sync() if net is not model and not last else contextlib.nullcontext()
                    )
                    with quiet:
                        torch.nn.functional.mse_loss(net(x), y).backward()
                if net is model:
                    rt.allreduce_gradients(model, group=handles.get("dp"))
                tp = _tp_sum(rt, handles)
            with step.optimizer_update():
                opt.step()
        if not step.interrupted:
            note(
                step=step.index,
                micro=micro,
                rank=rt.rank,
                pid=os.getpid(),
                world=rt.world_size,
                dp=rt.dp_size,
                state=at_start,
                **tp,
            )
    if rt.rank == 0 or "{rank}" in args.out:
        path = args.out.format(rank=rt.rank)
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, path + ".tmp")
        os.replace(path + ".tmp", path)
    log.close()
    rt.finish()


def _tp_sum(rt, handles: dict) -> dict:  # noqa: ANN001 - the runtime
    """The tensor-parallel group at work: the sum of its ranks' numbers, over its handle."""
    if "tp" not in handles:
        return {}
    t = torch.tensor([float(rt.rank)])
    rt.all_reduce(t, group=handles["tp"])
    return {"tp": list(handles["tp"].ranks), "tp_sum": t.item()}


if __name__ == "__main__":
    main()
