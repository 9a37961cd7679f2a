"""Helpers for the fault-taxonomy end-to-end tests: run `python -m launcher` jobs of
scripts/examples/ddp_train.py with faults injected (FTRUN_FAULT_PLAN or `ftctl inject` against
the live job) and read back what happened (events.jsonl, spawned pids, final parameters)."""

from __future__ import annotations

import datetime
import glob
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from helpers_launch import FTRUN, env_with, events, failed_worker_logs, spawned_pids
from helpers_runtime import EXAMPLES, load_params

NPROC = 4
STEPS = 6
FTCTL = [sys.executable, "-m", "launcher.cli.ftctl"]


@dataclass
class JobResult:
    returncode: int
    workdir: Path
    output: str  # the launcher's stdout + stderr (workers' output included)
    events: list[dict]
    pids: dict[int, list[int]] = field(default_factory=dict)  # rank -> pid of every spawn, in order
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def plans(self) -> list[dict]:
        return [e for e in self.events if e["event"] == "plan"]

    def strategies(self) -> list[str]:
        return [e["strategy"] for e in self.plans()]

    def restarted(self) -> dict[int, int]:
        """rank -> how many new processes it got (ranks never restarted are left out)."""
        return {r: len(p) - 1 for r, p in self.pids.items() if len(p) > 1}

    def first(self, name: str, **match: object) -> dict:
        for e in self.events:
            if e["event"] == name and all(e.get(k) == v for k, v in match.items()):
                return e
        raise AssertionError(f"no {name} event matching {match} in events.jsonl")

    def describe(self) -> str:
        """For assertion messages: the exit code, what the failed workers said last (their
        stderr.log tails and error.json), then the end of the job's output."""
        failed = failed_worker_logs(str(self.workdir / "logs"))
        return (
            f"exit {self.returncode}\n"
            + (f"failed workers:\n{failed}\n" if failed else "")
            + f"--- the job's output (end):\n{self.output[-8000:]}"
        )


def job_command(
    workdir: Path, launcher_args: list[str], script_args: list[str], steps: int = STEPS
) -> list[str]:
    return FTRUN + [
        "--nproc_per_node",
        str(NPROC),
        "--log_dir",
        str(workdir / "logs"),
        *launcher_args,
        str(EXAMPLES / "ddp_train.py"),
        "--steps",
        str(steps),
        "--out",
        str(workdir / "out{rank}.pt"),
        *script_args,
    ]


def job_env(plan: list[dict] | None, extra: dict[str, str] | None) -> dict[str, str]:
    env = env_with(FTRUN_FAULT_PLAN=json.dumps(plan or []), FTRUN_STORE_TIMEOUT="60")
    for k in (
        "HIGH_AVAILABILITY",
        "PROCESS_RECOVER",
        "ELASTIC_PROCESS_RECOVER_ENABLE",
        "ENABLE_RESTART_FAULT_PROCESS",
    ):
        env.pop(k, None)
    env.update(extra or {})
    return env


def collect(workdir: Path, returncode: int, output: str) -> JobResult:
    ev = events(str(workdir / "logs"))
    pids = spawned_pids(ev)
    params = []
    if returncode == 0:
        params = [load_params(workdir / f"out{r}.pt") for r in range(NPROC)]
    return JobResult(returncode, workdir, output, ev, pids, params)


def run_job(
    workdir: Path,
    plan: list[dict] | None = None,
    launcher_args: list[str] | None = None,
    script_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 240,
    steps: int = STEPS,
) -> JobResult:
    """Run one job to the end through the real CLI."""
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = job_command(
        workdir, ["--max_restarts", "3", *(launcher_args or [])], script_args or [], steps
    )
    res = subprocess.run(
        cmd,
        env=job_env(plan, env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(workdir),
    )
    return collect(workdir, res.returncode, res.stdout + res.stderr)


class LiveJob:
    """A job running in the background, for `ftctl inject` against it."""

    def __init__(
        self,
        workdir: Path,
        launcher_args: list[str] | None = None,
        script_args: list[str] | None = None,
        steps: int = STEPS,
        env: dict[str, str] | None = None,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self._out = open(workdir / "ftrun.out", "w+", encoding="utf-8")
        cmd = job_command(
            workdir, ["--max_restarts", "3", *(launcher_args or [])], script_args or [], steps
        )
        self.proc = subprocess.Popen(
            cmd,
            env=job_env(None, env),
            stdout=self._out,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=str(workdir),
        )

    def wait_for(self, name: str, count: int, timeout: float = 120) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in events(str(self.workdir / "logs")) if e["event"] == name]
            if len(found) >= count:
                return found
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        failed = failed_worker_logs(str(self.workdir / "logs"))
        raise AssertionError(
            f"expected {count} {name} events; job exit {self.proc.poll()}\n"
            + (f"failed workers:\n{failed}\n" if failed else "")
            + f"{self.output()[-6000:]}"
        )

    def store_addr(self) -> str:
        paths = glob.glob(str(self.workdir / "logs" / "*" / "store.json"))
        assert len(paths) == 1, paths
        with open(paths[0], encoding="utf-8") as f:
            return json.load(f)["addr"]

    def inject(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`ftctl inject --addr <this job> ARGS` as a real command."""
        return subprocess.run(
            FTCTL + ["inject", "--addr", self.store_addr(), *args],
            env=env_with(),
            capture_output=True,
            text=True,
            timeout=60,
        )

    def output(self) -> str:
        self._out.flush()
        return Path(self._out.name).read_text(errors="replace")

    def finish(self, timeout: float = 240) -> JobResult:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            self._out.close()
        return collect(self.workdir, code, Path(self._out.name).read_text(errors="replace"))


_STAMP = re.compile(r"\] (\d\d):(\d\d):(\d\d)\.(\d\d\d) ")


def stamp_of(line: str, near: float) -> float:
    """Epoch seconds of a runtime log line (`[ftrun rank R gen G] HH:MM:SS.mmm ...`, local time),
    resolved to the day of `near` (an epoch time within a few hours of it)."""
    m = _STAMP.search(line)
    if m is None:
        raise ValueError(f"no HH:MM:SS.mmm stamp in {line!r}")
    h, mi, s, ms = (int(g) for g in m.groups())
    base = datetime.datetime.fromtimestamp(near)
    t = base.replace(hour=h, minute=mi, second=s, microsecond=ms * 1000).timestamp()
    for cand in (t - 86400, t + 86400):  # across midnight
        if abs(cand - near) < abs(t - near):
            t = cand
    return t


def repaired_besides_laggards(pairs: list[list[int]]) -> set[int]:
    """Ranks that received state, other than a survivor that was still one step behind when the
    stop came (descheduled on a loaded machine, or stopped within a millisecond of the fault by
    the death notice while it finished the step before: it had not committed the step its
    replica had, so it is repaired from that replica too, which the protocol allows). The faulty
    rank 1 is the only one that must be repaired; survivor destinations are 0, 2 and 3."""
    dsts = {dst for _, dst in pairs}  # a destination with several sources receives striped
    assert all(src != dst for src, dst in pairs) and len({tuple(p) for p in pairs}) == len(pairs), (
        pairs
    )
    assert not dsts & {src for src, _ in pairs}, pairs
    return dsts & {1}


def assert_same_params(
    got: list[dict[str, torch.Tensor]], ref: list[dict[str, torch.Tensor]]
) -> None:
    assert len(got) == len(ref) == NPROC
    for r in range(NPROC):
        assert got[r].keys() == ref[r].keys()
        for k in ref[r]:
            assert torch.equal(got[r][k], ref[r][k]), (
                f"rank {r}: parameter {k} differs from fault-free"
            )
