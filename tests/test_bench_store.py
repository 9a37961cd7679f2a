"""scripts/bench_store.py: one JSON line per backend and size, with round-by-round ratios to
torch when repeated, and a second torch instance (`torch#2`) measured as a contender (the
benchmark's own spread)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_store.py"
)


# ~60 s (every backend's processes import torch per round): the benchmark's run is in the slow set;
# its parsing and argument checks below stay in the CI subset
@pytest.mark.slow
def test_backends_are_compared_to_torch_round_by_round_and_warm_pattern_by_pattern() -> None:
    """One run (the suite pays one set-up per backend and round): --repeat 2 gives each backend's
    rounds against torch's, a second torch instance (`torch#2`) is measured as a contender, and
    --iterations 3 sets all backends up at once, their warm patterns alternating and paired."""
    r = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--sizes",
            "8",
            "--repeat",
            "2",
            "--iterations",
            "3",
            "--backends",
            "torch,torch#2,ftrun,ftrun-proxy",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert lines[0]["setup"] == "/etc/hosts"
    rows = {x["backend"]: x for x in lines[1:]}
    assert list(rows) == ["torch", "torch#2", "ftrun", "ftrun-proxy"]
    assert "pattern_vs_torch_by_round" not in rows["torch"]
    for kind in ("torch#2", "ftrun", "ftrun-proxy"):
        x = rows[kind]
        assert x["clients"] == 8 and x["errors"] == 0 and x["runs"] == 2, x
        by_round = x["pattern_vs_torch_by_round"]
        assert len(by_round) == 2 and all(v > 0 for v in by_round), x
        assert x["rounds_at_or_below_torch"] == sum(v <= 1.0 for v in by_round)
        assert x["pattern_time_vs_torch"] == round(x["pattern_s"] / rows["torch"]["pattern_s"], 3)
    assert rows["torch#2"]["master_connections"] == rows["torch"]["master_connections"] == 8
    for kind, x in rows.items():
        assert x["errors"] == 0 and x["warm_patterns"] == 2, x
        assert x["warm_pattern_s_median"] > 0 and x["warm_pattern_s_median_of_runs"] > 0, x
        assert x["warm_master_cpu_s"] > 0 and x["warm_client_cpu_s"] > 0, x
        assert ("warm_proxy_cpu_s" in x) == (kind == "ftrun-proxy"), x
        assert ("warm_proxy_sys_s" in x) == ("warm_proxy_user_s" in x) == (kind == "ftrun-proxy")
        assert x["warm_master_user_s"] >= 0 and x["warm_master_sys_s"] >= 0, x
        assert x["warm_store_cpu_s"] == round(
            x["warm_master_cpu_s"] + x.get("warm_proxy_cpu_s", 0.0), 4
        ), x
    for kind in ("torch#2", "ftrun", "ftrun-proxy"):
        x = rows[kind]
        assert len(x["warm_vs_torch_by_round"]) == 2, x
        assert x["warm_rounds_at_or_below_torch"] == sum(
            v <= 1.0 for v in x["warm_vs_torch_by_round"]
        )
        assert x["warm_median_vs_torch"] == round(
            x["warm_pattern_s_median_of_runs"] / rows["torch"]["warm_pattern_s_median_of_runs"], 3
        )
        lo, hi = x["warm_paired_vs_torch_quartiles"]
        assert 0 < lo <= x["warm_paired_vs_torch"] <= hi, x
        assert "warm_pattern_s" not in x  # the pairs' input, not printed
        assert x["warm_store_cpu_vs_torch"] == round(
            x["warm_store_cpu_s"] / rows["torch"]["warm_store_cpu_s"], 3
        ), x


def test_user_and_system_cpu_are_read_as_the_kernel_counts_them() -> None:
    """`user_sys_seconds(pid)` reads the same counters as times(2) (`os.times()` of this
    process), user and system not swapped (user time is made to lead by 0.2 s first)."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import bench_store

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        t = os.times()
        if t.user - t.system > 0.2:
            break
        x = 0
        for i in range(100000):
            x += i
    before = os.times()
    user, system = bench_store.user_sys_seconds(os.getpid())
    after = os.times()
    assert before.user - 0.02 <= user <= after.user + 0.02, (before, user, after)
    assert before.system - 0.02 <= system <= after.system + 0.02, (before, system, after)
    assert user - system > 0.15
    assert bench_store.user_sys_seconds(2**22 + 12345) == (0.0, 0.0)  # no such process


def test_bad_arguments_are_one_line_and_exit_2() -> None:
    for args, names in (
        (["--sizes", "8,x"], "--sizes"),
        (["--iterations", "0"], "--iterations"),
        (["--repeat", "0"], "--repeat"),
        (["--backends", "torch,redis"], "redis"),
    ):
        r = subprocess.run(
            [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 2 and names in r.stderr and not r.stdout, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
