"""Membership news about other nodes, as the agent hears it on the membership thread.

Owns: what the agent does when membership says a node was lost (`on_node_lost`: logged with
who takes its ranks over, and told to the controller when this agent runs it), left on purpose
(`on_node_left`: a signal, i.e. preemption, is a loss; done or a new round is not) or was taken
over by a hot spare or a replacement agent (`on_node_joined`, `report_arrival`: the controller
starts the round that starts its ranks; when it cannot be told at once the arrival goes to the
fault reporter, which retries it off the loop). Handled on the membership thread, not in the
main loop, which may be waiting on a round that this very news holds up.
"""

from __future__ import annotations

from launcher.agent.agent_state import AgentState
from launcher.control.decision import node_loss_outlook
from launcher.protocol import plan as P
from launcher.protocol.faults import FaultKind
from rendezvous.errors import FencedError
from rendezvous.kv import StoreError
from rendezvous.nodes.keys import LEAVE_SIGNAL


class MembershipNews:
    def __init__(self, state: AgentState) -> None:
        self.state = state

    def _loss_reason(self) -> str:
        """Why membership declares a node lost, in words: the liveness mechanism that saw it."""
        cfg = self.state.cfg
        t = cfg.rdzv_settings.liveness_timeout
        if cfg.store_backend == "etcd":
            return f"its etcd lease expired (TTL {t:g}s)"
        return f"no heartbeat for {t:g}s"

    def node_ranks(self, node: int) -> list[int]:
        n = self.state.cfg.nproc_per_node
        return list(range(node * n, (node + 1) * n))

    def on_node_left(self, node: int, reason: str) -> None:
        """A node left on purpose. Stopped by a signal (preemption): its ranks need a new home,
        as after a crash; any other reason (done, a new round) is not a loss."""
        if reason == LEAVE_SIGNAL and not self.state.stopping.is_set():
            self.on_node_lost(node, "its agent left on a signal (stopped or preempted)")

    def on_node_lost(self, node: int, why: str = "") -> None:
        s = self.state
        why = why or self._loss_reason()
        ranks, timeout = self.node_ranks(node), s.cfg.node_replace_timeout
        if s.controller is not None:  # the leader knows whether every rank uses the runtime
            who = s.controller.nodes.outlook(ranks, lost=node)
        else:
            who = node_loss_outlook(s.cfg.recover_strategy, ranks, timeout)
        if who.endswith("replacement agent"):
            who += " (same --node_rank), else the job falls back"
        s.log.error(
            "node-lost",
            f"node {node} lost ({why}): {who}",
            lost_node=node,
            reason=why,
            node_ranks=self.node_ranks(node),
        )
        if s.controller is not None:
            # Reported as a node-lost fault: survivors stop (runtime-aware jobs) and the
            # replacement's arrival starts the round that starts its ranks.
            s.controller.note_node(node, lost=True, why=why)

    def on_node_joined(self, node: int) -> None:
        self.state.log.warning(
            "node-joined",
            f"a hot spare or replacement agent took over node {node} "
            f"(ranks {self.node_ranks(node)})",
            joined_node=node,
        )
        self.report_arrival(node)

    def report_arrival(self, node: int) -> None:
        """Tell the controller a new agent holds `node`: the round that starts its ranks."""
        s = self.state
        c = s.controller
        if c is None:
            return  # no controller here: the one elected next finds the arrival (reconcile)
        try:
            c.note_arrival(node, s.stack.incarnation_of(node), host=s.host)
        except (FencedError, StoreError) as e:  # the reporter retries it, or refuses it if stale
            s.log.warning(
                "fault-report-retry",
                f"arrival of node {node} not reported yet ({e}); retrying off the loop",
                joined_node=node,
            )
            s.report(
                P.Fault(
                    kind=FaultKind.NODE_LOST.value,
                    rank=None,
                    node=node,
                    generation=s.generation,
                    message=f"hot spare or replacement agent for node {node}",
                    host=s.host,
                    evidence={"node_joined": True, "node_ranks": self.node_ranks(node)},
                )
            )
