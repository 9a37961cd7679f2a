"""The gradient syncs a replacement installs before its first backward.

Owns: `SyncSpec` (one `rt.allreduce_gradients` sync: which registered models, average, bucket
cap) and `SyncPlan`: a rank records each sync over its registered models on the default group in
the job's store (`P.grad_syncs_key(rank)`) when it first uses it; its replacement, right after its
repair, installs its predecessor's record (`install`). A sync is otherwise made at its first call,
after the first backward: the replacement's first step would launch every bucket's all-reduce
after its whole backward while the survivors, whose hooks launch them during backward, wait for
it. Installed ahead, its hooks launch the buckets during that backward as the survivors' do. The
buckets, their order and their sums are the same either way (launcher.runtime.buckets).
Syncs over other models or user groups are not recorded: they are made at their first call, as
before.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from launcher.protocol import plan as P
from launcher.runtime.rank_state import RankLinks, RankState


@dataclass(frozen=True)
class SyncSpec:
    """One gradient sync over the default group, by the registered models it covers."""

    models: tuple[int, ...]  # indices into the registered models, in the call's order
    average: bool
    bucket_bytes: int

    @classmethod
    def from_dict(cls, raw: dict) -> SyncSpec:
        return cls(
            tuple(int(i) for i in raw["models"]), bool(raw["average"]), int(raw["bucket_bytes"])
        )


class SyncPlan:
    """This rank's recorded gradient syncs (see the module docstring)."""

    def __init__(self, links: RankLinks, state: RankState) -> None:
        self.links = links
        self.state = state
        self.specs: list[SyncSpec] = []

    def record(
        self, models: tuple[torch.nn.Module, ...], group_key: Any, average: bool, bucket_bytes: int
    ) -> None:
        """A sync was made: record it when it covers registered models on the default group."""
        if group_key is not None or not self.links.env.managed or not self.state.registered:
            return
        registered = [id(m) for m in self.state.reg.models]
        if any(id(m) not in registered for m in models):
            return
        spec = SyncSpec(tuple(registered.index(id(m)) for m in models), average, bucket_bytes)
        if spec in self.specs:
            return
        self.specs.append(spec)
        raw = json.dumps([asdict(s) for s in self.specs]).encode()
        self.links.store.set(P.grad_syncs_key(self.links.rank), raw)

    def recorded(self) -> list[SyncSpec]:
        """The syncs this rank's predecessor recorded (none outside ftrun or before any)."""
        if not self.links.env.managed:
            return []
        raw = self.links.try_get(P.grad_syncs_key(self.links.rank))
        if raw is None:
            return []
        try:
            return [SyncSpec.from_dict(d) for d in json.loads(raw)]
        except (ValueError, KeyError, TypeError) as exc:
            self.links.log(f"ignoring the predecessor's gradient sync record {raw!r}: {exc}")
            return []

    def install(self, prepare: Callable[[tuple[torch.nn.Module, ...], bool, int], Any]) -> int:
        """(a replacement, after its repair) Make the predecessor's syncs with `prepare(models,
        average, bucket_bytes)` before the first backward; returns how many."""
        models = self.state.reg.models
        done = 0
        for spec in self.recorded():
            if not spec.models or max(spec.models) >= len(models):
                self.links.log(f"gradient sync {spec} names a model not registered here: skipped")
                continue
            if spec not in self.specs:
                self.specs.append(spec)  # made below: not recorded again
            prepare(tuple(models[i] for i in spec.models), spec.average, spec.bucket_bytes)
            done += 1
        if done:
            self.links.log(f"installed {done} gradient sync(s) of the predecessor before backward")
        return done
