"""Test helpers for launcher.runtime: gloo worker pools, parameter loading and comparison.

`MiniJob` plays the agent + controller roles of the recovery protocol for runtime tests that
must not depend on the launcher: it hosts a real torch TCPStore, serves the agent unix socket
(hello / heartbeat / fault / stop), spawns real worker processes with ftrun's environment,
restarts only dead ranks as replacements, computes the RepairPlan with
`launcher.runtime.replicas.plan_repair`, and restarts everything when the plan falls back.
`run_workers` starts N plain processes that run a python snippet against a shared store.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "scripts" / "examples"


def base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTRUN_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def master_store() -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )


def run_workers(
    code: str,
    nprocs: int,
    workdir: Path,
    store: dist.TCPStore,
    extra_env: dict[str, str] | None = None,
) -> list[subprocess.Popen]:
    """Start `nprocs` python processes running `code` with RANK/WORLD_SIZE/MASTER_* set."""
    procs = []
    for r in range(nprocs):
        env = base_env(
            {
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": str(nprocs),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port),
                **(extra_env or {}),
            }
        )
        log = open(workdir / f"worker{r}.log", "wb")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=workdir,
            )
        )
        log.close()
    return procs


def worker_logs(workdir: Path, nprocs: int) -> str:
    return "\n".join(
        f"===== worker{r}\n" + (workdir / f"worker{r}.log").read_text(errors="replace")
        for r in range(nprocs)
    )


def load_params(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["params"]


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"parameter {k} differs"


class DictStore:
    """The calls the runtime's rank code makes on torch's store (set, get, check), in a dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)
