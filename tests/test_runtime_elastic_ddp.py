"""Live shrink and grow back under `rt.ddp` (issue 33 items 1-3 and 7; launcher.runtime.ddp):
4 real ranks train a stock DistributedDataParallel under `--recover-strategy elastic-training`;
rank 3 is killed inside DDP's backward with no spare taking its place: the survivors keep their
processes, DDP is re-pointed at the world of 3 (its gradients averaged over the original 4
through the runtime's comm hook, the lost replica's micro-batch computed by rank 0 under
`no_sync()`), then rank 3's returning process receives its replica's state and the world grows
back to 4 (DDP's own reducer again). Every micro-batch is consumed exactly once and the
parameters match the one-process reference within a measured bound."""

from __future__ import annotations

import importlib.util
import json
import subprocess

import torch
from helpers_launch import FTRUN, env_with, events, script

KILL_STEP = 3
STEPS = 30
# measured: the largest difference from the one-process reference (float summation order:
# DDP's buckets, micro-batches 0 and 3 summed on rank 0 while shrunk) was 1.5e-8..6e-8; the
# bound leaves room for that, not for a lost or repeated micro-batch (1e-3 and more)
TOLERANCE = 1e-6


def _reference(steps: int, n: int) -> dict[str, torch.Tensor]:
    spec = importlib.util.spec_from_file_location("elastic_loop", script("elastic_loop.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reference(steps, n)


def _records(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_rt_ddp_shrinks_live_and_grows_back(tmp_path) -> None:
    plan = [{"rank": 3, "step": KILL_STEP, "phase": "backward", "kind": "kill"}]
    cmd = FTRUN + [
        "--nproc_per_node",
        "4",
        "--max_restarts",
        "3",
        "--recover-strategy",
        "elastic-training",
        "--log_dir",
        str(tmp_path / "logs"),
        script("elastic_loop.py"),
        "--mode",
        "ddp",
        "--steps",
        str(STEPS),
        "--step-time",
        "0.02",
        "--shrunk-step-time",
        "0.2",
        "--consumed",
        str(tmp_path / "consumed{rank}.jsonl"),
        "--out",
        str(tmp_path / "params.pt"),
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
        ("world-shrink", 4, 3),
        ("world-grow", 3, 4),
    ]
    spawns = [e for e in ev if e["event"] == "spawn"]
    first = {e["rank"]: e["pid"] for e in spawns[:4]}
    assert sorted(first) == [0, 1, 2, 3] and {e["rank"] for e in spawns[4:]} == {3}
    records = {r: _records(tmp_path / f"consumed{r}.jsonl") for r in range(4)}
    for r in range(3):  # the survivors kept their processes and were resized twice
        assert {x["pid"] for x in records[r]} == {first[r]}
        assert [x["resize"] for x in records[r] if "resize" in x] == [[4, 3], [3, 4]]
    back = [x for x in records[3] if "step" in x and x["pid"] != first[3]]
    assert back, "the returning rank 3 computed no step"
    joined = back[0]["step"]
    assert KILL_STEP < joined < STEPS
    replica = next(x for x in records[0] if x.get("step") == joined)
    assert back[0]["state"] == replica["state"]  # its replica's state, bit for bit
    consumed: dict[int, list[int]] = {}
    for x in (x for r in range(4) for x in records[r] if "step" in x):
        consumed.setdefault(x["step"], []).extend(x["micro"])
        size = 4 if x["step"] < KILL_STEP or x["step"] >= joined else 3
        assert (x["world"], x["dp"]) == (size, size), x
    assert {s: sorted(m) for s, m in consumed.items()} == {s: [0, 1, 2, 3] for s in range(STEPS)}
    assert "DDP's gradients all-reduce through the runtime's comm hook, averaged over 4" in out
    got = torch.load(tmp_path / "params.pt", weights_only=True)
    ref = _reference(STEPS, 4)
    worst = max((got[k] - ref[k]).abs().max().item() for k in ref)
    assert worst <= TOLERANCE, f"largest difference from the reference: {worst:.3g}"
    print(
        f"rt.ddp: rank 3 back at step {joined}, grow cost {changes[1]['cost_s']:.3f} s; largest "
        f"parameter difference from the reference: {worst:.3g}"
    )
