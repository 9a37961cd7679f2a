"""The world a rendezvous decides, as records: what every agent learns when it joins.

Owns: `NodeInfo` (one node: group rank, address, ranks it runs), `NodeWorld` (the result of
join for one agent), `SpareInfo` (a hot spare waiting for a vacancy), and the world's JSON form
under `keys.WORLD_KEY` (`build_world`, `node_world`). Nothing here talks to a store.

Group ranks: static worlds sort by node rank; dynamic worlds by arrival slot (so the first agent
to arrive is group rank 0). Rank bases follow group ranks. A replacement or a hot spare takes
over a lost node's group rank and rank base; survivors keep theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

from rendezvous.nodes.keys import Registration


@dataclass
class NodeInfo:
    """One node of the world. node_rank is its group rank; ranks [rank_base,
    rank_base + local_world_size) run on it. `host` is the address it registered with."""

    node_rank: int
    host: str
    pid: int
    local_world_size: int
    rank_base: int = 0
    incarnation: int = 0
    hosts_store: bool = False  # this node's agent hosts the embedded store


@dataclass
class NodeWorld:
    """The result of rendezvous as seen by one agent."""

    generation: int  # global generation when this agent joined (keys.GENERATION_KEY)
    group_rank: int
    group_world_size: int
    nodes: list[NodeInfo]
    world_size: int
    leader_node: int
    rejoined: bool = False  # True for a replacement agent that joined a running job
    run_id: str = ""
    from_spare: bool = False  # True when this agent waited as a hot spare first
    round: int = 0  # rendezvous round (a new one per scale-up restart; see rendezvous.nodes.rounds)

    @property
    def me(self) -> NodeInfo:
        return self.nodes[self.group_rank]

    def store_host(self) -> NodeInfo | None:
        """The node whose agent hosts the embedded store (None with etcd / unknown)."""
        return next((n for n in self.nodes if n.hosts_store), None)


@dataclass(frozen=True)
class SpareInfo:
    """A hot spare: an agent that arrived while the world was full and waits for a vacancy."""

    host: str
    pid: int
    local_world_size: int
    nonce: str

    @classmethod
    def from_registration(cls, r: Registration) -> "SpareInfo":
        return cls(r.host, r.pid, r.local_world_size, r.nonce)


def build_world(members: list[Registration], static: bool, run_id: str, round_: int = 0) -> dict:
    """The world JSON for `members` (static: by node rank; dynamic: survivors of the previous
    round by their old group rank, then the agent hosting the embedded store, then everyone
    else by arrival slot). The store host first: group rank 0 runs the controller, so with the
    embedded store the controller is lost only with the store (which ends the job anyway), never
    with another node whose ranks a spare could take over."""
    if static:
        members = sorted(members, key=lambda r: r.node_rank if r.node_rank is not None else -1)
    else:
        members = sorted(
            members, key=lambda r: (r.prev_rank < 0, r.prev_rank, not r.hosts_store, r.slot)
        )
    nodes, base = [], 0
    for gr, r in enumerate(members):
        nodes.append(
            {
                "node_rank": gr,
                "host": r.host,
                "pid": r.pid,
                "local_world_size": r.local_world_size,
                "rank_base": base,
                "incarnation": 1,
                "nonce": r.nonce,
                "hosts_store": r.hosts_store,
            }
        )
        base += r.local_world_size
    return {
        "run_id": run_id,
        "static": static,
        "nodes": nodes,
        "world_size": base,
        "leader_node": 0,
        "round": round_,
    }


def node_world(world: dict, group_rank: int, rejoined: bool, run_id: str) -> NodeWorld:
    """The `NodeWorld` of the agent holding `group_rank` in `world` (JSON form)."""
    nodes = [
        NodeInfo(
            n["node_rank"],
            n["host"],
            n["pid"],
            n["local_world_size"],
            n["rank_base"],
            n.get("incarnation", 1),
            bool(n.get("hosts_store")),
        )
        for n in world["nodes"]
    ]
    return NodeWorld(
        generation=0,
        group_rank=group_rank,
        group_world_size=len(nodes),
        nodes=nodes,
        world_size=world["world_size"],
        leader_node=world["leader_node"],
        rejoined=rejoined,
        run_id=world.get("run_id", run_id),
        round=int(world.get("round", 0)),
    )
