"""The agent's care of its node's warm spares, every health check.

Owns: `tend_spares(state)`: keep the spare pool (`Spawner.keep_spare`) once the job is known to
use `launcher.runtime` (a rank said hello, or the spawner started the pool with the workers:
`FTRUN_SPARE_START`), and let a spare that became ready overtake a replacement still starting
cold (`Spawner.overtake`), as long as that one has not reached the agent: it said no hello and
has no connection open or pending on the worker channel.
"""

from __future__ import annotations

from launcher.agent.agent_state import AgentState
from launcher.workers.workers import Worker


def tend_spares(s: AgentState) -> None:
    """Keep the spares; a ready one takes the rank of a cold replacement (see the module)."""
    spawner, workers = s.spawner, s.workers.all()
    if spawner is None or not workers:
        return
    if s.workers.aware or spawner.pool_wanted:
        spawner.keep_spare(workers[0])
    channel = s.channel
    if spawner.cold and channel is not None:

        def connected(w: Worker, pid: int) -> bool:
            return w.rank in s.workers.aware or channel.connecting(pid)

        spawner.overtake(connected)
