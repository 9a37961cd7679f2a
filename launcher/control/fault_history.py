"""The job's fault history, as the failure summary shows it.

Owns: `FaultHistory`, one entry per fault the controller handled: the fault (rank, kind, node,
pid, message, whether it was injected, when, how many reports were its consequences), the
strategies tried for it in order with their generations (`handling`), and how it ended
(`outcome`: "in progress", "recovered", "restarted (restart-all)", "superseded by ...",
"failed: ..."). It is published with every plan and saved for a successor controller
(`launcher.control.controller_state`). No store here.
"""

from __future__ import annotations

from typing import Iterable

from launcher.control.decision import Decision
from launcher.protocol import plan as P

IN_PROGRESS = "in progress"


class FaultHistory:
    def __init__(self, entries: Iterable[dict] = ()) -> None:
        self.entries: list[dict] = [dict(h) for h in entries]

    def copy(self) -> list[dict]:
        """The entries as published with a plan or saved (shallow copies)."""
        return [dict(h) for h in self.entries]

    def note(self, decision: Decision, g: int) -> None:
        """Generation `g`'s plan carries out `decision`: a fallback continues the current
        fault's handling; any other decision starts a new entry (the previous one ends:
        superseded, or already recovered)."""
        assert decision.strategy is not None and decision.cause is not None
        cur = self.entries[-1] if self.entries else None
        if decision.continues and cur is not None:
            cur["handling"].append([decision.strategy, g])
        else:
            if cur is not None and cur["outcome"] == IN_PROGRESS:
                cur["outcome"] = (
                    f"superseded by rank {decision.cause.rank} {decision.cause.kind} "
                    f"in generation {g}"
                )
            self.entries.append(entry(decision.cause, decision.strategy, g))
        if decision.strategy in (P.EXIT, P.DUMP):
            self.entries[-1]["outcome"] = f"failed: {decision.reason}"

    def outcome(self, g: int, outcome: str) -> bool:
        """Generation `g`'s round completed: its fault's outcome. True when that changed the
        history (the round is the current fault's latest and it was in progress)."""
        cur = self.entries[-1] if self.entries else None
        if cur is not None and cur["handling"][-1][1] == g and cur["outcome"] == IN_PROGRESS:
            cur["outcome"] = outcome
            return True
        return False


def entry(c: P.Fault, strategy: str, g: int) -> dict:
    """A new history entry: fault `c`, handled first by `strategy` in generation `g`."""
    return {
        "rank": c.rank,
        "kind": c.kind,
        "node": c.node,
        "pid": c.pid,
        "message": c.message[:500],
        "injected": c.injected,
        "time": c.time,
        "handling": [[strategy, g]],
        "outcome": IN_PROGRESS,
        "consequences": len(c.evidence.get("consequences", [])),
    }
