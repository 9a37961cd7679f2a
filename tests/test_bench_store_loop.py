"""scripts/bench_store_loop.py: one JSON line of per-request costs; bad arguments exit non-zero."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_store_loop.py"
)


def test_reports_every_op_in_microseconds() -> None:
    r = subprocess.run(
        [sys.executable, SCRIPT, "--conns", "4", "--rounds", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["conns"] == 4 and out["unit"] == "us"
    for op in ("floor", "get", "add", "set", "wait_present", "wait_wake"):
        assert 0 < out[op] < 10_000, (op, out)


def test_bad_arguments_exit_non_zero() -> None:
    for args in (["--conns", "0"], ["--repo", "/nonexistent"]):
        r = subprocess.run(
            [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=60
        )
        assert r.returncode != 0 and "bench_store_loop:" in r.stderr, r
