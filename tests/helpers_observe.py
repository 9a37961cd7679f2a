"""Helpers for the observability tests (status, report, metrics): a real 4-rank job of
scripts/examples/ddp_train.py started through `python -m launcher`, and `ftctl` as a command."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers_launch import FTRUN, env_with, failed_worker_logs
from helpers_runtime import EXAMPLES

from launcher.observe.logs import read_events

FTCTL = [sys.executable, "-m", "launcher.cli.ftctl"]
NPROC = 4


def event_at(time: float, name: str, generation: int = 0, **fields) -> dict:
    """One events.jsonl record of node 0 (host "h") at `time`, as the agents write them; its
    message is its name unless `message=` says otherwise."""
    return {
        "time": time,
        "event": name,
        "node": 0,
        "generation": generation,
        "host": "h",
        "message": fields.pop("message", name),
        **fields,
    }


def job_env(**extra: str) -> dict[str, str]:
    env = env_with(FTRUN_STORE_TIMEOUT="60", FTRUN_PROGRESS_INTERVAL="0.3", **extra)
    for k in ("HIGH_AVAILABILITY", "PROCESS_RECOVER", "FTRUN_METRICS_PORT"):
        env.pop(k, None)
    env.update(extra)
    return env


def ftctl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        FTCTL + list(args), env=env_with(), capture_output=True, text=True, timeout=timeout
    )


class ObservedJob:
    """A 4-rank job running in the background; `finish()` or `stop()` it."""

    def __init__(
        self,
        workdir: Path,
        steps: int,
        step_time: float,
        launcher_args: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.logs = workdir / "logs"
        cmd = FTRUN + [
            "--nproc_per_node",
            str(NPROC),
            "--max_restarts",
            "3",
            "--log_dir",
            str(self.logs),
            *(launcher_args or []),
            str(EXAMPLES / "ddp_train.py"),
            "--steps",
            str(steps),
            "--step-time",
            str(step_time),
        ]
        self._out = open(workdir / "ftrun.out", "w+", encoding="utf-8")
        self.proc = subprocess.Popen(
            cmd,
            env=job_env(**(env or {})),
            stdout=self._out,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=str(workdir),
        )

    def events(self) -> list[dict]:
        return read_events(str(self.logs))

    def run_dir(self) -> str:
        dirs = glob.glob(str(self.logs / "*" / "events.jsonl"))
        assert len(dirs) == 1, dirs
        return os.path.dirname(dirs[0])

    def wait_for(
        self, name: str, count: int = 1, timeout: float = 120, **match: object
    ) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [
                e
                for e in self.events()
                if e["event"] == name and all(e.get(k) == v for k, v in match.items())
            ]
            if len(found) >= count:
                return found
            assert self.proc.poll() is None, self.describe(f"job exited {self.proc.poll()}")
            time.sleep(0.1)
        raise AssertionError(self.describe(f"no {count} {name} events {match}"))

    def describe(self, what: str) -> str:
        """`what`, the failed workers' last words (`failed_worker_logs`), the output's end."""
        failed = failed_worker_logs(str(self.logs))
        return (
            f"{what}\n" + (f"failed workers:\n{failed}\n" if failed else "") + self.output()[-6000:]
        )

    def store_addr(self) -> str:
        self.wait_for("store-address")
        with open(os.path.join(self.run_dir(), "store.json"), encoding="utf-8") as f:
            return json.load(f)["addr"]

    def output(self) -> str:
        if not self._out.closed:
            self._out.flush()
        return Path(self._out.name).read_text(errors="replace")

    def finish(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if not self._out.closed:
            self._out.close()
