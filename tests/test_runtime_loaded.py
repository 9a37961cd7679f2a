"""What a rank reports it has imported, for the warm spares (launcher.runtime.loaded)."""

from __future__ import annotations

import sys
import types

import torch  # noqa: F401  (a library the report must name)
import torch.nn.parallel  # noqa: F401

from launcher.runtime.loaded import loaded_modules


def test_the_report_names_the_libraries_not_the_stdlib_ftrun_or_the_users_own_code(
    tmp_path, monkeypatch
) -> None:
    own = tmp_path / "mymodel.py"
    own.write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import mymodel  # noqa: F401  (the user's own module, beside the script)

    alias = types.ModuleType("torch_alias_for_test")  # made at run time: no spec
    monkeypatch.setitem(sys.modules, "torch_alias_for_test", alias)
    names = loaded_modules(str(tmp_path))
    assert "torch" in names and "torch.nn.parallel" in names
    assert not {"os", "json", "collections.abc", "__main__", "mymodel"} & set(names)
    # ftrun's own: only the runtime's modules the job uses (a framework's callbacks, say),
    # which the spares' warm-up does not import by itself
    import launcher.runtime.callbacks  # noqa: F401

    names = loaded_modules(str(tmp_path))
    ours = [n for n in names if n.split(".")[0] in ("launcher", "rendezvous")]
    assert "launcher.runtime.callbacks" in ours
    assert all(n == "launcher.runtime" or n.startswith("launcher.runtime.") for n in ours)
    assert "torch_alias_for_test" not in names
    # the same module from another directory is a library
    assert "mymodel" in loaded_modules(str(tmp_path / "elsewhere"))
