"""Stop points inside a step's forward and backward.

Owns: `StopPoints`, installed on the models a rank registers (`Runtime.register`): forward
pre-hooks on their modules and post-accumulate-grad hooks on their parameters that raise
`StopRequested` when a stop for a newer generation is pending while the rank computes a step
(between its start and its optimizer update). Without them a survivor that is not a peer of the
failed rank in any collective of the moment computes on to its next phase edge or collective
(megatron's forward and backward take 0.1-0.15 s each on a 2-core box) and the round waits for
its status that long. The rest of the step is discarded anyway: the round rolls the step back,
as it does for a stop at a phase edge, and a rank stopped here has not updated its parameters.

Under `rt.ddp` the hooks sit on the modules inside the `DistributedDataParallel` wrapper (not
on the wrapper): a survivor's backward otherwise ran to its end before the reducer's wait on the
dead peer failed (0.02-0.05 s of the round). Leaving DDP's forward or backward by an exception
leaves its reducer mid-iteration, which is harmless here: after every round rt.ddp builds a new
reducer at the next forward (`launcher.runtime.ddp`) and the old one, with its works on the
shut-down groups, is dropped. The native loop's gradient buckets stop backward the same way
already (`launcher.runtime.buckets`). A check is
a plain read of the stop signal and the rank's phase; at most `MAX_POINTS` modules and
parameters of a model are hooked, evenly spaced in their order (a large model's step pays for
64 hook calls, ~0.1-0.2 ms, at most), and only once the rank's first step took `MIN_STEP_S` or
more (`arm`, at its first commit).
"""

from __future__ import annotations

from typing import Any, Sequence, TypeVar

import torch
from torch.nn.parallel import DistributedDataParallel

from launcher.runtime.rank_state import RankState
from launcher.runtime.signals import StopRequested, StopSignal

# hooks per model and kind: a module call with a hook leaves torch's fast path (~2-3 us more);
# 32 points cut a forward or backward into pieces fine enough at any model size
MAX_POINTS = 32
MIN_STEP_S = 0.05  # steps shorter than this get no stop points (`arm`)
T = TypeVar("T")
# the rank's phases outside a step's computation: a stop there waits for the runtime's own edge
# (the optimizer update runs to its end once begun: `in_update`)
NOT_COMPUTING = frozenset(
    {"init", "committed", "optimizer", "checkpoint", "paused", "recovering", "resumed", "done"}
)


def spread(items: list[T], most: int) -> list[T]:
    """At most `most` of `items`, evenly spaced in their order (all of them when fewer)."""
    if len(items) <= most:
        return items
    return [items[i * len(items) // most] for i in range(most)]


class StopPoints:
    """The hooks on one rank's registered models; `remove()` takes them off."""

    def __init__(self, stop: StopSignal, state: RankState, enabled: bool = True) -> None:
        self._stop = stop
        self._state = state
        self.enabled = enabled  # under an ftrun agent, unless FTRUN_STOP_POINTS=0
        self._handles: list[Any] = []
        self._watched: list[torch.nn.Module] = []  # installed on at `arm`

    def watch(self, models: Sequence[torch.nn.Module]) -> None:
        """The rank registered `models`: hooked at `arm` when its steps are long enough."""
        self._watched = list(models)

    def arm(self, step_s: float | None) -> int:
        """After the rank's first committed step (it took `step_s`): hook the watched models
        when a step takes MIN_STEP_S or more (a shorter step ends soon enough by itself, and
        the hooks would cost it more than 0.4 %); once. The number of hooks."""
        models, self._watched = self._watched, []
        if step_s is None or step_s < MIN_STEP_S:
            return 0
        return self.install(models)

    def install(self, models: Sequence[torch.nn.Module]) -> int:
        """Hook up to MAX_POINTS modules and parameters of each of `models` (inside a DDP
        wrapper, not the wrapper itself; nothing when not enabled); the number of hooks
        installed so far."""
        for model in models if self.enabled else ():
            modules = [m for m in model.modules() if not isinstance(m, DistributedDataParallel)]
            for module in spread(modules, MAX_POINTS):
                self._handles.append(module.register_forward_pre_hook(self._in_forward))
            params = [p for p in model.parameters() if p.requires_grad]
            for param in spread(params, MAX_POINTS):
                self._handles.append(param.register_post_accumulate_grad_hook(self._in_backward))
        return len(self._handles)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _check(self, where: str) -> None:
        state = self._state
        if (
            self._stop.newer_than(state.generation)
            and not state.in_update
            and state.phase not in NOT_COMPUTING
        ):
            raise StopRequested(self._stop.target, where)

    def _in_forward(self, module: torch.nn.Module, args: Any) -> None:
        self._check(f"forward of {type(module).__name__}")

    def _in_backward(self, param: torch.Tensor) -> None:
        self._check("backward (gradient)")
