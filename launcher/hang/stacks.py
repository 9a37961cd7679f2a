"""Stack dumps of a hung worker, taken before it is killed.

Owns: getting a hung worker's Python stacks into its log and into events.jsonl. With `py-spy` on
PATH: `py-spy dump --pid` (every thread, read from outside; works on a stopped process). Else the
worker's own faulthandler: a runtime-aware worker registers it on SIGUSR1 (dump, carry on), an
unmodified worker gets `PYTHONFAULTHANDLER=1` from the spawner, so SIGABRT makes it dump every
thread and die. A stopped process (state T) is continued (SIGCONT) so it can run the handler.
faulthandler writes to the worker's stderr: the console, or its `stderr.log` with --redirects /
--tee, from where the new lines are read back for the event. Signals go to the worker's process
only, never to its process group (its children did not ask for SIGUSR1).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

PY_SPY_TIMEOUT = 15.0
DUMP_WAIT = 0.5  # seconds a worker gets to write its faulthandler dump
ABORT_WAIT = 3.0  # seconds an unmodified worker gets to dump and die after SIGABRT
COLLECTIVE_FRAMES = ("torch/distributed/", "distributed_c10d", "torch/nn/parallel/distributed.py")


@dataclass
class Dump:
    how: str  # "py-spy", "faulthandler (SIGUSR1)", "faulthandler (SIGABRT)", or "none: <why>"
    text: str = ""  # the stacks, when they could be read back
    where: str = ""  # where they were written for people

    @property
    def in_collective(self) -> bool | None:
        """Whether the stacks show the worker inside a torch.distributed call (None: unknown)."""
        if not self.text:
            return None
        return any(f in self.text for f in COLLECTIVE_FRAMES)


def py_spy_available() -> bool:
    return shutil.which("py-spy") is not None


def py_spy_dump(pid: int) -> str | None:
    """`py-spy dump --pid` output, None when py-spy is not installed or cannot read the process."""
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=PY_SPY_TIMEOUT
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 and out.stdout.strip() else None


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def _read_from(path: str, offset: int) -> str:
    if offset < 0:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(200_000).decode(errors="replace")
    except OSError:
        return ""


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
                if f.read().rsplit(")", 1)[-1].split()[0] == "Z":
                    return
        except OSError:
            return
        time.sleep(0.05)


def dump_stacks(pid: int, aware: bool, stderr_log: str | None, use_py_spy: bool = True) -> Dump:
    """Dump the stacks of the hung worker `pid`. An unmodified worker dies of the dump
    (SIGABRT) unless py-spy read it; the caller kills whatever is left. `stderr_log`: the
    worker's stderr file when it has one (--redirects/--tee)."""
    text = py_spy_dump(pid) if use_py_spy else None
    if text:
        return Dump("py-spy", text, "events.jsonl and the agent's log")
    where = (
        stderr_log if stderr_log and os.path.exists(stderr_log) else "the worker's stderr (console)"
    )
    before = _size(stderr_log) if stderr_log else -1
    if aware:
        _signal(pid, signal.SIGUSR1)  # the runtime's faulthandler: dump, carry on
        _signal(pid, signal.SIGCONT)
        time.sleep(DUMP_WAIT)
        how = "faulthandler (SIGUSR1)"
    else:
        _signal(pid, signal.SIGABRT)  # PYTHONFAULTHANDLER=1: dump every thread, then die
        _signal(pid, signal.SIGCONT)
        _wait_gone(pid, ABORT_WAIT)
        how = "faulthandler (SIGABRT)"
    return Dump(how, _read_from(stderr_log, before) if stderr_log else "", where)
