"""What the controller is built with (launcher.control.controller_settings): the world's shape and
the node-count bounds derived from the settings."""

from __future__ import annotations

import dataclasses

import pytest

from launcher.control.controller_settings import ControllerHooks, ControllerSettings
from launcher.protocol import plan as P


def test_the_world_shape_maps_ranks_to_nodes_and_back() -> None:
    s = ControllerSettings(world_size=6, nnodes=3, max_restarts=1, chain=(P.EXIT,))
    assert s.ranks_per_node == 2
    assert [s.node_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert s.ranks_of(1) == [2, 3] and s.ranks_of(2) == [4, 5]


def test_node_bounds_default_to_the_world_and_the_chain_is_a_tuple() -> None:
    s = ControllerSettings(4, 2, 3, [P.RESTART_ALL, P.EXIT])  # a list from the config
    assert s.chain == (P.RESTART_ALL, P.EXIT)
    assert (s.fewest_nodes, s.most_nodes) == (2, 2)
    s = ControllerSettings(4, 2, 3, (P.EXIT,), min_nodes=1, max_nodes=4)
    assert (s.fewest_nodes, s.most_nodes) == (1, 4)
    assert ControllerSettings(4, 2, 3, (P.EXIT,), max_nodes=1).most_nodes == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.window = 1.0  # type: ignore[misc]


def test_no_hooks_means_a_static_world_with_no_fencing() -> None:
    h = ControllerHooks()
    assert (h.stale, h.fence, h.new_round, h.waiting) == (None, None, None, None)
