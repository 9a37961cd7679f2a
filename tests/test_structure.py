"""House rules that the code's structure must keep, checked from the source with `ast`:

  * imports run one way: scripts -> launcher -> rendezvous (no arrow back up), and
    `launcher.runtime` (inside the user's worker processes) reaches no agent code, not even
    through a module it imports;
  * no function or method in launcher/ or rendezvous/ is longer than 80 lines.

Every import counts, also the ones inside functions: a late import is still an arrow.
"""
from __future__ import annotations

import ast
import functools
import os
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("launcher", "rendezvous", "scripts")
OURS = ("launcher", "rendezvous", "scripts", "tests")
MAX_FUNCTION_LINES = 80

# What a module of each layer must not import (a module or anything under it).
FORBIDDEN = {
    "rendezvous": ("launcher", "scripts", "tests"),
    "launcher": ("scripts", "tests"),
}

# The launcher modules `launcher.runtime` may reach (directly or through each other): the
# runtime itself and the shared vocabulary it speaks with the agent, i.e. the plan records and
# control keys, the fault kinds, the worker-channel messages and key/exit-code tables. Anything
# else in launcher/ is agent code (agent, controller, decision, workers, spare, spawner, store
# stack, plan executor, channel server, cli, config, logs, ...). rendezvous/ is below both.
RUNTIME_MAY_IMPORT = (
    "launcher",  # the package __init__ (empty)
    "launcher.runtime",  # and everything under it
    "launcher.plan",
    "launcher.faults",
    "launcher.messages",
    "launcher.keys",
    "launcher.death_notice",  # both ends of the death notice (stdlib only), as messages
)


@dataclass(frozen=True)
class Import:
    source: str  # importing module, e.g. "launcher.agent"
    target: str  # imported module, e.g. "launcher.plan"
    path: str  # file of the import, relative to the repo
    line: int


def _module_name(rel: str) -> str:
    parts = rel[:-3].split(os.sep)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


@functools.lru_cache(maxsize=1)
def _source_files() -> dict[str, str]:
    """module name -> path relative to the repo, for every .py under PACKAGES."""
    out: dict[str, str] = {}
    for pkg in PACKAGES:
        for root, dirs, files in os.walk(os.path.join(REPO, pkg)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for f in sorted(files):
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(root, f), REPO)
                    out[_module_name(rel)] = rel
    return out


def _is_under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _resolve(node: ast.ImportFrom, source: str, is_package: bool, known: set[str]) -> list[str]:
    """Modules named by `from X import a, b`: X.a where that is a module, else X."""
    base = node.module or ""
    if node.level:  # relative import
        pkg = source.split(".") if is_package else source.split(".")[:-1]
        pkg = pkg[:len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([base] if base else []))
    names = [f"{base}.{a.name}" if base else a.name for a in node.names]
    return [n if n in known else base for n in names]


@functools.lru_cache(maxsize=None)
def _tree(rel: str) -> ast.Module:
    with open(os.path.join(REPO, rel), encoding="utf-8") as f:
        return ast.parse(f.read(), rel)


def _imports(files: dict[str, str]) -> list[Import]:
    known = set(files)
    out: list[Import] = []
    for mod, rel in files.items():
        for node in ast.walk(_tree(rel)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                targets = _resolve(node, mod, rel.endswith("__init__.py"), known)
            else:
                continue
            out.extend(Import(mod, t, rel, node.lineno) for t in targets
                       if t.split(".")[0] in OURS)
    return out


def test_imports_run_one_way() -> None:
    """scripts -> launcher -> rendezvous: nothing imports a layer above its own."""
    bad = {f"{i.path}:{i.line}: {i.source} imports {i.target}"
           for i in _imports(_source_files())
           for layer, banned in FORBIDDEN.items() if _is_under(i.source, layer)
           for b in banned if _is_under(i.target, b)}
    assert not bad, "imports that run back up:\n" + "\n".join(sorted(bad))


def _runtime_may_import(target: str) -> bool:
    if not _is_under(target, "launcher"):
        return True  # rendezvous is below; stdlib and third-party are not ours
    return target == "launcher" or any(_is_under(target, a) for a in RUNTIME_MAY_IMPORT[1:])


def test_runtime_reaches_no_agent_code() -> None:
    """Follow every import from launcher.runtime.* transitively; report the chain to each
    launcher module outside RUNTIME_MAY_IMPORT."""
    files = _source_files()
    edges: dict[str, list[Import]] = {}
    for i in _imports(files):
        edges.setdefault(i.source, []).append(i)
    start = [m for m in files if _is_under(m, "launcher.runtime")]
    chain: dict[str, list[Import]] = {m: [] for m in start}
    todo = list(start)
    bad: list[str] = []
    while todo:
        mod = todo.pop()
        for imp in edges.get(mod, []):
            if imp.target in chain:
                continue
            path = chain[mod] + [imp]
            chain[imp.target] = path
            if not _runtime_may_import(imp.target):
                bad.append(" -> ".join([path[0].source] + [p.target for p in path])
                           + f"  ({imp.path}:{imp.line})")
            else:
                todo.append(imp.target)
    assert not bad, "launcher.runtime reaches agent code:\n" + "\n".join(sorted(bad))


def _long_functions(pkg: str) -> list[str]:
    out: list[str] = []
    for mod, rel in _source_files().items():
        if not _is_under(mod, pkg):
            continue
        for node in ast.walk(_tree(rel)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append(f"{rel}:{node.lineno}: {node.name} is {n} lines")
    return out


def test_no_function_over_80_lines() -> None:
    bad = _long_functions("launcher") + _long_functions("rendezvous")
    assert not bad, (f"functions over {MAX_FUNCTION_LINES} lines (split them into named "
                     "steps):\n" + "\n".join(sorted(bad)))


def test_the_checks_see_what_they_check() -> None:
    """The walkers find the packages, the imports between them and the functions in them (a
    check that sees nothing cannot fail)."""
    files = _source_files()
    assert {"launcher.cli", "launcher.runtime", "rendezvous.kv", "launcher.config"} <= set(files)
    imports = {(i.source, i.target) for i in _imports(files)}
    assert ("launcher.cli", "launcher.config") in imports  # from launcher.config import ...
    assert ("launcher.config", "launcher.plan") in imports  # from launcher import plan
    assert ("launcher.cli", "launcher.agent") in imports  # a late import inside main()
    assert any(s.startswith("scripts.") and t == "launcher.runtime" for s, t in imports)
    assert _runtime_may_import("launcher.runtime.state") and _runtime_may_import("rendezvous.kv")
    assert not _runtime_may_import("launcher.agent")
    assert not _runtime_may_import("launcher.plan_executor")  # a prefix is not a package
