"""Live shrink and grow back through the framework callbacks (launcher.runtime.callbacks, issue
33 item 7): tests/scripts/callbacks_loop.py --elastic owns its loop and its process group; rank 1
of 2 is killed with no spare taking its place: rank 0 keeps its process, its `rebuild_groups`
builds the group over a world of 1, `resize(2, 1)` follows, and it computes both micro-batches of
each step; rank 1's returning process receives rank 0's state and `resize(1, 2)` restores the
world. The parameters match the one-process reference within a measured bound."""

from __future__ import annotations

import torch
from helpers_elastic import first_pids, records, run_killed, shrank_and_grew
from helpers_launch import script

KILL_STEP = 3
STEPS = 40
# measured: 0 (two micro-batches' gradients added on one rank are the same sum as the
# all-reduce's); a lost or repeated micro-batch moves them by 1e-3 and more
TOLERANCE = 1e-6


def _reference(steps: int) -> dict[str, torch.Tensor]:
    """The loop's 2-rank training in one process: the mean of the two micro-batches' gradients."""
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        for j in range(2):
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 * step + j))
            torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)).backward()
        for p in model.parameters():
            p.grad.div_(2)
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_framework_callbacks_shrink_live_and_grow_back(tmp_path) -> None:
    args = [script("callbacks_loop.py"), "--elastic", "--steps", str(STEPS), "--step-time", "0.1"]
    args += ["--out", str(tmp_path / "out{rank}.pt"), "--events", str(tmp_path / "cb{rank}.jsonl")]
    _, ev = run_killed(tmp_path, 2, 1, KILL_STEP, args)
    shrank_and_grew(ev, 2, 1)
    first_pids(ev, 2, {1})  # rank 0 kept its process
    calls = records(tmp_path / "cb0.jsonl")
    assert len({c["pid"] for c in calls}) == 1
    # each resize follows the rebuild of the framework's group for the new world
    order = [(c["cb"], c["arg"]) for c in calls if c["cb"] in ("rebuild_groups", "resize")]
    assert order == [
        ("rebuild_groups", 1),
        ("resize", [2, 1]),
        ("rebuild_groups", 2),
        ("resize", [1, 2]),
    ]
    ref = _reference(STEPS)
    worst = 0.0
    for r in range(2):
        got = torch.load(tmp_path / f"out{r}.pt", weights_only=True)["params"]
        worst = max(worst, max((got[k] - ref[k]).abs().max().item() for k in ref))
    assert worst <= TOLERANCE, f"largest difference from the reference: {worst:.3g}"
    print(f"callbacks: 2 -> 1 -> 2 ranks, largest parameter difference {worst:.3g}")
