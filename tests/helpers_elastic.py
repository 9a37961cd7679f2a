"""Helpers for the live shrink and grow back tests (tests/test_runtime_elastic_*.py): run a job
under `--recover-strategy elastic-training` with one rank killed, and check that it shrank once
and grew back once."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from types import ModuleType

from helpers_launch import FTRUN, env_with, events, script


def run_killed(
    tmp_path: Path, nproc: int, kill: int, step: int, args: list[str], **env: str
) -> tuple[str, list[dict]]:
    """ftrun `args` (a script and its arguments) on `nproc` ranks with elastic-training, rank
    `kill` SIGKILLed in the backward of `step`; the output and the events of a job that
    succeeded."""
    plan = [{"rank": kill, "step": step, "phase": "backward", "kind": "kill"}]
    cmd = FTRUN + ["--nproc_per_node", str(nproc), "--max_restarts", "3"]
    cmd += ["--recover-strategy", "elastic-training", "--log_dir", str(tmp_path / "logs")]
    res = subprocess.run(
        cmd + args,
        env=env_with(FTRUN_FAULT_PLAN=json.dumps(plan), FTRUN_STORE_TIMEOUT="60", **env),
        capture_output=True,
        text=True,
        timeout=420,
        cwd=str(tmp_path),
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    return out, events(str(tmp_path / "logs"))


def shrank_and_grew(ev: list[dict], full: int, shrunk: int) -> tuple[dict, dict]:
    """Check the job's rounds were one live shrink full -> shrunk and its grow back; the
    `plan` event of the shrink and the `world-grow` event."""
    plans = [e for e in ev if e["event"] == "plan"]
    assert [p["strategy"] for p in plans] == ["elastic-training", "elastic-grow"], [
        e for e in ev if e["event"] in ("fault", "plan", "repair-plan")
    ]
    changes = [e for e in ev if e["event"] in ("world-shrink", "world-grow")]
    assert [(e["event"], e["world_size"], e["new_world_size"]) for e in changes] == [
        ("world-shrink", full, shrunk),
        ("world-grow", shrunk, full),
    ]
    return plans[0], changes[1]


def first_pids(ev: list[dict], nproc: int, restarted: set[int]) -> dict[int, int]:
    """rank -> pid of its first process; checks that only `restarted` got new processes."""
    spawns = [e for e in ev if e["event"] == "spawn"]
    first = {e["rank"]: e["pid"] for e in spawns[:nproc]}
    assert sorted(first) == list(range(nproc)) and {e["rank"] for e in spawns[nproc:]} == restarted
    return first


def records(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def elastic_loop() -> ModuleType:
    """tests/scripts/elastic_loop.py as a module (its `reference`)."""
    spec = importlib.util.spec_from_file_location("elastic_loop", script("elastic_loop.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
