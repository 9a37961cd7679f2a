"""House rules that the code's structure must keep, checked from the source with `ast`:

  * imports run one way: scripts -> launcher -> rendezvous, and inside each, package by package
    as `MAY_IMPORT` lists (a package not listed there fails the test: place it first);
  * `launcher.runtime` (inside the user's worker processes) reaches no launcher code but
    `launcher.protocol`, not even through a module it imports;
  * no import cycle between modules, and no private name (`_x`) of one module used by another;
  * no function or method in launcher/ or rendezvous/ is longer than 60 lines, no class longer
    than 400.

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
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 400

# What a module of each layer must not import (a module or anything under it).
FORBIDDEN = {
    "rendezvous": ("launcher", "scripts", "tests"),
    "launcher": ("scripts", "tests"),
}

# The rooms and the doors between them: each unit (a package, or a module at a package's root)
# and what it may import besides itself. Lower layers first; nothing imports a layer above it.
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "rendezvous": (),  # the package's __init__
    "rendezvous.kv": (),
    "rendezvous.errors": ("rendezvous.kv",),
    "rendezvous.store": ("rendezvous.kv", "rendezvous.errors"),
    "rendezvous.nodes": ("rendezvous.kv", "rendezvous.errors", "rendezvous.store"),
    "launcher": (),  # the package's __init__
    "launcher.protocol": ("rendezvous",),
    "launcher.runtime": ("launcher.protocol", "rendezvous"),
    "launcher.observe": ("launcher.protocol", "rendezvous"),
    "launcher.hang": ("launcher.protocol", "launcher.observe"),
    "launcher.control": ("launcher.protocol", "launcher.observe", "rendezvous"),
    "launcher.config": ("launcher.protocol", "launcher.hang", "launcher.control", "rendezvous"),
    "launcher.workers": ("launcher.protocol", "launcher.observe", "launcher.config", "rendezvous"),
    "launcher.agent": (
        "launcher.protocol",
        "launcher.observe",
        "launcher.hang",
        "launcher.control",
        "launcher.workers",
        "launcher.config",
        "rendezvous",
    ),
    "launcher.cli": (
        "launcher.agent",
        "launcher.config",
        "launcher.observe",
        "launcher.protocol",
        "rendezvous",
    ),
    "launcher.__main__": ("launcher.cli",),
}

# The launcher modules `launcher.runtime` may reach (directly or through each other): the
# runtime itself and the shared vocabulary it speaks with the agent (plan records and control
# keys, fault kinds, channel messages, the death notice). rendezvous/ is below both.
RUNTIME_MAY_IMPORT = (
    "launcher",  # the package __init__ (a docstring)
    "launcher.runtime",  # and everything under it
    "launcher.protocol",
)


@dataclass(frozen=True)
class Import:
    source: str  # importing module, e.g. "launcher.agent.agent"
    target: str  # imported module, e.g. "launcher.protocol.plan"
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
        pkg = pkg[: len(pkg) - (node.level - 1)]
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
            out.extend(Import(mod, t, rel, node.lineno) for t in targets if t.split(".")[0] in OURS)
    return out


def test_imports_run_one_way() -> None:
    """scripts -> launcher -> rendezvous: nothing imports a layer above its own."""
    bad = {
        f"{i.path}:{i.line}: {i.source} imports {i.target}"
        for i in _imports(_source_files())
        for layer, banned in FORBIDDEN.items()
        if _is_under(i.source, layer)
        for b in banned
        if _is_under(i.target, b)
    }
    assert not bad, "imports that run back up:\n" + "\n".join(sorted(bad))


def _runtime_may_import(target: str) -> bool:
    if not _is_under(target, "launcher"):
        return True  # rendezvous is below; stdlib and third-party are not ours
    return target == "launcher" or any(_is_under(target, a) for a in RUNTIME_MAY_IMPORT[1:])


def _unit(module: str) -> str | None:
    """The MAY_IMPORT unit a module belongs to (the longest listed prefix), or None."""
    hits = [u for u in MAY_IMPORT if _is_under(module, u)]
    return max(hits, key=len) if hits else None


def test_every_module_lives_in_a_listed_room() -> None:
    files = _source_files()
    lost = sorted(
        m
        for m in files
        if _is_under(m, "launcher") or _is_under(m, "rendezvous")
        if _unit(m) is None
    )
    assert not lost, "modules outside every MAY_IMPORT unit (add the package):\n" + "\n".join(lost)


def test_each_package_imports_only_what_its_rules_allow() -> None:
    bad = set()
    for i in _imports(_source_files()):
        src, dst = _unit(i.source), _unit(i.target)
        if src is None or dst is None or src == dst or i.source.startswith("scripts"):
            continue
        if not any(_is_under(dst, a) for a in MAY_IMPORT[src]):
            bad.add(f"{i.path}:{i.line}: {i.source} ({src}) imports {i.target} ({dst})")
    assert not bad, "imports through a door that is not there:\n" + "\n".join(sorted(bad))


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on.add(nxt)
                work.append((nxt, iter(sorted(edges.get(nxt, ())))))
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
    return out


def _module_edges() -> dict[str, set[str]]:
    files = _source_files()
    edges: dict[str, set[str]] = {m: set() for m in files}
    for i in _imports(files):
        if i.target in files and i.target != i.source:
            edges[i.source].add(i.target)
    return edges


def test_no_import_cycles() -> None:
    found = _cycles(_module_edges())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def _private_uses(files: dict[str, str]) -> list[str]:
    """`from ours import _x` where _x is not a module, and `mod._x` on a module of ours bound
    by an import, in a module other than the owner."""
    known = set(files)
    out: list[str] = []
    for mod, rel in files.items():
        aliases: dict[str, str] = {}
        tree = _tree(rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                targets = _resolve(node, mod, rel.endswith("__init__.py"), known)
                for a, target in zip(node.names, targets):
                    if target in known and target.endswith("." + a.name):  # a module
                        aliases[a.asname or a.name] = target
                    elif (
                        a.name.startswith("_")
                        and not a.name.startswith("__")
                        and target.split(".")[0] in OURS
                        and target != mod
                        and not _is_extension(target, a.name)
                    ):
                        out.append(f"{rel}:{node.lineno}: imports {target}.{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in known:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and aliases[node.value.id] != mod
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                out.append(f"{rel}:{node.lineno}: uses {aliases[node.value.id]}.{node.attr}")
    return out


def _is_extension(module: str, name: str) -> bool:
    """The compiled store module, imported by name from its package (no .py source)."""
    return os.path.exists(os.path.join(REPO, *module.split("."), name + ".c"))


def test_no_private_name_crosses_a_module() -> None:
    bad = _private_uses(_source_files())
    assert not bad, "private names used outside their module:\n" + "\n".join(sorted(bad))


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
                bad.append(
                    " -> ".join([path[0].source] + [p.target for p in path])
                    + f"  ({imp.path}:{imp.line})"
                )
            else:
                todo.append(imp.target)
    assert not bad, "launcher.runtime reaches agent code:\n" + "\n".join(sorted(bad))


def _too_long(pkg: str, kinds: tuple[type, ...], limit: int) -> list[str]:
    """Every definition of `kinds` under `pkg` longer than `limit` lines."""
    out: list[str] = []
    for mod, rel in _source_files().items():
        if _is_under(mod, pkg):
            for node in ast.walk(_tree(rel)):
                n = node.end_lineno - node.lineno + 1 if isinstance(node, kinds) else 0
                if n > limit:
                    out.append(f"{rel}:{node.lineno}: {node.name} is {n} lines")
    return out


def _long_functions(pkg: str) -> list[str]:
    return _too_long(pkg, (ast.FunctionDef, ast.AsyncFunctionDef), MAX_FUNCTION_LINES)


def test_no_function_over_60_lines() -> None:
    bad = _long_functions("launcher") + _long_functions("rendezvous")
    assert not bad, (
        f"functions over {MAX_FUNCTION_LINES} lines (split them into named "
        "steps):\n" + "\n".join(sorted(bad))
    )


def _long_classes(pkg: str) -> list[str]:
    return _too_long(pkg, (ast.ClassDef,), MAX_CLASS_LINES)


def test_no_class_over_400_lines() -> None:
    bad = _long_classes("launcher") + _long_classes("rendezvous")
    assert not bad, f"classes over {MAX_CLASS_LINES} lines (split them by job):\n" + "\n".join(
        sorted(bad)
    )


def test_the_checks_see_what_they_check() -> None:
    """The walkers find the packages, the imports between them and the functions in them (a
    check that sees nothing cannot fail)."""
    files = _source_files()
    assert {"launcher.cli.ftrun", "launcher.runtime", "rendezvous.kv", "launcher.config"} <= set(
        files
    )
    imports = {(i.source, i.target) for i in _imports(files)}
    assert ("launcher.cli.ftrun", "launcher.config") in imports  # from launcher.config import ...
    assert (
        "launcher.config",
        "launcher.protocol.plan",
    ) in imports  # from launcher.protocol import plan
    assert ("launcher.cli.ftrun", "launcher.agent.agent") in imports  # a late import inside main()
    assert any(s.startswith("scripts.") and t == "launcher.runtime" for s, t in imports)
    assert _runtime_may_import("launcher.runtime.state") and _runtime_may_import("rendezvous.kv")
    assert not _runtime_may_import("launcher.agent.agent")
    assert not _runtime_may_import("launcher.agent.plan_executor")  # a prefix is not a package
    assert (
        _unit("launcher.agent.agent") == "launcher.agent"
        and _unit("rendezvous.kv") == "rendezvous.kv"
    )
    assert _unit("launcher.runtime.replicas") == "launcher.runtime"
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert _long_classes("launcher") or _long_classes("rendezvous") or MAX_CLASS_LINES > 0
