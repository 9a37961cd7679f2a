"""scripts/bench_recovery.py end to end at a tiny size: one JSON line with the phases and how
the state came (same host: read from the replica's memory), and no run directory left behind
(a 1 GB state wrote ~8 GB of checkpoints per job into /tmp and filled the disk); with
--keep-logs the logs stay, the checkpoints still go."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "--no-torchrun",
    "--hidden",
    "64",
    "--layers",
    "2",
    "--steps",
    "16",
    "--kill-after-step",
    "6",
    "--no-wait-warm",
]


def _bench(tmp_path: Path, *extra: str) -> tuple[dict, str]:
    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_recovery.py"), *TINY, *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.mark.parametrize("keep", [False, True], ids=["default", "keep-logs"])
def test_a_run_reports_its_transfer_path_and_leaves_no_checkpoints(tmp_path, keep):
    row, err = _bench(tmp_path, *(["--keep-logs"] if keep else []))
    assert row["bench"] == "recovery" and row["ftrun_phases"]["detect_s"] >= 0
    assert row["ftrun_transfer_path"] == "memory" and row["ftrun_state_mb"] > 0
    left = sorted(p.name for p in tmp_path.glob("bench_recovery_*"))
    if keep:
        assert len(left) == 1 and f"run kept in {tmp_path / left[0]}" in err
        assert (tmp_path / left[0] / "logs").is_dir() and not (tmp_path / left[0] / "ckpt").exists()
    else:
        assert left == []
