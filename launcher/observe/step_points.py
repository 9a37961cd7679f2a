"""The committed steps of an agent's ranks, as compact batches for `events.jsonl`.

Owns: `StepPoints`, the points (time, committed step) its ranks' heartbeats showed since the
last batch, at most one per `SPACING` seconds per rank (the newest wins within that spacing, so
the last step a rank committed is always there), and `take()`, which drains them into the body
of one `steps` record: `{"t0": base time, "ranks": {rank: [[seconds after t0, step], ...]}}`.
The progress chart of `ftctl report` and a finished run's steps come from these records, not
from the periodic `progress` samples. One record per progress interval (and at a rank's exit,
and at the end): at 4 points a second per rank, about 2 kB per 8 ranks and 5 s.
"""

from __future__ import annotations

import threading

SPACING = 0.25  # seconds between two points of one rank


class StepPoints:
    """Thread-safe: `note` from the heartbeat thread, `take` from the observer's."""

    def __init__(self, spacing: float = SPACING) -> None:
        self.spacing = spacing
        self._lock = threading.Lock()
        self._points: dict[int, list[list[float]]] = {}

    def note(self, rank: int, t: float, committed_step: int) -> None:
        """The rank's committed step changed to `committed_step` at `t`."""
        if committed_step < 0:
            return
        with self._lock:
            pts = self._points.setdefault(rank, [])
            if len(pts) > 1 and t - pts[-2][0] < self.spacing:
                pts[-1] = [t, committed_step]  # within the spacing: the newest stands for it
            else:
                pts.append([t, committed_step])

    def take(self) -> dict | None:
        """The points since the last call as a `steps` record's fields; None when there are
        none."""
        with self._lock:
            points, self._points = self._points, {}
        points = {r: p for r, p in points.items() if p}
        if not points:
            return None
        t0 = min(p[0][0] for p in points.values())
        return {
            "t0": round(t0, 4),
            "ranks": {
                str(r): [[round(t - t0, 3), int(s)] for t, s in pts]
                for r, pts in sorted(points.items())
            },
        }
