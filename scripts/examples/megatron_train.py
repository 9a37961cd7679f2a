"""megatron-core GPT, TP=2 x DP=2 on 4 CPU ranks (gloo), fault tolerant through ftrun's
framework callbacks only.

The script owns its loop the way Megatron/MindSpeed do: it builds megatron's parallel_state
groups, a `GPTModel` (column/row-parallel layers, vocab-parallel embedding and cross entropy:
megatron's own tensor-parallel all-reduces), a torch optimizer, and all-reduces gradients over
`parallel_state.get_data_parallel_group()` itself. ftrun never drives the loop: the loop reports
step start, phases and the optimizer-update window to `launcher.runtime.callbacks`, hands
exceptions to `hooks.recover(exc)`, and ftrun calls it back to clean, rebuild megatron's groups
for the new generation and roll back or commit. Replicas (ranks r and r+2) share seeds and the
data position; final parameters are bit-identical to a fault-free run.

Elastic training (`--recover-strategy elastic-training`): a lost rank's whole data-parallel
replica leaves (TP=2 x DP=2 -> TP=2 x DP=1), the survivors rebuild megatron's groups for the
smaller world (`rebuild_groups`: the same call, parallel_state derives DP=1 from the world
size), hear `resize(4, 2)`, and compute the lost replica's micro-batches too
(`hooks.micro_batches`; micro-batch j of a step is the same tokens whoever computes it; the
gradient average divides by the original DP=2); the grow back restores DP=2.

    ftrun --nproc_per_node 4 scripts/examples/megatron_train.py --steps 8 --out /tmp/p{rank}.pt
    torchrun --nproc_per_node 4 scripts/examples/megatron_train.py --no-ftrun   # no callbacks

CPU workarounds for megatron-core 0.16.1 (CUDA is assumed in a few places): the CUDA RNG
tracker is replaced by the inference tracker, parallel_state's global memory buffer by a CPU
one, and the causal attention mask is passed explicitly; sequence parallel stays off.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

# installed packages first: ftrun's fork server imports a script's leading imports once for the
# node, before it forks the ranks and the spares (a replacement at step 1 finds them imported)
import torch
import torch.distributed as dist
from megatron.core import parallel_state

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

TP = 2
DP = 2  # data-parallel replicas of the job (the micro-batches of every step)
# megatron's group timeout (default 30 min) also bounds creating a group while a rank died during
# a recovery round; keep it short so such a round fails over to the next one quickly.
GROUP_TIMEOUT_MIN = 2
VOCAB = 128
SEQ = 16


class CpuMemoryBuffer:
    """parallel_state's global memory buffer, on the CPU (megatron's allocates on CUDA)."""

    def get_tensor(
        self, shape: Any, dtype: torch.dtype, name: str, mem_alloc_context: Any = None
    ) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype)


def init_parallel_state(shared: bool = False) -> None:
    """megatron's groups; `shared` (under ftrun): through ftrun's initialize_model_parallel,
    which creates each distinct group once, and so does the rebuild of every recovery round."""
    init = parallel_state.initialize_model_parallel
    if shared:
        from launcher.runtime.megatron import initialize_model_parallel as init
    init(tensor_model_parallel_size=TP, distributed_timeout_minutes=GROUP_TIMEOUT_MIN)
    parallel_state._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()


def build_model(args: argparse.Namespace, init: bool = True) -> GPTModel:
    """The GPT model; `init=False` (a replacement, `hooks.receives_state`): megatron leaves
    the parameters uninitialised (their values arrive from a replica before the first step),
    which spares a replacement the random fills of full master weights on its critical path."""
    torch.manual_seed(
        args.seed
    )  # same on every rank: CPU init splits one master weight per TP rank
    model_parallel_cuda_manual_seed(args.seed, inference_rng_tracker=True)
    cfg = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=4,
        use_cpu_initialization=True,
        perform_initialization=init,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
    )
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)


class NoHooks:
    """--no-ftrun: the same loop with every hook a no-op (baseline under torchrun)."""

    def step_start(self, step: int) -> None: ...
    def phase(self, name: str) -> None: ...
    def optimizer_update_start(self) -> None: ...
    def optimizer_update_end(self) -> None: ...
    def step_end(self) -> None: ...

    micro_batches = property(lambda self: [parallel_state.get_data_parallel_rank()])


def allreduce_gradients(model: torch.nn.Module) -> None:
    """Megatron-style data-parallel gradient average over parallel_state's DP group; the sum
    divides by the job's DP size (DP), the number of micro-batches of every step, also while a
    live shrink leaves fewer replicas (each computing several micro-batches)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat, group=parallel_state.get_data_parallel_group())
    flat.div_(DP)
    off = 0
    for g in grads:
        g.copy_(flat[off : off + g.numel()].view_as(g))
        off += g.numel()


def train(
    args: argparse.Namespace,
    hooks: Any,
    model: GPTModel,
    opt: torch.optim.Optimizer,
    sched: Any,
    pos: dict,
    start: int,
    times: list[float],
) -> None:
    """The framework's own loop, from `start` to args.steps."""
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).view(1, 1, SEQ, SEQ)
    positions = torch.arange(SEQ).unsqueeze(0).expand(args.batch, -1)
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        hooks.step_start(step)
        time.sleep(args.step_time)
        for j in hooks.micro_batches:  # [the DP rank] until a live shrink
            hooks.phase("forward")
            g = torch.Generator().manual_seed(args.seed * 7919 + pos["batch"] * 31 + j)
            tokens = torch.randint(0, VOCAB, (args.batch, SEQ), generator=g)
            labels = torch.roll(tokens, -1, dims=1)
            loss = model(tokens, positions, mask, labels=labels).mean()
            hooks.phase("backward")
            loss.backward()
        pos["batch"] += 1
        allreduce_gradients(model)
        hooks.optimizer_update_start()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        hooks.optimizer_update_end()
        hooks.step_end()
        times.append(time.perf_counter() - t0)


def write_outputs(args: argparse.Namespace, rank: int, model: GPTModel, times: list[float]) -> None:
    if args.out:
        path = args.out.format(rank=rank)
        tmp = f"{path}.tmp{os.getpid()}"
        params = {
            k: v.detach().clone()
            for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor)
        }
        torch.save({"params": params}, tmp)
        os.replace(tmp, path)
    if args.report and rank == 0:
        tmp = f"{args.report}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "steps": len(times),
                    "step_s": times,
                    "median_step_s": statistics.median(times[args.warmup :] or times),
                },
                f,
            )
        os.replace(tmp, args.report)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument(
        "--out", default=None, help="final parameters; '{rank}' is replaced by the rank"
    )
    ap.add_argument("--report", default=None, help="rank 0 writes its step times here (JSON)")
    ap.add_argument("--step-time", type=float, default=0.0, help="seconds of sleep per step")
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the median step time")
    ap.add_argument(
        "--no-ftrun", action="store_true", help="plain loop without callbacks (torchrun)"
    )
    args = ap.parse_args(argv)
    times: list[float] = []

    if args.no_ftrun:
        dist.init_process_group("gloo")
        init_parallel_state()
        model = build_model(args)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        train(args, NoHooks(), model, opt, sched, {"batch": 0}, 0, times)
        write_outputs(args, dist.get_rank(), model, times)
        dist.destroy_process_group()
        return 0

    from launcher.runtime import callbacks as ftcb
    from launcher.runtime.megatron import rebuild_parallel_state

    hooks = ftcb.attach(
        backend="gloo"
    )  # joins the job; megatron's collectives become interruptible
    if hooks.world_size != 2 * TP:
        raise SystemExit(
            f"megatron_train.py needs WORLD_SIZE=4 (TP=2 x DP=2), got {hooks.world_size}"
        )
    init_parallel_state(shared=True)
    model = build_model(args, init=not hooks.receives_state)
    if hooks.receives_state:
        print(f"rank {hooks.rank}: model built without random init (a replica's state arrives)")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    pos = {"batch": 0}

    def rebuild_groups(generation: int) -> None:
        n = rebuild_parallel_state(
            model, tensor_model_parallel_size=TP, distributed_timeout_minutes=GROUP_TIMEOUT_MIN
        )
        parallel_state._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()
        print(
            f"rank {hooks.rank}: megatron groups rebuilt for generation {generation} "
            f"({n} cached handles re-pointed)",
            flush=True,
        )

    hooks.set_layout(dp=2, tp=TP)  # replicas: [0, 2] and [1, 3]
    hooks.register(
        ftcb.FrameworkCallbacks(
            stop=lambda reason: print(f"rank {hooks.rank}: stop ({reason})", flush=True),
            clean=lambda: opt.zero_grad(set_to_none=True),
            rebuild_groups=rebuild_groups,
            rollback=lambda step: print(f"rank {hooks.rank}: roll back to step {step}", flush=True),
            commit=lambda step: print(f"rank {hooks.rank}: continue at step {step}", flush=True),
            resize=lambda old, new: print(
                f"rank {hooks.rank}: world {old} -> {new} ranks, DP "
                f"{parallel_state.get_data_parallel_world_size()}, micro-batches "
                f"{hooks.micro_batches}",
                flush=True,
            ),
        ),
        model=model,
        optimizer=opt,
        scheduler=sched,
        data=(lambda: dict(pos), lambda p: pos.update(p)),
    )
    hooks.run(lambda start: train(args, hooks, model, opt, sched, pos, start, times))
    write_outputs(args, hooks.rank, model, times)
    print(f"rank {hooks.rank}: done, last step {hooks.committed_step}", flush=True)
    hooks.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
