"""Warm spares: a pre-imported process runs the assigned script like `python -u script args`."""
from __future__ import annotations

import json
import os
import sys
import time

from launcher.spare import SparePool


def test_spare_runs_the_assigned_script_with_its_env_and_argv(tmp_path) -> None:
    script = tmp_path / "job.py"
    out = tmp_path / "out.json"
    script.write_text(
        "import json, os, sys\n"
        f"json.dump({{'argv': sys.argv, 'path0': sys.path[0], 'rank': os.environ.get('RANK'),"
        f" 'torch': 'torch' in sys.modules, 'name': __name__}}, open({str(out)!r}, 'w'))\n")
    logs: list[str] = []
    pool = SparePool(sys.executable, logs.append, refill_delay=0.0)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    pool.ensure(env)
    assert logs and "warm spare started" in logs[0]
    proc = pool.take(dict(env, RANK="3"), [str(script), "--x", "1"], module=False)
    assert proc is not None and proc.wait(timeout=120) == 0
    res = json.loads(out.read_text())
    assert res == {"argv": [str(script), "--x", "1"], "path0": str(tmp_path), "rank": "3",
                   "torch": True, "name": "__main__"}
    assert pool.take(env, [str(script)], module=False) is None  # used up until refilled
    pool.stop()


def test_idle_spare_is_stopped_at_once() -> None:
    pool = SparePool(sys.executable, lambda m: None, refill_delay=0.0)
    pool.ensure(dict(os.environ, PYTHONPATH=os.getcwd()))
    t0 = time.monotonic()
    pool.stop()
    assert time.monotonic() - t0 < 2.0
