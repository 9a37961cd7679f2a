"""Elastic training inside a rank: the world after a live shrink (or its grow back), and the
global batch kept.

Owns: `ElasticView` (the current world's ranks, size and this rank's place in it; whether a
world admits this rank; the data parallel size; which micro-batches of each step this rank
computes) and `micro_batches`, the pure rule for the last.

A live shrink (the controller's `elastic-training` strategy, launcher.control.shrink) removes
whole data-parallel replicas: the survivors keep their processes and their original rank
numbers (`rt.rank`), rebuild the default group over `members` (group rank = position in it) and
go on at the interrupted step. To keep the global batch, each step still consumes the
original number of micro-batches (`original_dp_size`): the lost replicas' micro-batches are
dealt round-robin to the survivors, which accumulate their gradients (several backward passes)
before `rt.allreduce_gradients`, whose average divides by `original_dp_size`. The data position
is global: micro-batch j of step s is the same samples whoever computes it.

The grow back (launcher.control.grow) is a round at a step boundary whose plan names the full
world again: every rank rebuilds the default group over it, `micro_batches` is `[rank]` again
and the listeners hear `resized(old, new)` with new > old; a returning rank (a replacement) that
a round's world does not admit ends (`RecoveryRound`), the others stay in their world.
"""

from __future__ import annotations

from typing import Callable, Sequence

from launcher.runtime.rank_state import RankLinks, RankState


def micro_batches(replicas: Sequence[int], members: Sequence[int], rank: int) -> list[int]:
    """The micro-batch indices `rank` computes in each step: its own (its position among the
    original `replicas`), then those of the replicas not in `members`, dealt round-robin over
    the surviving replicas in order. Every index 0..len(replicas)-1 goes to exactly one rank."""
    order = list(replicas)
    alive = [r for r in order if r in members]
    if rank not in alive:
        raise ValueError(f"rank {rank} is not a member of the world {list(members)}")
    lost = [j for j, r in enumerate(order) if r not in members]
    me = alive.index(rank)
    return [order.index(rank)] + [j for k, j in enumerate(lost) if k % len(alive) == me]


class ElasticView:
    """What the runtime tells the training script about the world it is in now."""

    def __init__(self, state: RankState, links: RankLinks) -> None:
        self._state = state
        self._links = links
        # called with (old world size, new world size) after a live shrink rebuilt the groups
        self.listeners: list[Callable[[int, int], None]] = []

    @property
    def members(self) -> list[int]:
        """The ranks of the current world (original numbers, in group-rank order)."""
        return list(self._state.members) or list(range(self._links.env.world_size))

    @property
    def size(self) -> int:
        return len(self._state.members) or self._links.env.world_size

    @property
    def group_rank(self) -> int:
        """This rank's number in the current default group."""
        members = self._state.members
        return members.index(self._links.rank) if members else self._links.rank

    def torch_rank(self, rank: int) -> int:
        """torch's global rank of `rank` (an original number) in the current world: its place
        in `members` (the number itself until a live shrink)."""
        members = self._state.members
        if not members:
            return rank
        if rank not in members:
            raise ValueError(f"rank {rank} is not in the current world {list(members)}")
        return members.index(rank)

    def admits(self, ranks: Sequence[int]) -> bool:
        """Whether this rank is in the world `ranks` (a repair plan's `world`; empty: every
        rank of the job)."""
        return not ranks or self._links.rank in ranks

    def set_members(self, ranks: Sequence[int]) -> None:
        """The next world's ranks (a repair plan's `world`; empty: every rank of the job)."""
        members = tuple(ranks)
        if members and self._links.rank not in members:
            raise RuntimeError(f"rank {self._links.rank} is not in the new world {list(members)}")
        if members == tuple(range(self._links.env.world_size)):
            members = ()
        self._state.members = members

    def _replicas(self) -> tuple[int, ...]:
        return self._state.layout.replicas(self._links.rank)

    @property
    def original_dp_size(self) -> int:
        """Data-parallel replicas of this rank's state when the job started."""
        return len(self._replicas())

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas of this rank's state in the current world."""
        members = self._state.members
        return sum(1 for r in self._replicas() if not members or r in members)

    @property
    def micro_batches(self) -> list[int]:
        members = self._state.members or tuple(range(self._links.env.world_size))
        return micro_batches(self._replicas(), members, self._links.rank)

    def resized(self, old: int) -> None:
        """The groups of a smaller (or larger) world are built: tell the listeners."""
        new = self.size
        self._links.log(
            f"world resized: {old} -> {new} ranks (members {self.members}); data parallel "
            f"{self.dp_size} of {self.original_dp_size} replicas, this rank computes "
            f"micro-batches {self.micro_batches} of each step"
        )
        for listener in list(self.listeners):
            listener(old, new)
