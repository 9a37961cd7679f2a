"""Inside a warm spare: a process that has already imported torch, waiting to replace a rank.

Owns: what runs in a spare process. `python -m launcher.workers.spare_process --nice WARM,BASE`
is a spare started by the agent's pool (`launcher.workers.spare`): it warms up at niceness WARM
(and SCHED_IDLE; `priority`) when WARM differs from the agent's BASE, does the warm imports
(`warm_imports`: torch and the runtime, the 1-3 s a cold replacement spends before it can do
anything), then blocks on its stdin for one assignment line (JSON: env, argv, cwd, module, nice)
and runs the training script in this very process (`run_job`), exactly as
`python -u script args` would. Its stdin is read on a thread during the imports
(`Assignment`): a spare taken before its imports finished returns to the agent's priority at
once. EOF on stdin means "not needed": it exits 0. The spare fork server
(`launcher.workers.spare_server`) does the same warm-up once and runs `run_job` in each spare
it forks. The agent's settings come in the command line (`--nice`, written by the agent), never
from the user's environment.

The agent process never imports this module's warm imports: what they load (torch and
`launcher.runtime`) is data here, a list of module names imported by name (`importlib`) in the
spare only, so the import rule `launcher.workers` -> not `launcher.runtime` (the agent stays
free of torch) holds while the spare, which becomes a worker, pre-imports the runtime.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import threading

from launcher.workers.priority import run_priority, warm_priority

# what a spare imports before it waits: torch, and the runtime with everything it imports
WARM_IMPORTS = ("torch", "torch.distributed", "torch.optim", "launcher.runtime.runtime")
# optimizers import torch._dynamo lazily on their first step: paid in the warm-up when present
OPTIONAL_WARM_IMPORTS = ("torch._dynamo",)
NICE_FLAG = "--nice"  # WARM,BASE: the warm-up niceness and the agent's, from the agent


def warm_imports() -> None:
    """Import what a replacement needs first (`WARM_IMPORTS`), then freeze it for the GC."""
    for name in WARM_IMPORTS:
        importlib.import_module(name)
    for name in OPTIONAL_WARM_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - optional warm-up only
            pass
    # what the imports built lives as long as the process: out of the collector's sight. A full
    # collection over it takes ~50 ms (torch's ~170k objects), and the first one came while the
    # replacement started its script, 20-25 ms into the recovery; in a forked spare it would also
    # copy every page those objects live on
    gc.collect()
    gc.freeze()


def nice_args(warm: int, base: int) -> list[str]:
    """The command-line arguments that hand a spare (or the fork server) its priorities."""
    return [NICE_FLAG, f"{warm},{base}"]


def parse_nice(value: str) -> tuple[int, int]:
    """WARM,BASE of `--nice` (the agent wrote it: `nice_args`)."""
    warm, base = (int(x) for x in value.split(","))
    return warm, base


def job_nice(line: str, base: int) -> int:
    """The niceness an assignment line asks for (a boosted replacement), else `base`."""
    try:
        nice = json.loads(line).get("nice")
    except (ValueError, AttributeError):
        return base
    return base if nice is None else int(nice)


def run_job(job: dict) -> None:
    """Run the assigned script in this process as `python -u [-m] script args` would (at the
    assignment's `nice` when it has one: the agent returns it to its own after the repair)."""
    if job.get("nice") is not None:
        run_priority(int(job["nice"]))
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


class Assignment:
    """Reads the assignment line on a thread while the imports run: a spare taken while still
    warming up returns to the agent's priority at once instead of finishing `import torch` at
    the warm-up priority."""

    def __init__(self, warm: int, base: int) -> None:
        self.line = ""
        self.error: str | None = None
        self._done = threading.Event()
        self._warm, self._base = warm, base
        threading.Thread(target=self._read, name="ftrun-spare-stdin", daemon=True).start()

    def _read(self) -> None:
        try:
            self.line = sys.stdin.readline()
            if self.line.strip() and self._warm != self._base:
                self.error = run_priority(job_nice(self.line, self._base))
        finally:
            self._done.set()

    def wait(self) -> str:
        self._done.wait()
        return self.line


def main(argv: list[str]) -> None:
    """A spare's life: warm up, wait for the assignment, run it (or exit 0 on EOF)."""
    warm, base = parse_nice(argv[argv.index(NICE_FLAG) + 1]) if NICE_FLAG in argv else (0, 0)
    if warm != base:
        warm_priority(warm)
    assignment = Assignment(warm, base)
    warm_imports()
    line = assignment.wait()
    if not line.strip():
        sys.exit(0)
    if warm != base:
        # threads the imports started after the assignment arrived inherited the warm-up priority
        err = run_priority(job_nice(line, base)) or assignment.error
        if err:
            print(
                f"[ftrun spare] could not return to nice {base} ({err}); some threads run at "
                f"nice {warm}",
                file=sys.stderr,
                flush=True,
            )
    run_job(json.loads(line))


if __name__ == "__main__":
    main(sys.argv[1:])
