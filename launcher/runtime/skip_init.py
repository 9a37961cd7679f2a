"""Skipping a replacement's random parameter init, which the state it receives overwrites.

Owns: `InitSkip`, the window in which a rank's `torch.nn.init` random fills (`uniform_`,
`normal_`, `trunc_normal_`, `kaiming_*`, `xavier_*`, `orthogonal_`, `sparse_`) on CPU tensors
drawing from torch's default generator are recorded instead of run (or, in a probe, recorded and
run), and the check at its end that skipping them changed (or would change) nothing a normal start
produces; `InitWindow`, which opens one on a rank's start, closes it at the first step and keeps
the verdict in the job's store.

A replacement builds its model and optimizer only to receive a replica's state over them; at
~170 MB of state the random fills of the model's construction took ~55 ms, about a quarter of
the recovery. Whether a replacement may skip them is settled before any fault, on the rank's
first start: with FTRUN_SKIP_INIT=1 (the default of `ftr.init()`) the window opens in `init()`
as a probe, the fills run as always, and at the first step (where a replacement applies the state
it receives) the check says whether skipping them would have been harmless; the verdict goes to
the store (`plan.skip_init_key(rank)`). A replacement skips its fills only when its rank's verdict
says harmless; otherwise it runs them for real, and without a verdict (its rank never reached a
first step) it probes like a first start. It never leaves because of the skip. The check at the
close:

- every skipped tensor must lie inside a tensor the received state overwrites: a registered
  model's `state_dict()` tensor (parameters, persistent buffers) or a registered extra (not,
  e.g., a non-persistent buffer or a module that is not registered);
- nothing may draw from torch's default CPU generator after a skipped fill: a skipping start's
  generator stays where the first skipped fill found it, so random numbers drawn later (a fixed
  projection, a dataset, a mask drawn after the model is built) would come from another
  generator state than a normal start's, and may live outside the state that arrives. A reseed
  in the window (`torch.manual_seed`, `torch.set_rng_state`, `torch.seed`, watched) with nothing
  drawn since the last skipped fill is fine (from there the generator is where a normal start's
  is); a reseed after such a draw counts as that draw. A probe checks the same with its fills
  run: nothing may draw between the end of a fill and the next fill or the close.

The skip is sound when the replacement runs what its rank's first start ran up to its first
step. A replacement that skipped and still fails the check (its script took another path than
the first start) says so in a warning, stores the verdict for later replacements and goes on.

A skipped tensor holds uninitialised memory with NaN in its first and last element until the
state arrives, so a copy taken of it in between (say, a frozen reference model deep-copied from
the model and not registered) is loudly wrong: register such a copy too (as a model or an
extra), or set FTRUN_SKIP_INIT=0.
Everything else of the state -- optimizer state, schedulers, RNG states, data position -- comes
with the transfer as before; the generator state is restored from it too.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.nn.init as nn_init

from launcher.protocol import plan as P
from launcher.runtime.rank_state import RankLinks

RANDOM_INITS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "orthogonal_",
    "sparse_",
)
RESEEDS = ("manual_seed", "set_rng_state", "seed")  # torch.<name>, watched while the window is open
HARMLESS = b"harmless"  # the verdict under plan.skip_init_key(rank) when a replacement may skip


@dataclass
class Skipped:
    fn: Callable[..., Any]  # the original init function
    tensor: torch.Tensor
    args: tuple
    kwargs: dict


@dataclass
class SkipResult:
    skipped: int  # fills recorded instead of run (a probe: that a skipping start would skip)
    diverged: str | None  # why the skip cannot be proven harmless (None: it can)


@dataclass
class InitSkip:
    """The open window (see the module docstring); `close()` ends it, once. `probe`: the fills
    run, and the close says whether skipping them would have been harmless."""

    probe: bool = False
    records: list[Skipped] = field(default_factory=list)
    # where the default generator must stand at the next fill and at the close: where the first
    # skipped fill found it (a probe: where the latest fill left it); None before the first fill
    expected_rng: torch.Tensor | None = None
    diverged: str | None = None  # why the skip can no longer be proven harmless
    _saved: dict[tuple[Any, str], Any] = field(default_factory=dict)
    _open: bool = False
    _filling: bool = False  # a probe's fill runs (a fill it calls is part of it)

    def open(self) -> None:
        if self._open:
            return
        self._open = True
        # torch.nn.init's own names, and where torch.nn's modules imported them by name (e.g.
        # MultiheadAttention's xavier_uniform_): a fill that ran would move the generator
        mods = [nn_init] + [
            m
            for n, m in list(sys.modules.items())
            if n.startswith("torch.nn.") and m is not None and m is not nn_init
        ]
        for name in RANDOM_INITS:
            orig = getattr(nn_init, name, None)
            if orig is None:
                continue
            wrapped = self._wrap_init(orig)
            for mod in mods:
                if getattr(mod, name, None) is orig:
                    self._patch(mod, name, wrapped)
        for name in RESEEDS:
            for mod in (torch, torch.random):
                orig = getattr(mod, name, None)
                if orig is not None:
                    self._patch(mod, name, self._wrap_reseed(name, orig))

    def _patch(self, mod: Any, name: str, new: Any) -> None:
        self._saved[(mod, name)] = getattr(mod, name)
        setattr(mod, name, new)

    def _wrap_init(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def init(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if (
                not self._open
                or self._filling
                or not isinstance(tensor, torch.Tensor)
                or tensor.device.type != "cpu"
                or kwargs.get("generator") is not None
                or type(tensor) not in (torch.Tensor, torch.nn.Parameter)
            ):
                return orig(tensor, *args, **kwargs)
            state = torch.get_rng_state()
            if self.expected_rng is None:
                self.expected_rng = state
            elif not torch.equal(state, self.expected_rng) and self.diverged is None:
                self.diverged = "random numbers were drawn between two skipped inits"
            self.records.append(Skipped(orig, tensor, args, kwargs))
            if not self.probe:
                _poison(tensor)
                return tensor
            self._filling = True
            try:
                out = orig(tensor, *args, **kwargs)
            finally:
                self._filling = False
            self.expected_rng = torch.get_rng_state()
            return out

        return init

    def _wrap_reseed(self, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def reseed(*args: Any, **kwargs: Any) -> Any:
            if self._open and self.expected_rng is not None and self.diverged is None:
                if torch.equal(torch.get_rng_state(), self.expected_rng):
                    # nothing drew since the last skipped fill, and from here the generator is
                    # where a normal start's would be: the next skipped fill sets a new baseline
                    self.expected_rng = None
                else:
                    self.diverged = (
                        f"random numbers were drawn after a skipped init, then torch.{name}()"
                    )
            return orig(*args, **kwargs)

        return reseed

    def close(self, covered: Iterable[torch.Tensor]) -> SkipResult:
        """End the window, right before a received state sets the generator; `covered`: the
        tensors that state overwrites."""
        if not self._open:
            return SkipResult(0, None)
        self._open = False
        for (mod, name), orig in self._saved.items():
            setattr(mod, name, orig)
        self._saved.clear()
        records, self.records = self.records, []
        diverged = self.diverged
        if (
            diverged is None
            and self.expected_rng is not None
            and not torch.equal(torch.get_rng_state(), self.expected_rng)
        ):
            diverged = "random numbers were drawn after a skipped init, before the state arrived"
        if diverged is None:
            spans = _spans(covered)
            outside = [r for r in records if not _inside(r.tensor, spans)]
            if outside:
                diverged = (
                    f"{len(outside)} skipped inits ({outside[0].fn.__name__} of a "
                    f"{tuple(outside[0].tensor.shape)} tensor first) wrote tensors outside the "
                    "received state"
                )
        self.expected_rng = None
        return SkipResult(len(records), diverged)


class InitWindow:
    """A managed rank's window over its random parameter init (FTRUN_SKIP_INIT=1): opened at
    start (`open`), closed at the first step (`close`), its verdict kept in the job's store (see
    the module docstring)."""

    def __init__(self, links: RankLinks) -> None:
        self.links = links
        self.skip: InitSkip | None = None

    def open(self, replacement: bool) -> None:
        """A start probes; a replacement skips when its rank's verdict says harmless, runs its
        fills when it says not, and probes when there is none."""
        links = self.links
        if not (links.env.managed and links.env.skip_init):
            return
        verdict = links.try_get(P.skip_init_key(links.rank)) if replacement else None
        if verdict is not None and verdict != HARMLESS:
            links.log(
                "random parameter inits run: skipping them was found not harmless "
                f"({verdict.decode(errors='replace')})"
            )
            return
        self.skip = InitSkip(probe=verdict is None)
        self.skip.open()

    def close(self, covered: Iterable[torch.Tensor]) -> None:
        """End the window where a replacement applies its received state; `covered`: the
        tensors that state overwrites. Stores a probe's verdict; never ends the process."""
        skip, self.skip = self.skip, None
        if skip is None:
            return
        res = skip.close(covered)
        links, key = self.links, P.skip_init_key(self.links.rank)
        if skip.probe:
            links.store.set(key, HARMLESS if res.diverged is None else res.diverged.encode())
            if res.diverged is not None:
                links.log(
                    "a replacement of this rank will run its random parameter inits: skipping "
                    f"them cannot be proven harmless ({res.diverged})"
                )
            return
        if res.diverged is None:
            if res.skipped:
                links.log(
                    f"skipped {res.skipped} random parameter inits the received state overwrites"
                )
            return
        links.store.set(key, res.diverged.encode())
        links.log(
            "WARNING: skipped random parameter inits cannot be proven harmless although this "
            f"rank's first start found them so (the script took another path): {res.diverged}; "
            "going on with the received state, later replacements run their inits "
            "(FTRUN_SKIP_INIT=0 turns the skip off)"
        )


def _poison(t: torch.Tensor) -> None:
    """NaN (0 for integers) in the first and last element: a copy of a skipped tensor taken
    before the state arrives is loudly wrong (its matmuls spread the NaN), at the cost of two
    touched pages, not a fill of the whole tensor (~15 ms at 57 MB, page faults included)."""
    if t.numel() == 0:
        return
    val = float("nan") if t.is_floating_point() or t.is_complex() else 0
    with torch.no_grad():
        if t.dim() == 0:
            t.fill_(val)
            return
        t[(0,) * t.dim()] = val
        t[tuple(n - 1 for n in t.shape)] = val


def _spans(tensors: Iterable[torch.Tensor]) -> dict[int, list[tuple[int, int]]]:
    """Storage address -> byte ranges [lo, hi) of contiguous tensors on it."""
    out: dict[int, list[tuple[int, int]]] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
            continue
        lo = t.storage_offset() * t.element_size()
        out.setdefault(t.untyped_storage().data_ptr(), []).append(
            (lo, lo + t.numel() * t.element_size())
        )
    return out


def _inside(t: torch.Tensor, spans: dict[int, list[tuple[int, int]]]) -> bool:
    """Whether every element of `t` lies in one of `spans` (on the same storage)."""
    if t.numel() == 0:
        return True
    esz = t.element_size()
    lo = t.storage_offset() * esz
    hi = lo + (sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1) * esz
    if any(s < 0 for s in t.stride()):
        return False
    return any(a <= lo and hi <= b for a, b in spans.get(t.untyped_storage().data_ptr(), ()))
