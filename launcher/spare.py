"""Warm spares: a worker process that has already imported torch, waiting to replace a rank.

Owns: both ends of a spare. `python -m launcher.spare` is the spare itself: it imports torch and
the runtime (the 1-3 s a cold replacement spends before it can do anything), then blocks on its
stdin for one assignment line (JSON: env, argv, cwd, module) and runs the training script in
this very process with `runpy`, exactly as `python -u script args` would. EOF on stdin means
"not needed": it exits 0. `SparePool` is the agent's side: it keeps at most one spare per node,
started only once the job is known to use `launcher.runtime`, hands it out for a
process-level replacement and starts the next one later, away from the recovery's CPU burst.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Callable

from launcher.workers import _child_setup


class SparePool:
    """At most one warm spare; owned by the agent (`stop()` at shutdown)."""

    def __init__(self, python: str, log: Callable[[str], None], refill_delay: float = 5.0) -> None:
        self.python = python
        self.log = log
        self.refill_delay = refill_delay
        self._proc: subprocess.Popen | None = None
        self._not_before = time.monotonic() + refill_delay  # stay out of the job's start-up

    def ensure(self, env: dict[str, str]) -> None:
        """Start a spare if none is alive and the refill delay has passed."""
        if self._proc is not None and self._proc.poll() is None:
            return
        if time.monotonic() < self._not_before:
            return
        parent = os.getpid()
        self._proc = subprocess.Popen([self.python, "-u", "-m", "launcher.spare"], env=env,
                                      stdin=subprocess.PIPE, stdout=None, stderr=None,
                                      preexec_fn=lambda: _child_setup(parent), close_fds=True)
        self.log(f"warm spare started (pid {self._proc.pid})")

    def take(self, env: dict[str, str], argv: list[str], module: bool) -> subprocess.Popen | None:
        """Hand the spare its assignment; None when no live spare is available."""
        proc, self._proc = self._proc, None
        self._not_before = time.monotonic() + self.refill_delay
        if proc is None or proc.poll() is not None or proc.stdin is None:
            return None
        line = json.dumps({"env": env, "argv": argv, "cwd": os.getcwd(), "module": module}) + "\n"
        try:
            proc.stdin.write(line.encode())
            proc.stdin.close()
        except OSError:
            proc.kill()
            proc.wait()
            return None
        return proc

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.kill()  # idle: nothing to lose
        proc.wait()
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass


def _warm_imports() -> None:
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.optim  # noqa: F401

    import launcher.runtime.runtime  # noqa: F401  (the runtime and what it imports)
    try:  # optimizers import torch._dynamo lazily on their first step: pay it now
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - optional warm-up only
        pass


def main() -> None:
    _warm_imports()
    line = sys.stdin.readline()
    if not line.strip():
        sys.exit(0)
    job = json.loads(line)
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    argv = list(job["argv"])
    sys.argv = argv
    import runpy

    if job.get("module"):
        sys.path[0] = job["cwd"]
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
