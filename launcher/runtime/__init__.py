"""launcher.runtime: process-level recovery inside a training script.

Under `ftrun`, a script that uses this module survives the loss of a rank without restarting
the others: the agent restarts only the failed rank, every rank rebuilds its process groups
for the new generation, the replacement receives the full state (model, optimizer, LR
scheduler, RNG, data position, step, extra tensors) from a healthy replica, and everyone
resumes at the interrupted step (rolled back) or the next one (committed). The final
parameters are bit-identical to a fault-free run. Under plain `torchrun` (no
FTRUN_AGENT_SOCKET) the same script trains normally, without recovery.

Complete example (a plain data-parallel loop; ~10 lines differ from the torch original)::

    import torch, launcher.runtime as ftr

    rt = ftr.init(backend="gloo")                    # joins the job, builds the default group
    torch.manual_seed(0)                             # same seed on every replica
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    pos = {"batch": 0}                               # global data position (same on replicas)

    def batch():
        g = torch.Generator().manual_seed(1000 * pos["batch"] + rt.rank)
        pos["batch"] += 1
        return torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)

    rt.register(model=model, optimizer=opt, scheduler=sched,
                data=(lambda: dict(pos), lambda p: pos.update(p)),
                checkpoint_dir="ckpt", checkpoint_every=10)   # optional durable checkpoints
    # rt.set_layout(dp=2, tp=2)  or  rt.set_replica_groups([[0, 2], [1, 3]])  for model parallel
    for step in rt.steps(100):                       # recovery happens inside this iterator
        with step:                                   # step start: RNG/data snapshot;
                                                     # stops land here
            with step.phase("forward"):
                x, y = batch()
                loss = torch.nn.functional.mse_loss(model(x), y)
            with step.phase("backward"):
                loss.backward()
                rt.allreduce_gradients(model)        # waits for the bucket all-reduces
                                                     # that backward started
            with step.optimizer_update():            # completing it commits the step
                opt.step(); sched.step(); opt.zero_grad()
    rt.finish()                                      # call last: may os._exit after a recovery

A stock torch DDP loop works too: `model = rt.ddp(module, **ddp_kwargs)` in place of
`DistributedDataParallel(module, **ddp_kwargs)` (no `rt.allreduce_gradients`), inside the same
step loop; DDP's collectives then go through the runtime (see launcher.runtime.ddp).

Rules the script keeps:
- every collective goes through the runtime (`rt.all_reduce`, `rt.broadcast`, `rt.all_gather`,
  `rt.barrier`, `rt.allreduce_gradients`) so a stop can interrupt it; every process group is made
  with `rt.new_group(name, ranks)` / `rt.set_layout(...)` and used through its handle's `.group`;
- replicas (same shard) use the same seeds and the same global data position (Megatron
  convention); the data getter/setter captures the position, the runtime captures the RNGs;
- nothing after `optimizer_update()` inside a step consumes RNG or data, and each step has at
  most one optimizer update (a step without one commits when it ends);
- state a step changes outside the optimizer update is either a model buffer or a registered
  `extra` tensor (both restored on rollback) or reset by `register(on_rollback=fn)`;
- `rt.finish()` is the last call.

Public API: `init`, `Runtime` (register, set_layout, set_replica_groups, new_group, group,
steps, all_reduce, broadcast, all_gather, barrier, allreduce_gradients, ddp, report_fault,
save_checkpoint, load_checkpoint, finish), `Step` (phase, optimizer_update), `StopRequested`,
`GroupHandle`, `Layout`, `RuntimeOptions`, `EXIT_FALLBACK`.
"""

from __future__ import annotations

from launcher.protocol.plan import EXIT_FALLBACK
from launcher.runtime.groups import GroupHandle
from launcher.runtime.rank_state import RuntimeOptions
from launcher.runtime.replicas import Layout
from launcher.runtime.runtime import Runtime, init
from launcher.runtime.signals import StopRequested
from launcher.runtime.step_path import Step

__all__ = [
    "EXIT_FALLBACK",
    "GroupHandle",
    "Layout",
    "Runtime",
    "RuntimeOptions",
    "Step",
    "StopRequested",
    "init",
]
