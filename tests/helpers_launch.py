"""Helpers for tests that run `ftrun` (python -m launcher) and `torchrun` as real processes."""
from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys
import time

from launcher.logs import read_events as events  # noqa: F401  (re-exported for the tests)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "tests", "scripts")
FTRUN = [sys.executable, "-m", "launcher"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def script(name: str) -> str:
    return os.path.join(SCRIPTS, name)


def free_port() -> int:
    """A free port below the kernel's ephemeral range, so the many short-lived client
    connections of a parallel test run cannot grab it between this check and the bind."""
    import random

    lo = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="utf-8") as f:
            lo = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, lo - 12000), lo)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_with(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 120,
        cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env or env_with(), capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or REPO)




def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_for_files(pattern: str, n: int, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(glob.glob(pattern))
        if len(found) >= n:
            return found
        time.sleep(0.05)
    raise TimeoutError(f"expected {n} files matching {pattern}, found {sorted(glob.glob(pattern))}")
