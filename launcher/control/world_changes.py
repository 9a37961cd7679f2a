"""Changes of the world itself: shrinking without a lost node, growing with waiting agents.

Owns: `WorldChanges`. A lost node not taken over within node_replace_timeout (`unreplaced`,
once per loss) is decided by `decision.unreplaced`: the world shrinks (live with
elastic-training: event `node-shrink`; else restart-all in a new rendezvous round without the
node) or the job ends with the reason (below --nnodes MIN, no restart-all in the chain, no
budget, a static rendezvous: it cannot renumber the nodes). A live shrink of a lost node that
cannot be made (`without_live_shrink`: the survivors cannot continue in a smaller world, no
replica left) takes the restart-all way instead. With
`--rdzv-conf scale_up=restart` (torchrun's behaviour), agents waiting to get in grow the world
(`scale_up`, `decision.scale_up`: restart-all in a new round that includes them). Either way
`regroup` opens the new rendezvous round first (`ControllerHooks.new_round`, so every agent that
reads the plan finds it), then publishes the plan that sends the agents into it; the round
enters REGROUPING: this world ends, a new controller starts on the new world's leader.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from launcher.control.controller_settings import ControllerHooks, ControllerSettings
from launcher.control.decision import Decision, Situation, scale_up, unreplaced
from launcher.control.node_book import NodeBook
from launcher.control.round_phase import RoundTracker
from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from rendezvous.errors import RendezvousError

STATIC_RENDEZVOUS = (
    "a static rendezvous (--node-rank) cannot renumber the nodes; restart the lost "
    "node's agent with the same --node-rank, or use --rdzv-backend c10d|etcd"
)


class WorldChanges:
    def __init__(
        self,
        log: AgentLog,
        settings: ControllerSettings,
        hooks: ControllerHooks,
        nodes: NodeBook,
        rounds: RoundTracker,
        situation: Callable[[], Situation],
        publish: Callable[[Decision, int], P.Plan],
    ) -> None:
        self.log, self.settings, self.hooks = log, settings, hooks
        self.nodes, self.rounds = nodes, rounds
        self.situation, self.publish = situation, publish
        # scale_up=restart: how many agents wait to get in (None: they wait as hot spares, or
        # the world cannot grow: a static rendezvous, or a new round that could not start)
        self.waiting = hooks.waiting if hooks.new_round is not None else None

    def overdue(self) -> Decision | None:
        """The decision that cannot wait for the next fault: a lost node's timeout, or agents
        waiting to get in; None when there is none."""
        return self.unreplaced() or self.scale_up()

    def unreplaced(self) -> Decision | None:
        """The decision for a lost node not taken over within node_replace_timeout (once)."""
        now = time.monotonic()
        if self.rounds.regrouping:
            return None
        late, left = self.nodes.overdue(now)
        if not late:
            return None
        node, at, fault = min(late, key=lambda x: x[1])
        s = self.settings
        d = unreplaced(
            fault,
            now - at,
            s.node_replace_timeout,
            left,
            s.fewest_nodes,
            self.situation(),
            s.nnodes,
            "" if self.hooks.new_round is not None else STATIC_RENDEZVOUS,
        )
        if d.absorbed:
            self.log.info("node-not-replaced", d.reason, lost_node=node)
            return None
        if d.strategy == P.ELASTIC:
            self.log.warning(
                "node-shrink",
                d.reason,
                lost_node=node,
                reason=fault.message,
                strategy=d.strategy,
                nodes_left=left,
                waited_s=round(now - at, 3),
                node_replace_timeout=s.node_replace_timeout,
            )
        elif d.shrink:
            self.log.warning(
                "world-shrink",
                d.reason,
                lost_node=node,
                reason=fault.message,
                strategy=d.strategy,
                nodes_left=left,
                world_size=s.world_size,
                new_world_size=len(d.restart_ranks),
                waited_s=round(now - at, 3),
                node_replace_timeout=s.node_replace_timeout,
            )
        else:
            self.log.error("node-not-replaced", d.reason, lost_node=node, strategy=d.strategy)
        return d

    def without_live_shrink(self, fault: P.Fault, why: str) -> Decision:
        """A lost node's live shrink that cannot be made (`why`): the world shrinks by
        restart-all in a new rendezvous round without the node, or the job ends (one line)."""
        s = self.settings
        with self.nodes.lock:
            at = self.nodes.lost_at.pop(fault.node, (time.monotonic(), fault))[0]
        d = unreplaced(
            fault,
            time.monotonic() - at,
            s.node_replace_timeout,
            self.nodes.live_nodes(),
            s.fewest_nodes,
            self.situation(),
            s.nnodes,
            "" if self.hooks.new_round is not None else STATIC_RENDEZVOUS,
            live=False,
        )
        d = dataclasses.replace(d, reason=f"node {fault.node}: {why}; {d.reason}", continues=True)
        self.log.error("node-shrink-refused", d.reason, lost_node=fault.node, strategy=d.strategy)
        return d

    def scale_up(self) -> Decision | None:
        """scale_up=restart: a new round for the agents waiting to get in (once per world)."""
        if self.waiting is None or self.rounds.regrouping:
            return None
        nodes = self.nodes.live_nodes()
        if nodes >= self.settings.most_nodes:
            return None
        d = scale_up(
            self.waiting(),
            nodes,
            self.settings.most_nodes,
            self.settings.ranks_per_node,
            self.rounds.round,
        )
        if d is not None:
            self.log.warning(
                "world-grow",
                d.reason,
                strategy=d.strategy,
                nodes=nodes,
                world_size=self.settings.world_size,
            )
        return d

    def regroup(self, decision: Decision) -> Decision | None:
        """Restart-all in a new world (without the lost nodes, or with the waiting ones): open
        the new rendezvous round first (so every agent that reads the plan finds it), then
        publish the plan that sends them into it. The agents stop their workers, rejoin, and
        restart every worker in the new world; a new controller starts on the new leader (this
        one is stopped with its world). Returns the exit that follows a shrink whose round
        could not start."""
        assert self.hooks.new_round is not None and decision.cause is not None
        try:
            rnd = self.hooks.new_round()
        except RendezvousError as e:
            if decision.grow:  # the world goes on as it is
                self.log.error("world-grow", f"the new rendezvous round could not start: {e}")
                self.waiting = None
                return None
            return dataclasses.replace(
                decision,
                strategy=P.EXIT,
                shrink=False,
                charged=False,
                restart_ranks=(),
                reason=f"{decision.reason}; but the new rendezvous round could not start: {e}",
            )
        self.rounds.regroup()
        self.publish(decision, rnd)
        return None
