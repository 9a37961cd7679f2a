"""What this rank has imported, told to its agent so that warm spares import it first.

Owns: `loaded_modules(script_dir)`: the modules in `sys.modules` now (when the rank joins the
job, and again at its first committed step), in `sys.modules`' order (importing a submodule
imports its parents), leaving out the standard library's, ftrun's own but the runtime's
(`ftrun_module_not_for_spares`), aliases (an entry whose module calls itself by another name),
the script itself and the modules of the script's own directory (the user's code: importing it
in a spare would run it there). The runtime's join sends them (`Imports`, at "start": the
script's top-level imports, so a kill at step 1 finds them in the spares too) and
`StepPath.commit` once more (what the first step imported); the agent's spare fork server
imports them before it forks spares, so a replacement runs only its script's body:
`torch._dynamo` (DDP's constructor), megatron-core, transformers are already there.
"""

from __future__ import annotations

import os
import sys

from launcher.protocol.messages import ftrun_module_not_for_spares

SKIPPED = ("__main__", "__mp_main__")


def _stdlib() -> frozenset[str]:
    return frozenset(sys.stdlib_module_names) | frozenset(sys.builtin_module_names)


def script_dir() -> str:
    """The directory of the running script (`sys.argv[0]`), as `sys.path[0]` has it."""
    return os.path.dirname(os.path.abspath(sys.argv[0])) if sys.argv and sys.argv[0] else ""


def loaded_modules(own_dir: str | None = None) -> list[str]:
    """The modules worth importing in a spare (see the module docstring)."""
    stdlib = _stdlib()
    own_dir = script_dir() if own_dir is None else own_dir
    prefix = os.path.join(own_dir, "") if own_dir else None
    out = []
    for name, mod in list(sys.modules.items()):
        top = name.split(".", 1)[0]
        ours = ftrun_module_not_for_spares(name)
        if top in stdlib or ours or name in SKIPPED or top.startswith("_"):
            continue
        spec = getattr(mod, "__spec__", None)
        if spec is None or spec.name != name:
            continue  # an alias, or a module made at run time
        origin = getattr(spec, "origin", None) or ""
        if prefix and origin.startswith(prefix):
            continue  # the user's own code
        out.append(name)
    return out
