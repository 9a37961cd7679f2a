"""megatron-core's process groups across generations (the ARF group rebuild of MindIO TTP).

Owns: `rebuild_parallel_state(models, **init_kwargs)`, the `rebuild_groups` callback body for
megatron-core: once the runtime has built the new generation's default group, forget
parallel_state's groups of the old generation (`destroy_model_parallel`), create them again
(`initialize_model_parallel` with the same arguments, same call order on every rank, the
replacement doing the same at its start-up), and re-point every group handle the model's
modules cached at construction (`tp_group`, `pg_collection`, `embd_group`, ...) from the old
group object to the new one with the same parallel_state name. A cached group parallel_state
does not know is an error (it would be a stale group of a destroyed generation).
megatron is imported only when the function runs.

`initialize_model_parallel(**init_kwargs)`: megatron's, with each distinct group created once
(`SharedGroups`): megatron asks for many groups with the same ranks (with TP=2 x DP=2 on 4 ranks,
47 requests name 11 distinct groups, 6 of them this rank's); each is a rendezvous of every rank
through the store and a full-mesh connect, and the rebuild of a recovery round, critical for every
rank, makes them all again (~0.38 s for the 47 against ~0.09 s for the 11 in one measurement
here). A state made by it is rebuilt the same way: every rank of a generation creates the same
groups in the same order (the survivors' rebuild, a replacement's start-up).

Its gloo groups connect lazily (`lazy_connect`, default on: torch's TORCH_GLOO_LAZY_INIT for
their construction only): a pair of ranks connects at its first send, not in a full-mesh connect
when the group is made. The rebuild is on every rank's critical path in a recovery round, and
the 11 group creations, each a rendezvous of its members, took 42-54 ms there (4 ranks on 2
CPUs) against 16-27 ms lazily, while the first all-reduce on each of three of the groups took
no longer (5-17 ms either way; `tests/test_runtime_callbacks.py`). Every rank must make a group
the same way (a lazy member and an eager one never meet): the mode is chosen by the call that
made the state and kept for its rebuilds, and a replacement makes its state with the same call
as every rank did. The default group, and groups made elsewhere, are left as they are (the
sockets of `launcher.runtime.group_sockets` are recorded while a group is built).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

_ATOMS = (str, bytes, int, float, bool, type(None), torch.Tensor, torch.nn.Module, type)
_NOT_VISITED = _ATOMS + (dict, list, tuple, set)  # values whose attributes are not searched
_PLAIN = frozenset(_NOT_VISITED) | {torch.nn.Parameter}  # exact types that are never a group


def _is_group(value: Any) -> bool:
    """isinstance(value, ProcessGroup), cheap for the plain values most attributes hold
    (torch's ProcessGroup answers isinstance through a Python metaclass: ~5 us a call)."""
    return type(value) not in _PLAIN and isinstance(value, dist.ProcessGroup)


def parallel_state_groups(ps: Any) -> dict[str, Any]:
    """parallel_state's module globals holding a process group or a list of them."""
    out: dict[str, Any] = {}
    for name, value in vars(ps).items():
        if isinstance(value, dist.ProcessGroup):
            out[name] = value
        elif isinstance(value, (list, tuple)) and any(
            isinstance(v, dist.ProcessGroup) for v in value
        ):
            out[name] = list(value)
    return out


def group_mapping(old: dict[str, Any], new: dict[str, Any]) -> dict[int, Any]:
    """id(old group) -> new group, matched by parallel_state name (and list position)."""
    mapping: dict[int, Any] = {}
    for name, before in old.items():
        after = new.get(name)
        pairs = (
            list(zip(before, after))
            if isinstance(before, list) and isinstance(after, list) and len(before) == len(after)
            else [(before, after)]
        )
        for b, a in pairs:
            if isinstance(b, dist.ProcessGroup):
                if a is None:
                    raise RuntimeError(
                        f"parallel_state.{name} was not re-created for the new generation"
                    )
                mapping.setdefault(id(b), a)
    return mapping


class _Repointer:
    """Replaces old-generation groups inside modules and the plain objects they hold."""

    def __init__(self, mapping: dict[int, Any], current: Iterable[Any]) -> None:
        self.mapping = mapping
        self.current = {id(g) for g in current}
        self.count = 0
        self._seen: set[int] = set()

    def swap(self, value: Any, where: str) -> Any:
        if id(value) in self.current:
            return value
        new = self.mapping.get(id(value))
        if new is None:
            raise RuntimeError(
                f"{where} holds a process group that megatron's parallel_state does not "
                "know; it belongs to an earlier generation and cannot be re-pointed"
            )
        self.count += 1
        return new

    def visit(self, obj: Any, where: str, depth: int = 0) -> None:
        if id(obj) in self._seen or depth > 3:
            return
        self._seen.add(id(obj))
        attrs = vars(obj)
        for key, value in list(attrs.items()):
            path = f"{where}.{key}"
            if _is_group(value):
                attrs[key] = self.swap(value, path)
            elif isinstance(value, list) and any(_is_group(v) for v in value):
                attrs[key] = [
                    self.swap(v, f"{path}[{i}]") if _is_group(v) else v for i, v in enumerate(value)
                ]
            elif (
                not isinstance(value, _NOT_VISITED)
                and hasattr(value, "__dict__")
                and not callable(value)
            ):
                self.visit(value, path, depth + 1)


def repoint_groups(
    models: Iterable[torch.nn.Module], mapping: dict[int, Any], current: Iterable[Any]
) -> int:
    """Re-point cached groups in every submodule of `models`; returns how many were replaced."""
    rp = _Repointer(mapping, current)
    for i, model in enumerate(models):
        for name, module in model.named_modules():
            rp.visit(module, f"model[{i}]" + (f".{name}" if name else ""))
    return rp.count


SHARED_MARK = "_ftrun_shared_groups"  # set on parallel_state once its groups were made shared
LAZY_MARK = "_ftrun_lazy_connect"  # set on parallel_state: its gloo groups connect lazily
GLOO_LAZY_ENV = "TORCH_GLOO_LAZY_INIT"  # read by torch at each ProcessGroupGloo's construction


@contextlib.contextmanager
def gloo_connects_lazily(lazy: bool) -> Iterator[None]:
    """The gloo groups made inside connect each pair of ranks at its first use (`lazy`); the
    variable is restored after (not `lazy`: left as it is)."""
    if not lazy:
        yield
        return
    before = os.environ.get(GLOO_LAZY_ENV)
    os.environ[GLOO_LAZY_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(GLOO_LAZY_ENV, None)
        else:
            os.environ[GLOO_LAZY_ENV] = before


class SharedGroups:
    """While active, `parallel_state.create_group` gives a request with the same ranks, backend,
    timeout and synchronization as an earlier request of the same initialization that earlier
    group (requests with pg_options always get their own). Every rank makes the same requests
    in the same order, so every rank shares the same ones; collectives on a shared group run in
    the order each rank issues them, as megatron's SPMD code does on every rank."""

    def __init__(self, ps: Any) -> None:
        self.ps = ps
        self.made: dict[tuple, Any] = {}
        self._create = ps.create_group

    def create_group(
        self,
        ranks: Any = None,
        timeout: Any = None,
        backend: Any = None,
        pg_options: Any = None,
        use_local_synchronization: bool = False,
        group_desc: Any = None,
    ) -> Any:
        rank_list = tuple(ranks) if ranks is not None else None
        key = (rank_list, backend, timeout, use_local_synchronization)
        group = self.made.get(key) if pg_options is None else None
        if group is None:
            group = self._create(
                ranks=ranks,
                timeout=timeout,
                backend=backend,
                pg_options=pg_options,
                use_local_synchronization=use_local_synchronization,
                group_desc=group_desc,
            )
            if pg_options is None:
                self.made[key] = group
        elif ranks is not None and dist.get_rank() in ranks:
            known = getattr(self.ps, "_global_process_group_list", None)
            if isinstance(known, list):  # megatron's list of this rank's groups, as it keeps it
                known.append(group)
        return group

    def __enter__(self) -> SharedGroups:
        self.ps.create_group = self.create_group
        return self

    def __exit__(self, *exc: object) -> None:
        self.ps.create_group = self._create


def initialize_model_parallel(lazy_connect: bool = True, **init_kwargs: Any) -> None:
    """megatron's `parallel_state.initialize_model_parallel(**init_kwargs)` with each distinct
    group created once (`SharedGroups`, module docstring) and, with `lazy_connect`, gloo groups
    that connect lazily; `rebuild_parallel_state` then rebuilds them the same way. Call it
    instead of megatron's on every rank, at every start, with the same arguments."""
    ps = importlib.import_module("megatron.core.parallel_state")
    with SharedGroups(ps), gloo_connects_lazily(lazy_connect):
        ps.initialize_model_parallel(**init_kwargs)
    setattr(ps, SHARED_MARK, True)
    setattr(ps, LAZY_MARK, bool(lazy_connect))


def rebuild_parallel_state(
    models: torch.nn.Module | Iterable[torch.nn.Module], **init_kwargs: Any
) -> int:
    """destroy_model_parallel + initialize_model_parallel(**init_kwargs) on the current default
    group (sharing groups as `initialize_model_parallel` here did when it made the state), then
    re-point the groups `models` cached. Returns the number of re-pointed handles.
    Framework-specific globals (e.g. a CPU replacement of parallel_state's memory buffer) are
    the caller's to restore afterwards."""
    ps = importlib.import_module("megatron.core.parallel_state")
    model_list = [models] if isinstance(models, torch.nn.Module) else list(models)
    old = parallel_state_groups(ps)
    ps.destroy_model_parallel()
    shared = getattr(ps, SHARED_MARK, False)  # made by initialize_model_parallel here
    lazy = getattr(ps, LAZY_MARK, False)  # as it made them
    with SharedGroups(ps) if shared else contextlib.nullcontext(), gloo_connects_lazily(lazy):
        ps.initialize_model_parallel(**init_kwargs)
    new = parallel_state_groups(ps)
    current = [
        g
        for v in new.values()
        for g in (v if isinstance(v, list) else [v])
        if isinstance(g, dist.ProcessGroup)
    ]
    return repoint_groups(model_list, group_mapping(old, new), current)
