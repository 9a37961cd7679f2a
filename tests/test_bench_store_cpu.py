"""scripts/bench_store_cpu.py: one JSON line per server (torch, ftrun with and without its C
read path) with its CPU per request; bad arguments exit non-zero."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_store_cpu.py"
)


def test_one_line_per_server_with_its_cpu_per_request() -> None:
    r = subprocess.run(
        [sys.executable, SCRIPT, "--conns", "3", "--rounds", "4", "--repeat", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["backend"] for x in lines] == ["torch", "ftrun", "ftrun-python"]
    for x in lines:
        assert x["requests"] == 3 * 4 * 4 and x["server_cpu_us_per_request"] >= 0, x
    assert "server_cpu_vs_torch" in lines[1] and "server_cpu_vs_torch" not in lines[0]


def test_bad_arguments_exit_non_zero() -> None:
    r = subprocess.run(
        [sys.executable, SCRIPT, "--conns", "0"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode != 0 and "bench_store_cpu:" in r.stderr, r
