"""Test worker: a tiny launcher.runtime job in which --victim dies after its peers finished.

Every rank trains --steps steps (checkpoints every 2 under --ckpt), writes $OUT_DIR/pid.<RANK>,
calls rt.finish() and exits 0. In generation 0 the victim, after its last step, waits until its
peers are done (--after exited: their processes are gone; --after goodbye: they wrote
$OUT_DIR/bye.<RANK> after their rt.finish() and linger --linger s before exiting), then dies
(--how abort: SIGABRT as from a C++ `terminate`; --how kill: SIGKILL): before its own
rt.finish() (--when before-goodbye: a fault, the job is not done) or after it (--when
after-goodbye: a crash in its interpreter's teardown, as torch 2.13's gloo teardown sometimes
does; its work was done). In later generations it finishes like the others."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import torch  # noqa: E402

import launcher.runtime as ftr  # noqa: E402


def gone(pid: int) -> bool:
    """Exited and reaped by its agent (a zombie is not gone yet: its exit is not seen yet)."""
    return not os.path.exists(f"/proc/{pid}")


def train(rt: ftr.Runtime, steps: int, rank: int, **register: object) -> None:
    """A tiny linear model trained `steps` steps in the runtime's loop (`register`: more
    arguments of rt.register, e.g. checkpoints)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rt.register(model=model, optimizer=opt, **register)
    for step in rt.steps(steps):
        with step:
            with step.phase("forward"):
                g = torch.Generator().manual_seed(step.index * 100 + rank)
                loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
            with step.phase("backward"):
                loss.backward()
                rt.allreduce_gradients(model)
            with step.optimizer_update():
                opt.step()
                opt.zero_grad()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--victim", type=int, default=1)
    ap.add_argument("--after", choices=("exited", "goodbye"), default="exited")
    ap.add_argument("--how", choices=("abort", "kill"), default="abort")
    ap.add_argument("--linger", type=float, default=3.0)
    ap.add_argument("--when", choices=("before-goodbye", "after-goodbye"), default="before-goodbye")
    ap.add_argument("--ckpt", required=True)
    a = ap.parse_args()
    out = os.environ["OUT_DIR"]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    generation = int(os.environ.get("FTRUN_GENERATION", "0"))
    rt = ftr.init(backend="gloo")
    train(rt, a.steps, rank, checkpoint_dir=a.ckpt, checkpoint_every=2)
    with open(os.path.join(out, f"pid.{rank}"), "w", encoding="utf-8") as f:
        f.write(str(os.getpid()))
    victim = rank == a.victim and generation == 0
    if not victim or a.when == "after-goodbye":
        rt.finish()
    if not victim:
        if a.after == "goodbye":
            with open(os.path.join(out, f"bye.{rank}"), "w", encoding="utf-8") as f:
                f.write("1")
            if generation == 0:
                time.sleep(a.linger)
        print(f"rank {rank}: done in generation {generation}", flush=True)
        return 0
    peers = [r for r in range(world) if r != rank]
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        if a.after == "goodbye":
            if all(os.path.exists(os.path.join(out, f"bye.{r}")) for r in peers):
                break
        else:
            pids = {}
            for r in peers:
                try:
                    with open(os.path.join(out, f"pid.{r}"), encoding="utf-8") as f:
                        pids[r] = int(f.read())
                except (OSError, ValueError):
                    pass
            if len(pids) == len(peers) and all(gone(p) for p in pids.values()):
                break
        time.sleep(0.02)
    else:
        print(f"rank {rank}: peers {peers} not done within 60 s", file=sys.stderr, flush=True)
        return 3
    print(
        f"rank {rank}: peers {peers} are done ({a.after}); dying by {a.how} ({a.when})",
        file=sys.stderr,
        flush=True,
    )
    if a.how == "abort":
        os.abort()
    os.kill(os.getpid(), signal.SIGKILL)
    return 4


if __name__ == "__main__":
    sys.exit(main())
