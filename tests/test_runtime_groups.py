"""launcher.runtime.groups: user groups rebuilt over the ranks still in the world after a live
shrink (handles re-pointed, members renumbered for torch) and over every rank after the grow
back. One real process in a gloo world of one rank (the survivor of a world of 2)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from launcher.runtime.groups import GroupHandle, GroupRegistry


def test_groups_are_rebuilt_over_the_members_left_and_back() -> None:
    world = {"members": [0, 1]}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        registry = GroupRegistry(0, 2, "gloo", lambda: world["members"])
        world["members"] = [0]  # created in a world a live shrink left with rank 0 alone
        dp = registry.create("dp", [[0, 1]], generation=1)
        other = registry.create("other", [[0], [1]], generation=1)
        assert (dp.ranks, dp.size, dp.original_size) == ([0], 1, 2)
        assert dp.group is not None and dist.get_world_size(dp.group) == 1
        t = torch.ones(1)
        dist.all_reduce(t, group=dp.group)
        assert t.item() == 1.0  # a working one-rank group
        assert other.ranks == [0] and other.group is not None  # the group of rank 1 not built
        world["members"] = [0, 1]  # the grow back: every member again (built in a real world)
        assert [h.name for h in registry.handles()] == ["dp", "other"]
    finally:
        dist.destroy_process_group()


def test_a_handle_remembers_its_original_size() -> None:
    h = GroupHandle("tp", [2, 3])
    assert (h.size, h.original_size, h.rank_of(3)) == (2, 2, 1)
    h.ranks = [2]  # a live shrink left one member
    assert (h.size, h.original_size) == (1, 2)
