"""Stop points: a pending stop ends a step's forward or backward at the next module call or
gradient of the registered models (launcher.runtime.stop_points)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers_launch import FTRUN, env_with, events, script

from launcher.runtime.rank_state import RankState
from launcher.runtime.replicas import Layout
from launcher.runtime.signals import StopRequested, StopSignal
from launcher.runtime.stop_points import MAX_POINTS, MIN_STEP_S, StopPoints, spread


class Counting(torch.nn.Module):
    """Three layers; counts the forwards that ran past each."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        self.ran = 0

    def forward(self, x: torch.Tensor, stop_after: int = -1, stop: StopSignal | None = None):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            self.ran += 1
            if i == stop_after and stop is not None:
                stop.request(1)  # the agent's stop arrives mid-forward
        return x


def _setup(phase: str = "forward", enabled: bool = True):
    torch.manual_seed(0)
    stop, state = StopSignal(), RankState(0, False, Layout.ddp(1))
    state.phase = phase
    points = StopPoints(stop, state, enabled)
    model = Counting()
    return stop, state, points, model


def test_a_stop_mid_forward_ends_it_at_the_next_module() -> None:
    stop, _, points, model = _setup()
    assert points.install([model]) == 5 + 6  # 5 modules, 6 parameters
    with pytest.raises(StopRequested) as caught:
        model(torch.ones(2, 4), stop_after=0, stop=stop)
    assert model.ran == 1 and caught.value.generation == 1
    assert "forward of Linear" in str(caught.value)


def test_a_stop_mid_backward_ends_it_at_the_next_gradient() -> None:
    stop, _, points, model = _setup(phase="backward")
    points.install([model])
    loss = model(torch.ones(2, 4)).sum()
    seen: list[int] = []

    def stop_arrives(_param: torch.Tensor) -> None:
        stop.request(1)  # the agent's stop arrives mid-backward

    model.layers[2].bias.register_post_accumulate_grad_hook(stop_arrives)
    model.layers[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(1))
    with pytest.raises(StopRequested, match="backward"):
        loss.backward()
    assert not seen  # the first layer's gradients were never computed
    assert model.layers[0].weight.grad is None


@pytest.mark.parametrize("phase", ["committed", "optimizer", "recovering", "resumed", "init"])
def test_outside_a_steps_computation_a_stop_waits_for_the_runtimes_own_edge(phase: str) -> None:
    stop, _, points, model = _setup(phase=phase)
    points.install([model])
    stop.request(1)
    model(torch.ones(2, 4)).sum().backward()  # evaluation, a checkpoint, the round: no raise
    assert model.ran == 3


def test_inside_the_optimizer_update_a_stop_waits() -> None:
    stop, state, points, model = _setup(phase="forward")
    points.install([model])
    state.in_update = True  # a framework computing inside its update window
    stop.request(1)
    model(torch.ones(2, 4))
    assert model.ran == 3


def test_a_stop_for_the_current_generation_is_no_stop() -> None:
    stop, state, points, model = _setup()
    points.install([model])
    state.generation = 1
    stop.request(1)  # the round into generation 1 is over: training goes on
    model(torch.ones(2, 4)).sum().backward()
    assert model.ran == 3


def test_disabled_or_removed_stop_points_never_raise() -> None:
    stop, _, points, model = _setup(enabled=False)
    assert points.install([model]) == 0
    stop.request(1)
    model(torch.ones(2, 4))
    stop2, _, points2, model2 = _setup()
    points2.install([model2])
    points2.remove()
    stop2.request(1)
    model2(torch.ones(2, 4)).sum().backward()
    assert model.ran == 3 and model2.ran == 3


DDP_SCRIPT = """
import torch, torch.distributed as dist
from launcher.runtime.rank_state import RankState
from launcher.runtime.replicas import Layout
from launcher.runtime.signals import StopSignal
from launcher.runtime.stop_points import MAX_POINTS, MIN_STEP_S, StopPoints, spread
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
points = StopPoints(StopSignal(), RankState(0, False, Layout.ddp(1)))
ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
print(points.install([ddp]), points.install([torch.nn.Linear(4, 4)]))
"""


def test_a_model_under_ddp_is_hooked_inside_the_wrapper() -> None:
    # in its own process: DDP keeps its group's listening socket for the rest of the process
    out = subprocess.run(
        [sys.executable, "-c", DDP_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    assert out.returncode == 0, out.stderr
    # the Linear inside the wrapper (1 module, 2 parameters), then a plain Linear as much again
    assert out.stdout.split() == ["3", "6"]


@pytest.mark.parametrize(
    ("stop_points", "ddp"), [("1", False), ("0", False), ("1", True), ("0", True)]
)
def test_a_survivor_mid_forward_stops_at_the_next_module(
    tmp_path, stop_points: str, ddp: bool
) -> None:
    """Two ranks of a native loop (or one under rt.ddp) whose forward takes 2 s (40 modules of
    50 ms); rank 1 dies 0.3 s into step 1's forward. With stop points rank 0 leaves its forward
    a module or two after the stop arrives; without (FTRUN_STOP_POINTS=0) it computes the whole
    forward first and stops at the backward's phase edge (DDP: at its backward's all-reduce)."""
    cmd = [
        *FTRUN,
        "--nproc_per_node",
        "2",
        "--max_restarts",
        "2",
        "--log_dir",
        str(tmp_path / "logs"),
        script("slow_forward.py"),
        *(["--ddp"] if ddp else []),
    ]
    env = env_with(OUT_DIR=str(tmp_path), FTRUN_STOP_POINTS=stop_points)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ev = events(str(tmp_path / "logs"))
    died = next(e for e in ev if e["event"] == "worker-failed" and e.get("rank") == 1)
    calls = [json.loads(line) for line in (tmp_path / "calls.0.jsonl").read_text().splitlines()]
    sys.path.insert(0, os.path.dirname(script("slow_forward.py")))
    try:
        import slow_forward
    finally:
        sys.path.pop(0)
    killed = slow_forward.kill_step(ddp)
    cut = [c for c in calls if c["step"] == killed and c["generation"] == 0]  # the stop cut it
    after_death = [c for c in cut if c["time"] > died["time"]]
    if stop_points == "1":
        assert len(cut) < 20 and len(after_death) <= 4, (len(cut), len(after_death))
    else:
        assert len(cut) == 40, len(cut)  # the whole forward, then the stop at "backward"
    redone = [c["step"] for c in calls if c["generation"] > 0][::40]
    assert redone == list(range(killed, 3)), redone  # redone, then on
    expected = slow_forward.train_alone(3)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"params.{rank}.pt")
        assert all(torch.equal(got[k], v) for k, v in expected.items()), rank  # bit-identical


def test_the_watched_models_are_hooked_at_the_first_commit_when_steps_are_long() -> None:
    stop, _, points, model = _setup()
    points.watch([model])
    assert points.arm(MIN_STEP_S / 2) == 0  # short steps end soon enough by themselves
    assert points.arm(10.0) == 0  # armed once: the first commit only
    stop.request(1)
    model(torch.ones(2, 4))
    assert model.ran == 3
    stop2, _, points2, model2 = _setup()
    points2.watch([model2])
    assert points2.arm(MIN_STEP_S) == 11
    stop2.request(1)
    with pytest.raises(StopRequested):
        model2(torch.ones(2, 4))


def test_a_large_model_gets_at_most_max_points_of_each_kind_evenly_spread() -> None:
    stop, _, points, _ = _setup()
    big = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(300)))  # 301 modules
    assert points.install([big]) == 2 * MAX_POINTS
    assert spread(list(range(10)), 4) == [0, 2, 5, 7] and spread([1, 2], 4) == [1, 2]
    stop.request(1)
    with pytest.raises(StopRequested):
        big(torch.ones(1, 2))  # the container's hook, the first of the spread
