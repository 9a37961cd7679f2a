"""The job-wide restart budget (`--max_restarts`) as everyone counts it.

Owns: `restarts_left()`, the one rule for how many recovery rounds a job has left: the
controller's decisions (`launcher.control.decision.Budget`), the agent's metrics
(`launcher.observe.observer`) and `ftctl status` (`launcher.observe.status`) all use it. The
count of rounds used is the controller's, kept under `plan.RESTARTS_USED_KEY`.
"""

from __future__ import annotations


def restarts_left(used: int, limit: int) -> int:
    """Recovery rounds left of `limit` (`--max_restarts`) once `used` were charged; never < 0."""
    return max(0, limit - used)
