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

Besides those, a spare imports what the job's ranks imported (`--imports FILE`, written by the
agent: the modules its ranks reported by their first step and `FTRUN_SPARE_IMPORTS`;
`import_listed`): a module that fails to import is skipped and named in one line, never fatal.
A spare started with `--ready-fd FD` writes one byte to FD once its imports are done (the pool's
`spare-ready`). `run_job` puts the time the job was assigned in `FTRUN_EXEC_TIME` (the runtime's
`exec` mark: when the replacement began running the script; not for a rank's first start,
whose assignment says `exec_mark` false) and makes the assignment's environment the process's
own (`set_environment`).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import threading
import time

from launcher.workers.priority import run_priority

# what a spare imports before it waits: torch, and the runtime with everything it imports
WARM_IMPORTS = ("torch", "torch.distributed", "torch.optim", "launcher.runtime.runtime")
# optimizers import torch._dynamo lazily on their first step: paid in the warm-up when present
OPTIONAL_WARM_IMPORTS = ("torch._dynamo",)
NICE_FLAG = "--nice"  # WARM,BASE: the warm-up niceness and the agent's, from the agent
IMPORTS_FLAG = "--imports"  # FILE: the job's modules to import too (`write_imports`)
READY_FLAG = "--ready-fd"  # FD: one byte written once the imports are done
EXEC_TIME_ENV = "FTRUN_EXEC_TIME"  # wall-clock time the job was assigned (the runtime's `exec`)


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


def write_imports(path: str, modules: list[str], dirs: list[str]) -> None:
    """The file `--imports` names: the modules to import and the directories to find them in
    (the script's own, as a rank has it in `sys.path[0]`)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"modules": list(modules), "path": list(dirs)}, f)
    os.replace(tmp, path)


def read_imports(path: str) -> tuple[list[str], list[str]]:
    """(modules, directories) of an `--imports` file; ([], []) when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return [str(m) for m in data.get("modules", [])], [str(d) for d in data.get("path", [])]
    except (OSError, ValueError, AttributeError):
        return [], []


def import_listed(path: str) -> list[tuple[str, str]]:
    """Import the modules an `--imports` file lists (its directories on `sys.path` meanwhile);
    the ones that failed, with why. A failure never ends the spare: the replacement imports
    that module itself, as a cold start would."""
    modules, dirs = read_imports(path)
    added = [d for d in dirs if d not in sys.path]
    sys.path[:0] = added
    failed: list[tuple[str, str]] = []
    try:
        for name in modules:
            if name in sys.modules:
                continue
            try:
                importlib.import_module(name)
            except BaseException as exc:  # noqa: BLE001 - a SystemExit at import, too
                failed.append((name, f"{type(exc).__name__}: {exc}"[:160]))
    finally:
        for d in added:
            if d in sys.path:
                sys.path.remove(d)
    gc.collect()
    gc.freeze()
    return failed


def failed_line(failed: list[tuple[str, str]], who: str) -> str:
    """One line naming the modules `who` could not import (skipped)."""
    named = "; ".join(f"{name} ({why})" for name, why in failed[:5])
    more = f"; and {len(failed) - 5} more" if len(failed) > 5 else ""
    return f"[ftrun spare] {who}: {len(failed)} of the job's modules not imported, skipped: " + (
        named + more
    )


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value after `flag` in `argv`, or None."""
    if flag not in argv or argv.index(flag) + 1 >= len(argv):
        return None
    return argv[argv.index(flag) + 1]


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
    assignment's `nice` when it has one: the agent returns it to its own after the repair). Its
    environment is the assignment's, exactly (`os.environ`, `os.environb` and the C library's:
    what torch reads later), plus `FTRUN_EXEC_TIME` unless the assignment says `exec_mark`
    false (a rank's first start: its environment is a cold rank's); faulthandler is on or off
    as `PYTHONFAULTHANDLER` in it says, as a new interpreter would have it (this process did
    not start one: a hung rank dumps its stacks on SIGABRT)."""
    if job.get("nice") is not None:
        run_priority(int(job["nice"]))
    env = dict(job["env"])
    if job.get("exec_mark", True):
        env[EXEC_TIME_ENV] = repr(time.time())
    set_environment(env)
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


def set_environment(env: dict[str, str]) -> None:
    """Make `env` this process's whole environment: `os.environ`, `os.environb` (separate
    copies in CPython, both kept) and the C library's (putenv/unsetenv), then faulthandler as
    `PYTHONFAULTHANDLER` asks (any non-empty value: on, as the interpreter does at start)."""
    import faulthandler

    if hasattr(os, "environb"):
        os.environb.clear()
        os.environb.update({os.fsencode(k): os.fsencode(v) for k, v in env.items()})
    os.environ.clear()
    os.environ.update(env)
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    elif faulthandler.is_enabled():
        faulthandler.disable()


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
    # born at `warm` (the pool's `born_warm`): the pool's escalation is never undone here
    warm, base = parse_nice(argv[argv.index(NICE_FLAG) + 1]) if NICE_FLAG in argv else (0, 0)
    assignment = Assignment(warm, base)
    warm_imports()
    imports = flag_value(argv, IMPORTS_FLAG)
    failed = import_listed(imports) if imports else []
    if failed:
        print(failed_line(failed, f"spare pid {os.getpid()}"), file=sys.stderr, flush=True)
    ready_fd = flag_value(argv, READY_FLAG)
    if ready_fd is not None:
        try:
            os.write(int(ready_fd), b"r")
            os.close(int(ready_fd))
        except OSError:
            pass  # the agent gave up on this spare's readiness
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
