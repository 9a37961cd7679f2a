"""Where a job's graceful pause stands, read from its store (`ftctl status`, `ftctl pause`).

Owns: `PauseState` and `pause_state(kv)`: the latest `ftctl pause` request (`plan.PAUSE_KEY`),
whether it is over (`plan.resume_key`, with the reason) and the step the ranks agreed to halt
after (`plan.pause_step_key`); `describe` is its one line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from launcher.protocol import plan as P


@dataclass(frozen=True)
class PauseState:
    seq: int
    requested: float  # epoch seconds
    max_s: float
    halt_step: int | None  # None: the ranks have not agreed yet
    ended: str | None  # why it ended; None: in effect

    @property
    def in_effect(self) -> bool:
        return self.ended is None

    def describe(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        if self.ended is not None:
            return f"pause #{self.seq} ended ({self.ended})"
        age = now - self.requested
        if self.halt_step is None:
            return f"pausing (pause #{self.seq}, requested {age:.1f}s ago)"
        return (
            f"paused after step {self.halt_step} (pause #{self.seq}, {age:.1f}s of at most "
            f"{self.max_s:g}s; ftctl resume continues)"
        )


def pause_state(kv: Any) -> PauseState | None:
    """The latest pause of the job in store `kv` (a KVStore), or None when none was asked for."""
    raw = kv.try_get(P.PAUSE_KEY)
    if raw is None:
        return None
    req = P.PauseRequest.from_json(raw)
    step = kv.try_get(P.pause_step_key(req.seq))
    ended = kv.try_get(P.resume_key(req.seq))
    return PauseState(
        seq=req.seq,
        requested=req.time,
        max_s=req.max_s,
        halt_step=int(step) if step is not None else None,
        ended=ended.decode(errors="replace") if ended is not None else None,
    )
