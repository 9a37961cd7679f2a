"""What the job imports, as the agent knows it: the look at the script, the spares' module list."""

from __future__ import annotations

import json

import pytest

from launcher.workers.job_imports import (
    JobImports,
    names_runtime,
    names_torch,
    script_imports,
    starts_forked,
    starts_with_workers,
)


@pytest.mark.parametrize(
    "source, names",
    [
        ("import launcher.runtime as ftr\n", True),
        ("from launcher.runtime import init\n", True),
        ("from launcher import runtime\n", True),
        ("from launcher import (\n    runtime,\n)\n", True),
        (
            "import torch\nimport torch.distributed as dist\ndist.init_process_group('gloo')\n",
            False,
        ),
        ("import launcher_runtime_like\n", False),
    ],
)
def test_the_pool_starts_with_the_workers_only_for_a_script_that_names_the_runtime(
    tmp_path, source: str, names: bool
) -> None:
    script = tmp_path / "train.py"
    script.write_text(source)
    assert names_runtime(str(script), False, str(tmp_path)) is names


@pytest.mark.parametrize(
    "source, names",
    [
        ("import torch\n", True),
        ("import torch.distributed as dist\n", True),
        ("import time, torch, torch.distributed as dist\n", True),
        ("import os\nimport sys, torch as t\n", True),
        ("from torch import nn\n", True),
        ("from torch.utils.data import DataLoader\n", True),
        ("def main():\n    import torch\n", True),  # a late import counts too
        ("import launcher.runtime as ftr\n", True),  # the runtime imports torch
        ("import torchvision\n", False),
        ("import torch_xla\n", False),
        ("# import torch\nprint('hi')\n", False),
        ("x = 'import torch'\n", False),
        ("import os, sys\nprint(os.getpid())\n", False),
    ],
)
def test_the_ranks_start_forked_for_a_script_that_imports_torch(
    tmp_path, source: str, names: bool
) -> None:
    script = tmp_path / "train.py"
    script.write_text(source)
    assert names_torch(str(script), False, str(tmp_path)) is names


def test_a_module_script_that_imports_torch_is_found_without_importing_it(tmp_path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise SystemExit('imported!')\n")
    (pkg / "train.py").write_text("import torch\n")
    assert names_torch("pkg.train", True, str(tmp_path))
    assert not names_torch("pkg.missing", True, str(tmp_path))
    assert not names_torch(str(tmp_path / "missing.py"), False, str(tmp_path))


def test_the_worker_start_rule() -> None:
    """FTRUN_WORKER_START: exec never forks; fork forks whenever a spare could become a rank;
    auto forks only a script that imports torch (a script that does not would wait for an
    `import torch` it never needed)."""
    assert starts_forked("auto", usable=True, named_torch=True)
    assert not starts_forked("auto", usable=True, named_torch=False)
    assert starts_forked("fork", usable=True, named_torch=False)
    assert not starts_forked("fork", usable=False, named_torch=True)
    assert not starts_forked("auto", usable=False, named_torch=True)
    assert not starts_forked("exec", usable=True, named_torch=True)


def test_the_pool_starts_with_forked_ranks_whatever_the_cpus() -> None:
    """Ranks forked from the fork server leave it warm: the pool's spares (a fork each) start
    with the workers for a script that names the runtime, on a node without a CPU to spare too;
    `hello` and a script that does not name the runtime still wait for a hello."""
    assert starts_with_workers("auto", True, cpus=2, local_ranks=4, server_warm=True)
    assert not starts_with_workers("auto", True, cpus=2, local_ranks=4, server_warm=False)
    assert not starts_with_workers("auto", False, cpus=2, local_ranks=4, server_warm=True)
    assert not starts_with_workers("hello", True, cpus=2, local_ranks=4, server_warm=True)


def test_a_module_script_is_looked_up_from_the_working_directory_without_importing(
    tmp_path,
) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise SystemExit('imported!')\n")
    (pkg / "train.py").write_text("import launcher.runtime\n")
    (tmp_path / "solo").mkdir()
    (tmp_path / "solo" / "__main__.py").write_text("print('no runtime')\n")
    assert names_runtime("pkg.train", True, str(tmp_path))
    assert not names_runtime("solo", True, str(tmp_path))
    assert not names_runtime("missing.mod", True, str(tmp_path))
    assert not names_runtime(str(tmp_path / "missing.py"), False, str(tmp_path))


def test_the_spares_import_the_users_modules_then_the_ranks_reports(tmp_path) -> None:
    path = tmp_path / "spare_imports.json"
    imports = JobImports(str(path), ["megatron.core", "bad name"], ["/scripts"], learn=True)
    assert json.loads(path.read_text()) == {"modules": ["megatron.core"], "path": ["/scripts"]}
    # ftrun's own modules are left out but the runtime's (the spares' warm-up imports only its
    # core); repeated names count once
    reported = ["torch._dynamo", "launcher.agent", "launcher.runtime.callbacks", "megatron.core"]
    assert imports.add(0, reported + ["rendezvous.kv", "x.y"]) == 3
    assert imports.add(1, ["torch._dynamo", "x.y"]) == 0  # nothing new: the file stays
    assert imports.modules == [
        "megatron.core",
        "torch._dynamo",
        "launcher.runtime.callbacks",
        "x.y",
    ]
    assert json.loads(path.read_text())["modules"] == imports.modules
    assert imports.reported == {0, 1} and imports.file == str(path)


def test_with_learning_off_only_the_named_modules_are_imported(tmp_path) -> None:
    path = tmp_path / "spare_imports.json"
    imports = JobImports(str(path), [], [], learn=False)
    assert imports.file is None and not path.exists()  # nothing to import: no file
    assert imports.add(0, ["torch._dynamo"]) == 0 and imports.file is None


def test_the_scripts_leading_imports_are_read_without_importing_them(tmp_path) -> None:
    """Issue 32, item 4: the third-party modules a script imports before any statement of its
    own (megatron-core, transformers) are known before its ranks start, so the fork server can
    import them once for the node; the block ends at the first statement of the script's own."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "__init__.py").write_text("raise SystemExit('imported!')\n")
    (tmp_path / "helper.py").write_text("raise SystemExit('imported!')\n")
    script = tmp_path / "train.py"
    script.write_text(
        '"""A training script."""\n'
        "from __future__ import annotations\n"
        "import os, json\n"
        "import torch\n"
        "import megatron.core.parallel_state as ps\n"
        "from transformers import AutoModel\n"
        "from mine import model\n"  # the user's package beside the script: not for the server
        "import helper\n"  # the user's module beside the script
        "from megatron.core import tensor_parallel\n"
        "os.environ['X'] = '1'\n"  # the script's own code: what follows may depend on it
        "import late_module\n"
    )
    found = script_imports(str(script), False, str(tmp_path))
    assert found == ["torch", "megatron.core.parallel_state", "transformers", "megatron.core"]
    (tmp_path / "broken.py").write_text("import megatron.core\ndef f(:\n")
    assert script_imports(str(tmp_path / "broken.py"), False, str(tmp_path)) == []
    assert script_imports(str(tmp_path / "missing.py"), False, str(tmp_path)) == []
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "run.py").write_text("import numpy\nprint('go')\n")
    assert script_imports("pkg.run", True, str(tmp_path)) == ["numpy"]
