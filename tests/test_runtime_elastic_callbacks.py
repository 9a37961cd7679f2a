"""Live shrink and grow back through the framework callbacks (launcher.runtime.callbacks, issue
33 item 7): tests/scripts/callbacks_loop.py --elastic owns its loop and its process group; rank 1
of 2 is killed with no spare taking its place: rank 0 keeps its process, its `rebuild_groups`
builds the group over a world of 1, `resize(2, 1)` follows, and it computes both micro-batches of
each step; rank 1's returning process receives rank 0's state and `resize(1, 2)` restores the
world. The parameters match the one-process reference within a measured bound."""

from __future__ import annotations

import json
import subprocess

import torch
from helpers_launch import FTRUN, env_with, events, script

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


def _callbacks(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_framework_callbacks_shrink_live_and_grow_back(tmp_path) -> None:
    plan = [{"rank": 1, "step": KILL_STEP, "phase": "backward", "kind": "kill"}]
    cmd = FTRUN + [
        "--nproc_per_node",
        "2",
        "--max_restarts",
        "3",
        "--recover-strategy",
        "elastic-training",
        "--log_dir",
        str(tmp_path / "logs"),
        script("callbacks_loop.py"),
        "--elastic",
        "--steps",
        str(STEPS),
        "--step-time",
        "0.1",
        "--out",
        str(tmp_path / "out{rank}.pt"),
        "--events",
        str(tmp_path / "cb{rank}.jsonl"),
    ]
    res = subprocess.run(
        cmd,
        env=env_with(FTRUN_FAULT_PLAN=json.dumps(plan), FTRUN_STORE_TIMEOUT="60"),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=str(tmp_path),
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    ev = events(str(tmp_path / "logs"))
    assert [e["strategy"] for e in ev if e["event"] == "plan"] == [
        "elastic-training",
        "elastic-grow",
    ], [e for e in ev if e["event"] in ("fault", "plan", "repair-plan")]
    changes = [e for e in ev if e["event"] in ("world-shrink", "world-grow")]
    assert [(e["event"], e["world_size"], e["new_world_size"]) for e in changes] == [
        ("world-shrink", 2, 1),
        ("world-grow", 1, 2),
    ]
    spawns = [e for e in ev if e["event"] == "spawn"]
    assert {e["rank"] for e in spawns[2:]} == {1}  # rank 0 kept its process
    calls = _callbacks(tmp_path / "cb0.jsonl")
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
