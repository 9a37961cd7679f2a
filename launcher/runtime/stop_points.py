"""Stop points inside a step's forward and backward.

Owns: `StopPoints`, installed on the models a rank registers (`Runtime.register`): a forward
pre-hook on every module and a post-accumulate-grad hook on every parameter that raise
`StopRequested` when a stop for a newer generation is pending while the rank computes a step
(between its start and its optimizer update). Without them a survivor that is not a peer of the
failed rank in any collective of the moment computes on to its next phase edge or collective
(megatron's forward and backward take 0.1-0.15 s each on a 2-core box) and the round waits for
its status that long. The rest of the step is discarded anyway: the round rolls the step back,
as it does for a stop at a phase edge, and a rank stopped here has not updated its parameters.

Not installed on a `DistributedDataParallel` (rt.ddp's reducer has its own stop handling, and
an exception inside its backward would leave the reducer mid-iteration); the native loop's
gradient buckets stop backward the same way already (`launcher.runtime.buckets`). A check is
a plain read of the stop signal and the rank's phase (~0.2 us per module call or gradient).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from launcher.runtime.rank_state import RankState
from launcher.runtime.signals import StopRequested, StopSignal

# the rank's phases outside a step's computation: a stop there waits for the runtime's own edge
# (the optimizer update runs to its end once begun: `in_update`)
NOT_COMPUTING = frozenset(
    {"init", "committed", "optimizer", "checkpoint", "paused", "recovering", "resumed", "done"}
)


class StopPoints:
    """The hooks on one rank's registered models; `remove()` takes them off."""

    def __init__(self, stop: StopSignal, state: RankState, enabled: bool = True) -> None:
        self._stop = stop
        self._state = state
        self.enabled = enabled  # under an ftrun agent, unless FTRUN_STOP_POINTS=0
        self._handles: list[Any] = []

    def install(self, models: Sequence[torch.nn.Module]) -> int:
        """Hook every module and parameter of `models` that no DDP wraps (nothing when not
        enabled); the number of hooks."""
        for model in models if self.enabled else ():
            if any(isinstance(m, DistributedDataParallel) for m in model.modules()):
                continue
            for module in model.modules():
                self._handles.append(module.register_forward_pre_hook(self._in_forward))
            for param in model.parameters():
                if param.requires_grad:
                    self._handles.append(
                        param.register_post_accumulate_grad_hook(self._in_backward)
                    )
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
