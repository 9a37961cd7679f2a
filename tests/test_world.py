"""The world record: who gets which group rank (rendezvous.nodes.world.build_world)."""

from __future__ import annotations

from rendezvous.nodes.keys import Registration
from rendezvous.nodes.world import build_world


def reg(name: str, slot: int, hosts_store: bool = False, prev_rank: int = -1) -> Registration:
    return Registration(
        nonce=name,
        host=name,
        pid=1,
        local_world_size=2,
        slot=slot,
        hosts_store=hosts_store,
        prev_rank=prev_rank,
    )


def order(world: dict) -> list[str]:
    return [n["nonce"] for n in world["nodes"]]


def test_dynamic_ranks_follow_arrival_with_the_store_host_first() -> None:
    # the store host arrived second: it still takes group rank 0 (it runs the controller, so
    # losing another node never loses the controller with the embedded store)
    w = build_world([reg("a", 0), reg("host", 1, hosts_store=True), reg("c", 2)], False, "r")
    assert order(w) == ["host", "a", "c"]
    assert [n["rank_base"] for n in w["nodes"]] == [0, 2, 4] and w["world_size"] == 6
    # etcd: nobody hosts the store, arrival order
    assert order(build_world([reg("b", 1), reg("a", 0)], False, "r")) == ["a", "b"]


def test_survivors_of_the_previous_round_keep_their_group_ranks() -> None:
    w = build_world(
        [
            reg("new-host", 0, hosts_store=True),
            reg("s1", 2, prev_rank=1),
            reg("s0", 1, prev_rank=0),
        ],
        False,
        "r",
    )
    assert order(w) == ["s0", "s1", "new-host"]
