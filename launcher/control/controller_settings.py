"""What the controller is built with: the world it serves and the job's recovery settings.

Owns: `ControllerSettings` (frozen numbers and names: the world's shape, the restart budget, the
strategy chain, the timeouts of a round) and `ControllerHooks` (what the controller asks the
leader agent's membership: whether a report's writer is stale, whether its own agent still is a
member, a new rendezvous round, how many agents wait to get in). The agent fills both when it
builds a controller (`launcher.agent.agent`); tests build them directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ControllerSettings:
    """The world one controller serves and how it recovers it."""

    world_size: int  # ranks in this world
    nnodes: int  # nodes in this world (every node runs world_size // nnodes ranks)
    max_restarts: int  # --max_restarts: recovery rounds allowed for the whole job
    chain: tuple[str, ...]  # --recover-strategy: the strategies to try, cheapest first
    phase_timeout: float = 120.0  # s a round's phase waits for nodes or ranks (FTRUN_PHASE_TIMEOUT)
    window: float = 2.0  # s a report that may be a consequence is held for merging (fault window)
    node_replace_timeout: float = 600.0  # s a lost node may wait for a hot spare or replacement
    min_nodes: int | None = None  # --nnodes MIN: the fewest nodes to go on with (None: nnodes)
    max_nodes: int = 0  # --nnodes MAX: the most nodes scale_up=restart grows to (nnodes if fewer)
    transfer_stripes: int = 0  # senders per replacement; 0: one per node (AUTO_STRIPES)
    world_round: int = 0  # the rendezvous round of this world (its node numbering)

    def __post_init__(self) -> None:
        object.__setattr__(self, "chain", tuple(self.chain))  # a list from the config is fine

    @property
    def fewest_nodes(self) -> int:
        """--nnodes MIN: below this many nodes the world does not shrink, the job ends."""
        return self.nnodes if self.min_nodes is None else self.min_nodes

    @property
    def most_nodes(self) -> int:
        """--nnodes MAX: scale_up=restart grows the world up to this many nodes."""
        return max(self.max_nodes, self.nnodes)

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // max(1, self.nnodes)

    def node_of(self, rank: int) -> int:
        """The group rank (node) running global rank `rank` (the inverse of `ranks_of`)."""
        return rank // max(1, self.ranks_per_node)

    def ranks_of(self, node: int) -> list[int]:
        """The global ranks of group rank `node` (every node runs the same number)."""
        per = self.ranks_per_node
        return list(range(node * per, (node + 1) * per))


@dataclass(frozen=True)
class ControllerHooks:
    """The leader agent's membership, as the controller asks it. None: not available."""

    # why a report's writer (node, agent incarnation) is stale; "" when it is not
    stale: Callable[[int, int], str] | None = None
    # raises FencedError when this controller's own agent is stale (before each write named)
    fence: Callable[[str], None] | None = None
    # opens a new rendezvous round (Membership.request_round) and returns its number; None: the
    # rendezvous is static (node ranks fixed by --node-rank), the world cannot shrink or grow
    new_round: Callable[[], int] | None = None
    # scale_up=restart: how many agents wait to get in (None: they wait as hot spares); only
    # with new_round
    waiting: Callable[[], int] | None = None
