"""User process groups that survive a rebuild.

Owns: the registry of every group a script created through the runtime (name -> rank lists,
in creation order) and the `GroupHandle`s given out for them. After a recovery round rebuilds
the default process group, `rebuild()` re-creates every registered group in the original order
(torch requires every rank to call new_group in the same order) and re-points each handle's
`.group`, so code that cached a handle keeps working. In a world a live shrink made smaller
(launcher.runtime.elastic) each group is built over its members still in the world (a group
left without any is not built), named to torch by their places in the world, and the handle's
`.ranks` are those members (original rank numbers); the grow back restores every member.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch.distributed as dist


@dataclass
class GroupHandle:
    """A named group this rank belongs to (or not). Read `.group` at use time, never cache it."""

    name: str
    ranks: list[int]  # the members of this rank's group ([] when it is in none)
    group: Any = None  # the torch ProcessGroup of the current generation
    generation: int = -1
    original_size: int = 0  # members when the group was created (0: `size`)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __post_init__(self) -> None:
        self.original_size = self.original_size or len(self.ranks)

    def rank_of(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)


@dataclass
class _Entry:
    name: str
    partition: list[list[int]]
    handle: GroupHandle = field(repr=False, default=None)  # type: ignore[assignment]


class GroupRegistry:
    """Creates groups (all ranks call in the same order) and rebuilds them per generation."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        backend: str,
        members: Callable[[], Sequence[int]] | None = None,
    ) -> None:
        self._rank = rank
        self._world = world_size
        self._backend = backend
        # the current world's ranks, in torch's order (a live shrink leaves fewer)
        self._members = members or (lambda: range(world_size))
        self._entries: list[_Entry] = []

    def _validate(self, name: str, partition: list[list[int]]) -> list[list[int]]:
        if any(e.name == name for e in self._entries):
            raise ValueError(f"process group name {name!r} is already registered")
        norm = [sorted(int(r) for r in ranks) for ranks in partition]
        flat = [r for ranks in norm for r in ranks]
        bad = [r for r in flat if not 0 <= r < self._world]
        if bad or len(set(flat)) != len(flat) or any(not ranks for ranks in norm):
            raise ValueError(
                f"group {name!r}: {partition!r} must be disjoint, non-empty lists of ranks "
                f"in 0..{self._world - 1}"
            )
        return norm

    def create(self, name: str, partition: list[list[int]], generation: int) -> GroupHandle:
        """Register a partition (one or more disjoint rank lists) and build it now."""
        norm = self._validate(name, partition)
        mine = next((ranks for ranks in norm if self._rank in ranks), [])
        entry = _Entry(name, norm, GroupHandle(name, mine))
        self._entries.append(entry)
        self._build(entry, generation)
        return entry.handle

    def rebuild(self, generation: int) -> None:
        for entry in self._entries:
            self._build(entry, generation)

    def _build(self, entry: _Entry, generation: int) -> None:
        place = {r: i for i, r in enumerate(self._members())}
        group, mine = None, []
        for ranks in entry.partition:
            alive = [r for r in ranks if r in place]
            if not alive:
                continue
            g = dist.new_group(ranks=[place[r] for r in alive], backend=self._backend)
            if self._rank in alive:
                group, mine = g, alive
        entry.handle.group = group
        entry.handle.ranks = mine
        entry.handle.generation = generation

    def handles(self) -> list[GroupHandle]:
        return [e.handle for e in self._entries]

    def get(self, name: str) -> GroupHandle:
        for e in self._entries:
            if e.name == name:
                return e.handle
        raise KeyError(
            f"no process group named {name!r}; created: {[e.name for e in self._entries]}"
        )

    def current_groups(self) -> list[Any]:
        return [e.handle.group for e in self._entries if e.handle.group is not None]
