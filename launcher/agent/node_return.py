"""A replacement agent (a hot spare, or the node's agent restarted) for a lost node: whether it
starts its ranks in the round of its arrival, or brings them back through the live grow back.

Owns: `dropped_here` (which of this node's ranks are out of the world: a live shrink dropped
them, as the controller's saved state says, or the latest plan is the live shrink that drops
them), `enter_as_replacement` (what a replacement agent does when it joined: its ranks out of
the world get returning processes at once, as after a one-rank live shrink
(`grow_back.ReturningRanks.rejoin`), and the agent is an ordinary member from then on; else it
awaits the round of its arrival, which starts its ranks) and `concerns_replacement` (whether a
plan published while it awaits that round is for it: its arrival's round, or the live shrink
that drops every rank of its node, after which its ranks return through the grow back), and
`nodes_out` (the nodes a live shrink dropped whole: the job's end barrier does not wait for
them), and the end of such an agent that cannot bring its ranks back: with `elastic_grow=0`
it ends when it joins, and when the job's embedded store stops answering while every rank of
its node is still out of the world (`ranks_out`, `end_out_of_world`: the job ended without
them) it stops its returning processes and ends; both as the hot spare of a finished job does
(`RendezvousGracefulExit`: one `spare-done` line, exit 0).

The controller absorbs such an arrival (`decision.out_of_world`: no round starts the ranks of a
node that left the world) and grows the world back once the returning processes posted their
statuses (launcher.control.grow), across hosts as on one node.
"""

from __future__ import annotations

import signal
from typing import Callable, Sequence

from launcher.agent.agent_state import AgentPhase, AgentState
from launcher.agent.store_stack import AgentWorld
from launcher.control import controller_state as CS
from launcher.protocol import plan as P
from launcher.workers.workers import stop_workers
from rendezvous.errors import STORE_UNREACHABLE, NodeLostError, RendezvousGracefulExit
from rendezvous.kv import KVStore


def dropped_here(kv: KVStore, ranks: Sequence[int], generation: int, world_round: int) -> list[int]:
    """This node's `ranks` when every one of them is out of the world (in the controller's
    saved record of this world's dropped ranks, or failed by the live shrink that is the latest
    plan, generation `generation`); [] otherwise (they start in the round of the arrival)."""
    gone: set[int] = set()
    saved = CS.load(kv)
    if saved is not None and saved.world_round == world_round:
        gone.update(saved.dropped)
    raw = kv.try_get(P.plan_key(generation)) if generation > 0 else None
    if raw is not None:
        plan = P.Plan.from_json(raw)
        if plan.strategy == P.ELASTIC:
            gone.update(plan.failed_ranks)
        elif plan.strategy == P.RESTART_ALL:
            gone.clear()  # every rank of the job starts again
    return sorted(ranks) if ranks and set(ranks) <= gone else []


def nodes_out(kv: KVStore, nodes: int, per_node: int, world_round: int) -> int:
    """How many of this world's `nodes` (of `per_node` ranks each) a live shrink dropped
    whole (the controller's saved state): the job's end barrier does not wait for them (no
    agent, or one whose ranks never run again)."""
    saved = CS.load(kv)
    if saved is None or saved.world_round != world_round or not saved.dropped:
        return 0
    gone = set(saved.dropped)
    return sum(1 for n in range(nodes) if set(range(n * per_node, (n + 1) * per_node)) <= gone)


def concerns_replacement(plan: P.Plan, node: int, ranks: Sequence[int]) -> bool:
    """Whether `plan`, published while the replacement agent of `node` (its `ranks`) awaits
    its round, is for it: its arrival's round, or the live shrink that drops its ranks."""
    cause = plan.root_cause or {}
    if cause.get("evidence", {}).get("node_joined") and cause.get("node") == node:
        return True
    return plan.strategy == P.ELASTIC and bool(ranks) and set(ranks) <= set(plan.failed_ranks)


def enter_as_replacement(
    s: AgentState, world: AgentWorld, report_arrival: Callable[[int], None]
) -> None:
    """A replacement agent joined `world` as node `world.group_rank`: bring its dropped ranks
    back (returning processes for the next generation), or await the round of its arrival."""
    assert s.kv is not None and s.executor is not None
    ranks = sorted(w.rank for w in s.workers.all())
    back = dropped_here(s.kv, ranks, s.generation, s.stack.world_round())
    if back and not s.executor.returning.enabled:
        raise RendezvousGracefulExit(  # the agent's one line (`spare-done`), exit 0
            f"replacement agent for node {world.group_rank}: its ranks {back} left the world "
            "in a live shrink and elastic_grow=0 keeps the world shrunk: they are no longer "
            "in the world"
        )
    if back:
        s.enter(AgentPhase.RUNNING)
        s.log.warning(
            "rejoined",
            f"replacement agent for node {world.group_rank}: its ranks {back} left the world "
            "in a live shrink; they return through the live grow back (generation "
            f"{s.generation + 1})",
            returning=back,
        )
        s.executor.returning.rejoin(back, s.generation + 1)
    else:
        s.enter(AgentPhase.AWAITING_ROUND)
        s.log.warning(
            "rejoined",
            f"replacement agent for node {world.group_rank}: "
            f"waiting for generation {s.generation + 1}",
        )
    if s.controller is not None:
        # It took over the leader's node and runs the controller itself: no other agent
        # reports its arrival, so it does (else no round would ever start its ranks).
        report_arrival(world.group_rank)


def ranks_out(s: AgentState) -> list[int]:
    """This node's ranks when every one of them is out of the world (dropped by a live shrink,
    none taken back by a grow in progress); [] otherwise."""
    ranks = {w.rank for w in s.workers.all()}
    growing = s.executor.returning.growing if s.executor is not None else set()
    if not ranks or not ranks <= s.workers.left or ranks & growing:
        return []
    return sorted(ranks)


def end_out_of_world(s: AgentState, err: NodeLostError | None) -> None:
    """This agent lost its membership (`err`): when every rank of its node is out of the
    world and the job's embedded store stopped answering (the job ended: its store host left),
    it has nothing to come back to: its returning processes are stopped and it ends as the
    hot spare of a finished job does (RendezvousGracefulExit: one line, exit 0). Else nothing
    (the agent self-fences and rejoins as usual)."""
    out = ranks_out(s)
    if not out or err is None or err.kind != STORE_UNREACHABLE or s.stack.can_elect:
        return
    stop_workers(s.workers.all(), signal.SIGKILL, 0.0)  # returning processes, if any
    raise RendezvousGracefulExit(
        f"node {s.world.group_rank if s.world is not None else '?'}: its ranks {out} are no "
        "longer in the world (a live shrink dropped them, no grow took them back) and the "
        f"job's store stopped answering: the job ended without them ({err})"
    )
