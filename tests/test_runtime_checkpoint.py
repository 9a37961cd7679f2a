"""Durable checkpoints: layout, atomic commit, and saves interrupted by SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from helpers_runtime import base_env

from launcher.runtime import checkpoint as ckpt
from launcher.runtime.devices import DeviceAdapter
from launcher.runtime.state import capture_rng


def state(value: float, n: int = 16) -> dict:
    return {
        "models": [{"w": torch.full((n,), value)}],
        "optimizers": [],
        "schedulers": [],
        "extras": {},
        "rng": capture_rng(DeviceAdapter()),
        "data_pos": {"batch": int(value)},
        "step": int(value),
    }


def test_layout_and_round_trip(tmp_path):
    ckpt.write_shard(tmp_path, 12, "mp_rank_00", state(3.0))
    ckpt.write_shard(tmp_path, 12, "mp_rank_01", state(4.0))
    assert ckpt.latest(tmp_path) is None  # nothing committed yet
    final = ckpt.commit(tmp_path, 12, ["mp_rank_00", "mp_rank_01"])
    assert final.name == "iter_0000012" and not (tmp_path / "iter_0000012_tmp").exists()
    assert (final / "mp_rank_01" / "model_optim_rng.pt").is_file()
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "12\n"
    assert ckpt.latest(tmp_path) == 12
    back = ckpt.read_shard(tmp_path, 12, "mp_rank_01")
    assert torch.equal(back["models"][0]["w"], torch.full((16,), 4.0))
    rng = back["rng"]
    np.random.set_state(rng["numpy"])  # decoded into a state numpy accepts
    assert back["data_pos"] == {"batch": 4}


def test_commit_refuses_missing_shard(tmp_path):
    ckpt.write_shard(tmp_path, 1, "mp_rank_00", state(1.0))
    with pytest.raises(RuntimeError, match="mp_rank_01"):
        ckpt.commit(tmp_path, 1, ["mp_rank_00", "mp_rank_01"])
    assert ckpt.latest(tmp_path) is None


def test_same_iteration_saved_again_replaces_it(tmp_path):
    ckpt.write_shard(tmp_path, 5, "mp_rank_00", state(1.0))
    ckpt.commit(tmp_path, 5, ["mp_rank_00"])
    ckpt.write_shard(tmp_path, 5, "mp_rank_00", state(2.0))
    ckpt.commit(tmp_path, 5, ["mp_rank_00"])
    assert torch.equal(
        ckpt.read_shard(tmp_path, 5, "mp_rank_00")["models"][0]["w"], torch.full((16,), 2.0)
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000005",
        "latest_checkpointed_iteration.txt",
    ]


def test_bad_tracker_is_a_clear_error(tmp_path):
    (tmp_path / ckpt.TRACKER).write_text("abc")
    with pytest.raises(RuntimeError, match="'abc'"):
        ckpt.latest(tmp_path)
    (tmp_path / ckpt.TRACKER).write_text("9")
    with pytest.raises(RuntimeError, match="iter_0000009"):
        ckpt.latest(tmp_path)


SAVER = r"""
import sys, torch
from launcher.runtime import checkpoint as ckpt
from launcher.runtime.devices import DeviceAdapter
from launcher.runtime.state import capture_rng
root = sys.argv[1]
big = {"models": [{"w": torch.full((1 << 22,), 7.0)}], "optimizers": [], "schedulers": [],
       "extras": {}, "rng": capture_rng(DeviceAdapter()), "data_pos": 7, "step": 7}
print("saving", flush=True)
while True:  # keep saving iteration 7 until killed
    ckpt.write_shard(root, 7, "mp_rank_00", big)
    ckpt.commit(root, 7, ["mp_rank_00"]) if len(sys.argv) > 2 else None
"""


@pytest.mark.parametrize("commit", [False, True])
def test_save_killed_mid_way_leaves_previous_checkpoint_intact(tmp_path, commit):
    ckpt.write_shard(tmp_path, 3, "mp_rank_00", state(3.0))
    ckpt.commit(tmp_path, 3, ["mp_rank_00"])
    args = [sys.executable, "-c", SAVER, str(tmp_path)] + (["commit"] if commit else [])
    proc = subprocess.Popen(args, env=base_env(), stdout=subprocess.PIPE, cwd=tmp_path)
    assert proc.stdout.readline().strip() == b"saving"
    tmp_dir = tmp_path / "iter_0000007_tmp" / "mp_rank_00"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # kill while a temp file is being written
        if tmp_dir.is_dir() and any(p.name.endswith(".tmp") for p in tmp_dir.iterdir()):
            break
        time.sleep(0.001)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    latest = ckpt.latest(tmp_path)
    assert latest in ((3, 7) if commit else (3,))
    loaded = ckpt.read_shard(tmp_path, latest, "mp_rank_00")
    assert loaded["step"] == latest  # a complete, loadable checkpoint either way
    if latest == 3:
        assert torch.equal(loaded["models"][0]["w"], torch.full((16,), 3.0))
