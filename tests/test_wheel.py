"""The wheel users install: built from the checkout, installed into a fresh venv, used from there.

The packages were once listed by hand in pyproject.toml and two of them (rendezvous.nodes.liveness
and its parent) were left out of the wheel: every user got ModuleNotFoundError while the tests,
which import the checkout, passed. These tests use only what the wheel installs:

- the wheel is built from a copy of the checkout (`pip wheel --no-deps --no-build-isolation`,
  offline; the compiled `.so` of the checkout is not copied, so gcc must build
  rendezvous/store/_quickstore.c into the wheel),
- the venv has no system site-packages: the editable install of the checkout there (a finder
  `__editable___ftrun_*` that a `.pth` file installs) would shadow the wheel. Its site-packages
  gets one `.pth` file that lists the system site-packages directories as plain paths, so torch
  and the other dependencies import, and the `.pth` files of those directories (the editable
  finder's among them) are never run,
- every command runs from a temporary cwd with PYTHONPATH unset, and the tests check that
  `launcher` and `rendezvous` (in the job's workers too) are imported from the venv.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("launcher", "rendezvous")
# Not part of a build: local build output, caches, the compiled extension of the editable install.
NOT_COPIED = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "*.so", ".venv", "ftrun_logs"
)
# Dependencies the venv must reach through the system site-packages.
DEPENDENCIES = ("torch", "numpy", "click", "rich")

IMPORT_EVERY_MODULE = r"""
import importlib, json, pkgutil, sys
names, files = [], {}
for top in sys.argv[1:]:
    pkg = importlib.import_module(top)
    names.append(top)
    names.extend(m.name for m in pkgutil.walk_packages(pkg.__path__, top + "."))
for name in names:
    files[name] = importlib.import_module(name).__file__
finders = [type(f).__name__ + " " + getattr(f, "__module__", "") for f in sys.meta_path]
print(json.dumps({"files": files, "finders": finders, "path": sys.path}))
"""


@dataclass(frozen=True)
class Installed:
    wheel: Path
    venv: Path
    site_packages: Path
    env: dict[str, str]  # the environment of every command run in the venv
    cwd: Path  # an empty temporary directory, not the checkout

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def run(self, *argv: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(argv),
            cwd=self.cwd,
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def _system_site_dirs() -> list[str]:
    """The directories torch and the other dependencies are imported from here."""
    dirs = [d for d in site.getsitepackages() if os.path.isdir(d)]
    for name in DEPENDENCIES:
        module = __import__(name)
        parent = os.path.dirname(os.path.dirname(os.path.abspath(module.__file__)))
        if parent not in dirs:
            dirs.append(parent)
    return [d for d in dirs if not Path(d).resolve().is_relative_to(REPO)]


def _venv_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = str(venv / "bin") + os.pathsep + env.get("PATH", "")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _checked(proc: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    tmp = tmp_path_factory.mktemp("wheel")
    source, dist, venv, cwd = tmp / "source", tmp / "dist", tmp / "venv", tmp / "cwd"
    shutil.copytree(REPO, source, ignore=NOT_COPIED)
    cwd.mkdir()
    env = _venv_env(venv)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    build = pip + ["wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist)]
    _checked(
        subprocess.run(
            build + [str(source)], cwd=cwd, env=env, capture_output=True, text=True, timeout=180
        ),
        "pip wheel",
    )
    (wheel,) = dist.glob("ftrun-*.whl")
    _checked(
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(venv)],
            capture_output=True,
            text=True,
            timeout=60,
        ),
        "python -m venv",
    )
    python = str(venv / "bin" / "python")
    install = pip + ["--python", python, "install", "--no-deps", "--no-index", str(wheel)]
    _checked(
        subprocess.run(install, cwd=cwd, env=env, capture_output=True, text=True, timeout=120),
        "pip install",
    )
    purelib = _checked(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        ),
        "sysconfig",
    ).stdout.strip()
    site_packages = Path(purelib)
    # Added after the install, so pip saw an empty venv; plain paths: their .pth files never run.
    (site_packages / "system_site_packages.pth").write_text("\n".join(_system_site_dirs()) + "\n")
    return Installed(wheel=wheel, venv=venv, site_packages=site_packages, env=env, cwd=cwd)


def _checkout_modules() -> set[str]:
    """The .py files of the checkout's packages, as paths relative to the checkout."""
    return {
        p.relative_to(REPO).as_posix()
        for top in PACKAGES
        for p in (REPO / top).rglob("*.py")
        if "__pycache__" not in p.parts
    }


def _module_name(path: str) -> str:
    """`a/b/__init__.py` -> `a.b`; `a/b.py` and `a/_c.cpython-311-x86_64-linux-gnu.so` -> `a.b`,
    `a._c`."""
    parts = path.split("/")
    parts[-1] = parts[-1].split(".")[0]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def test_the_wheel_holds_every_module_of_the_checkout_and_the_compiled_store(installed):
    names = zipfile.ZipFile(installed.wheel).namelist()
    in_wheel = {n for n in names if n.endswith(".py") and n.split("/")[0] in PACKAGES}
    assert in_wheel == _checkout_modules(), (
        f"missing from the wheel: {sorted(_checkout_modules() - in_wheel)}; "
        f"only in the wheel: {sorted(in_wheel - _checkout_modules())}"
    )
    compiled = [
        n for n in names if n.startswith("rendezvous/store/_quickstore") and n.endswith(".so")
    ]
    assert compiled, "rendezvous/store/_quickstore.c was not compiled into the wheel (is gcc here?)"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    scripts = zipfile.ZipFile(installed.wheel).read(entry_points).decode()
    assert "ftrun = launcher.cli.ftrun:main" in scripts
    assert "ftctl = launcher.cli.ftctl:main" in scripts


def test_every_module_of_the_wheel_imports_from_the_venv(installed):
    proc = _checked(
        installed.run(installed.bin("python"), "-c", IMPORT_EVERY_MODULE, *PACKAGES),
        "importing every module",
    )
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    wheel_modules = {
        _module_name(n)
        for n in zipfile.ZipFile(installed.wheel).namelist()
        if n.split("/")[0] in PACKAGES and n.endswith((".py", ".so"))
    }
    assert set(seen["files"]) == wheel_modules
    outside = {
        name: file
        for name, file in seen["files"].items()
        if not Path(file).resolve().is_relative_to(installed.site_packages.resolve())
    }
    assert not outside, f"imported from outside the venv: {outside}"
    assert not any("editable" in f.lower() for f in seen["finders"]), seen["finders"]
    assert str(REPO) not in seen["path"], seen["path"]


def test_ftrun_and_ftctl_run_from_the_venv_bin(installed):
    for command in ("ftrun", "ftctl"):
        proc = _checked(installed.run(installed.bin(command), "--help"), f"{command} --help")
        assert "Usage:" in proc.stdout, proc.stdout


def test_a_two_rank_job_runs_under_the_installed_ftrun(installed, tmp_path):
    script = str(REPO / "tests" / "scripts" / "gloo_allreduce.py")
    proc = installed.run(
        installed.bin("ftrun"), "--nproc_per_node", "2", script, timeout=120, OUT_DIR=str(tmp_path)
    )
    _checked(proc, "ftrun --nproc_per_node 2")
    for rank in (0, 1):
        out = json.loads((tmp_path / f"rank.{rank}.json").read_text())
        assert out["sum"] == 3.0
        runtime = Path(out["runtime_file"]).resolve()
        assert runtime.is_relative_to(installed.site_packages.resolve()), runtime
