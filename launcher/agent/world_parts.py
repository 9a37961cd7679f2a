"""The parts of the world an agent has just joined: announced, then built.

Owns: `announce_world` (the lines that say which node of which world this agent is, and that a
hot spare took over a lost node), `announce_round` (the world of a new rendezvous round) and
`build_world_parts` (the world's spawner, with the worker environment of this world, and its
plan executor) and `world_feeds` (what the agent follows in it: the plans, `ftctl inject`
requests, the node's sub-health file). The agent (`launcher.agent.agent`) calls them each time
it enters a world: at start, after a new rendezvous round, after self-fencing.
"""

from __future__ import annotations

from typing import Any, Callable

from launcher.agent.agent_events import inject_feed, plan_feed
from launcher.agent.agent_state import AgentState
from launcher.agent.node_return import nodes_out
from launcher.agent.plan_executor import PlanExecutor
from launcher.agent.store_stack import AgentWorld
from launcher.agent.subhealth import SubhealthWatch
from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from launcher.workers.spawner import Spawner, WorkerWorld


def announce_world(s: AgentState, world: AgentWorld, master: tuple[str, int]) -> None:
    """Say which node of which world this agent is (and that it is a hot spare's)."""
    cfg, log, run_path = s.cfg, s.log, s.run_dir.path
    last_rank = world.rank_base + cfg.nproc_per_node - 1
    if world.from_spare:
        log.warning(
            "spare-takes-over",
            f"hot spare {s.host} takes over node "
            f"{world.group_rank} (ranks {world.rank_base}..{last_rank})",
            group_rank=world.group_rank,
        )
    log.node_rank = world.group_rank
    master_addr, master_port = master
    log.info(
        "rendezvous",
        f"node {world.group_rank}/{world.group_world_size}, "
        f"ranks {world.rank_base}..{last_rank} "
        f"of {world.world_size}; workers use store {master_addr}:{master_port}; "
        f"logs in {run_path}",
        group_rank=world.group_rank,
        world_size=world.world_size,
        master_port=master_port,
        log_dir=run_path,
    )


def build_world_parts(
    s: AgentState, world: AgentWorld, master: tuple[str, int], lost_error: Callable[[], Any]
) -> None:
    """The spawner and the plan executor of this world, into `s`; `lost_error`: why this agent
    lost its membership, None while a member (`StoreStack.lost_error`)."""
    assert s.kv is not None and s.channel is not None and s.reaper is not None
    master_addr, master_port = master
    s.spawner = Spawner(
        s.cfg,
        WorkerWorld(
            world.group_rank,
            world.group_world_size,
            world.world_size,
            master_addr,
            master_port,
            s.channel.path,
        ),
        s.run_dir,
        s.log,
        s.host,
        s.reaper,
        on_spawn=s.hangs.on_spawn,
        notices=s.notices,
    )
    s.executor = PlanExecutor(
        s.cfg,
        s.log,
        s.kv,
        world,
        s.workers,
        s.spawner,
        s.channel,
        s.failures,
        stop=s.stopping,
        dump=lambda w: s.hangs.dump(w, w.rank in s.workers.aware),
        store=s.loop_store,
        lost=lambda: lost_error() is not None,
        stop_sent=s.hangs.stop_sent,
    )
    kv, per_node, world_round = s.kv, s.cfg.nproc_per_node, s.stack.world_round()
    s.executor.nodes_out = lambda: nodes_out(kv, world.group_world_size, per_node, world_round)


def announce_round(log: AgentLog, plan: P.Plan, before: AgentWorld, world: AgentWorld) -> None:
    """The agent moved from world `before` to `world` in rendezvous round `plan.new_round`."""
    log.info(
        "round-joined",
        f"rendezvous round {plan.new_round}: node "
        f"{before.group_rank} -> {world.group_rank} of {world.group_world_size}, "
        f"world size {before.world_size} -> {world.world_size}",
        new_round=plan.new_round,
        old_group_rank=before.group_rank,
        group_rank=world.group_rank,
        world_size=world.world_size,
        old_world_size=before.world_size,
        nnodes=world.group_world_size,
    )


def world_feeds(s: AgentState, world: AgentWorld) -> list[Any]:
    """What the agent follows in `world` (each has start/stop): the controller's plans after
    its generation, `ftctl inject` requests, and its node's sub-health file when one is named
    (`--rdzv-conf subhealth_file`, launcher.agent.subhealth)."""
    assert s.kv is not None
    feeds: list[Any] = [plan_feed(s.kv, s.generation, s.events), inject_feed(s.kv, s.events)]
    if s.cfg.subhealth_file:
        feeds.append(
            SubhealthWatch(
                s.cfg.subhealth_file,
                s.kv,
                world.group_rank,
                world.rank_base,
                s.cfg.nproc_per_node,
                s.log,
            )
        )
    return feeds
