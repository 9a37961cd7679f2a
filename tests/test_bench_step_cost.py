"""scripts/bench_step_cost.py: plain DDP and the runtime's path interleaved in the same ftrun
workers; one JSON line with per-mode ratios, intervals and block medians; bad arguments exit
non-zero with one line naming the flag."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_step_cost.py"
)


def test_one_launch_per_mode_reports_ratios_against_plain_ddp_in_the_same_process() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            SCRIPT,
            "--nproc",
            "2",
            "--repeats",
            "1",
            "--steps",
            "120",
            "--block",
            "10",
            "--modes",
            "rtddp,native",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the bench stops its ftrun launch on SIGTERM
        stdout, stderr = proc.communicate(timeout=60)
        raise AssertionError(
            f"bench_step_cost.py did not finish in 240 s\n{stderr[-3000:]}"
        ) from None
    assert proc.returncode == 0, stderr[-3000:]
    out = json.loads(stdout)
    assert out["bench"] == "step_cost" and out["nproc"] == 2 and out["modes"] == ["rtddp", "native"]
    small = out["small"]
    assert small["params"] == 140289
    for mode in ("rtddp", "native"):
        assert (
            small[f"{mode}_cycles"] == 120 // 20 - 2
        )  # cycles of two blocks, 2 dropped as warm-up
        for label in ("cpu", "wall"):
            lo, hi = small[f"{mode}_{label}_ci95_pct"]
            q1, q3 = small[f"{mode}_{label}_iqr_pct"]
            assert lo <= small[f"{mode}_{label}_pct"] <= hi and q1 <= q3, (mode, label, small)
        for side in ("ddp", "ours"):
            assert 0 < small[f"{mode}_{side}_cpu_step_s"] < 1.0, small
        assert 0 <= small[f"{mode}_agent_thread_cpu_pct"] < 100


def test_bad_arguments_exit_non_zero_naming_the_flag() -> None:
    for args, flag in (
        (["--modes", "ddp"], "--modes"),
        (["--sizes", "huge"], "--sizes"),
        (["--steps", "50", "--block", "10"], "--steps"),
    ):
        r = subprocess.run(
            [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=60
        )
        assert r.returncode != 0 and flag in r.stderr and "Traceback" not in r.stderr, r
