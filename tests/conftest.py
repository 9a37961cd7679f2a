"""Test-session set-up shared by every test file.

The c10d TCPStore client looks up the reverse DNS name of `::ffff:127.0.0.1`; on machines
whose resolver drops bursts, >20 concurrent clients stall 5-10 s. The `/etc/hosts` line below
removes the stall, so the suite adds it once (it is what `.ci/run` and the benchmarks do too).

It also registers `helpers_leaks.LeakWatch`: the terminal summary lists the stores and processes
that a test started and never stopped.
"""

from __future__ import annotations

import os
import sys

import pytest
from helpers_leaks import LeakWatch

HOSTS_LINE = "::ffff:127.0.0.1 localhost-v4mapped"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ensure_hosts_line() -> None:
    try:
        with open("/etc/hosts", encoding="utf-8") as f:
            if "localhost-v4mapped" in f.read():
                return
        with open("/etc/hosts", "a", encoding="utf-8") as f:
            f.write("\n" + HOSTS_LINE + "\n")
    except OSError:
        sys.stderr.write("warning: could not add the /etc/hosts line " + HOSTS_LINE + "\n")


def pytest_configure(config: pytest.Config) -> None:
    _ensure_hosts_line()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    path = os.environ.get("PYTHONPATH", "")
    if REPO not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = REPO + (os.pathsep + path if path else "")
    config.pluginmanager.register(LeakWatch(), "ftrun-leak-watch")
