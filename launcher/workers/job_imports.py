"""What the job's ranks import, as the agent knows it: so that a warm spare imports it first.

Owns: `names_runtime` (a look at the training script's source: does it name `launcher.runtime`?
Then the spare pool starts with the workers instead of at the first rank's hello;
`LaunchConfig.spare_start`), `names_torch` (does it import torch? Then the ranks start forked
from the node's fork server: `starts_forked`, `LaunchConfig.worker_start`), `script_imports`
(the third-party modules of the script's leading import block) and `JobImports`, the modules
the spares import besides torch and the runtime: the user's (`FTRUN_SPARE_IMPORTS`) first, then
the script's leading imports and those the ranks reported when they joined and by their first
step (`launcher.protocol.messages.Imports`; both unless `FTRUN_SPARE_LEARN=0`), in the order
they were first named, written to the file the spares and the fork server read
(`launcher.workers.spare_process.write_imports`; `spare_imports.json` in the run's log
directory). Nothing here imports what it names: that happens in the spares only.
"""

from __future__ import annotations

import ast
import os
import re
import sys

from launcher.protocol.messages import ftrun_module_not_for_spares
from launcher.workers.spare_process import write_imports

# a script that names the runtime: `import launcher.runtime`, `from launcher.runtime import ..`,
# `from launcher import runtime`
RUNTIME_NAMED = re.compile(
    rb"\blauncher\.runtime\b|\bfrom\s+launcher\s+import\s+(\([^)]*)?[^\n]*\bruntime\b"
)
# a script that imports torch itself: `import torch`, `import torch.distributed as dist`,
# `import os, torch`, `from torch import nn`, `from torch.utils.data import ...` (any indentation)
TORCH_NAMED = re.compile(
    rb"(?m)^[ \t]*(?:import[ \t]+(?:[\w.]+(?:[ \t]+as[ \t]+\w+)?[ \t]*,[ \t]*)*torch\b"
    rb"|from[ \t]+torch\b)"
)
SOURCE_BYTES = 1 << 20  # of a script's source read for the look
MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
MAX_MODULES = 20000  # modules kept from the ranks' reports (a bound on a report's size)


def script_source(script: str, module: bool, cwd: str) -> str | None:
    """The file of the training script (`python script` or `python -m script` from `cwd`), or
    None when it is not found without importing anything."""
    if not module:
        return script if os.path.isfile(script) else None
    base = os.path.join(cwd, *script.split("."))
    for path in (base + ".py", os.path.join(base, "__main__.py")):
        if os.path.isfile(path):
            return path
    return None


def _source(script: str, module: bool, cwd: str) -> bytes | None:
    """The first SOURCE_BYTES of the script's source, None when it cannot be read."""
    path = script_source(script, module, cwd)
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read(SOURCE_BYTES)
    except OSError:
        return None


def names_runtime(script: str, module: bool, cwd: str) -> bool:
    """Whether the script's own source names `launcher.runtime` (a script that reaches it only
    through a module of its own is known at its first hello instead)."""
    source = _source(script, module, cwd)
    return source is not None and RUNTIME_NAMED.search(source) is not None


def names_torch(script: str, module: bool, cwd: str) -> bool:
    """Whether the script's own source imports torch (or the runtime, which does): its ranks
    would each pay an `import torch` (1.5-2.5 CPU-s) the node's fork server pays once."""
    source = _source(script, module, cwd)
    if source is None:
        return False
    return TORCH_NAMED.search(source) is not None or RUNTIME_NAMED.search(source) is not None


def script_imports(script: str, module: bool, cwd: str) -> list[str]:
    """The modules the script imports first, before any statement of its own runs: the leading
    block of top-level `import X` / `from X import y` (after the docstring and
    `__future__`), without the standard library's, ftrun's own (but the runtime's) and the
    modules found in the script's own directory (the user's code). Read with `ast`, nothing
    imported; [] when the source cannot be read or parsed. In that block a module sees the
    same environment, path and order as in a rank, so the fork server can import it once for
    the node before it forks the ranks."""
    source = _source(script, module, cwd)
    if source is None:
        return []
    try:
        body = ast.parse(source).body
    except (SyntaxError, ValueError):
        return []
    path = script_source(script, module, cwd) or script
    here = os.path.dirname(os.path.abspath(path))
    names: list[str] = []
    for i, node in enumerate(body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module != "__future__":
                names.append(node.module)
        else:
            break  # the script's own code runs from here: what follows may depend on it
    return [n for n in dict.fromkeys(names) if _third_party(n, here)]


def _third_party(name: str, script_dir: str) -> bool:
    """A module neither of the standard library, nor ftrun's, nor beside the script."""
    top = name.split(".", 1)[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names or not keep(name):
        return False
    beside = os.path.join(script_dir, top)
    return not (os.path.isdir(beside) or os.path.isfile(beside + ".py"))


def starts_forked(worker_start: str, usable: bool, named_torch: bool) -> bool:
    """Whether the node's ranks start forked from its fork server (`FTRUN_WORKER_START`):
    never with "exec" or where a spare could not become a rank (`usable`: plain `python [-m]
    script` workers whose output is inherited, warm spares on, the fork server on); with
    "fork" always else; with "auto" when the script imports torch (`names_torch`): a script
    that does not would wait for the server's `import torch` it never needed."""
    if worker_start == "exec" or not usable:
        return False
    return worker_start == "fork" or named_torch


def starts_with_workers(
    spare_start: str, named_runtime: bool, cpus: int, local_ranks: int, server_warm: bool = False
) -> bool:
    """Whether the spare pool starts right after the workers (`FTRUN_SPARE_START`): "workers"
    always, "hello" never (at the first rank's hello), "auto" when the script names the runtime
    and either the fork server is warm already (`server_warm`: the ranks were forked from it, a
    spare costs a fork) or the node has a CPU to spare beside its ranks (`cpus > local_ranks`).
    Where the ranks take every CPU, a fork server importing torch beside them, even at nice 10 /
    SCHED_IDLE, delayed their first step by ~1.8 s (2 CPUs, 4 ranks: 9.6 s against 7.8 s): it
    starts at the first hello instead, once the ranks' own imports are done."""
    if spare_start == "workers":
        return True
    return spare_start == "auto" and named_runtime and (server_warm or cpus > local_ranks)


def node_cpus() -> int:
    """CPUs this process may run on (its affinity mask; os.cpu_count() where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def keep(name: str) -> bool:
    """A module name worth importing in a spare (well formed, not ftrun's own but the
    runtime's: `ftrun_module_not_for_spares`)."""
    return bool(MODULE_NAME.fullmatch(name)) and not ftrun_module_not_for_spares(name)


class JobImports:
    """The modules the spares import besides torch; one per agent (the spawner's)."""

    def __init__(self, path: str, named: list[str], dirs: list[str], learn: bool) -> None:
        self.path = path  # the file the spares read (`--imports`)
        self.dirs = dirs  # where the script's own modules are found (its directory)
        self.learn = learn  # FTRUN_SPARE_LEARN: take the ranks' reports
        self.modules: list[str] = [n for n in named if keep(n)]
        self._seen = set(self.modules)
        self.reported: set[int] = set()  # ranks whose report was taken
        if self.modules:
            self.write()

    def add(self, rank: int, modules: list[str]) -> int:
        """Rank `rank` had `modules` loaded by its first step: the number of new ones (the file
        is rewritten when there are any)."""
        self.reported.add(rank)
        if not self.learn:
            return 0
        new = [m for m in modules if m not in self._seen and keep(m)]
        new = new[: max(0, MAX_MODULES - len(self.modules))]
        if not new:
            return 0
        self.modules += new
        self._seen.update(new)
        self.write()
        return len(new)

    def write(self) -> None:
        write_imports(self.path, self.modules, self.dirs)

    @property
    def file(self) -> str | None:
        """The `--imports` file, None while there is nothing to import."""
        return self.path if self.modules else None
