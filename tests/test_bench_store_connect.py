"""scripts/bench_store_connect.py: one JSON line per backend and size with the connect phase's
wall time and master CPU (medians and every round) and the ratios to torch; bad arguments exit
non-zero with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_store_connect.py"
)


# ~32 s of torch imports per round: the benchmark's run is in the slow set (arguments below: CI)
@pytest.mark.slow
def test_one_line_per_backend_with_the_connects_cpu_and_ratios() -> None:
    r = subprocess.run(
        [sys.executable, SCRIPT, "--sizes", "8", "--repeat", "2", "--backends", "torch,ftrun"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert lines[0]["setup"] == "/etc/hosts"
    rows = {x["backend"]: x for x in lines[1:]}
    assert list(rows) == ["torch", "ftrun"]
    for x in rows.values():
        assert x["clients"] == 8 and x["rounds"] == 2 and x["errors"] == 0, x
        assert len(x["master_cpu_connect_s"]) == 2 and x["connect_s_median"] > 0, x
    f = rows["ftrun"]
    assert f["master_cpu_median_vs_torch"] > 0 and "connect_median_vs_torch" in f
    assert "connect_median_vs_torch" not in rows["torch"]


def test_bad_arguments_exit_non_zero_with_one_line() -> None:
    for args, want in (
        (["--sizes", "x"], "--sizes 'x'"),
        (["--repeat", "0"], "--repeat 0"),
        (["--sizes", "8", "--repeat", "1", "--backends", "ftrun-proxy"], "backend 'ftrun-proxy'"),
    ):
        r = subprocess.run(
            [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120
        )
        assert r.returncode != 0 and "bench_store_connect:" in r.stderr and want in r.stderr, r
