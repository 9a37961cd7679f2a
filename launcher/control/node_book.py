"""The controller's book of nodes: which are lost, and which agent holds each node.

Owns: `NodeBook` (any thread: the leader agent's membership news and the controller's own): the
lost nodes (their agent is gone: they take part in no restart barrier) with when each was lost
and its `node-lost` fault (its node_replace_timeout runs from then), the agent incarnation of
each node the controller has accounted for, and reporting a loss (`note_node`, first news only)
or an arrival (`note_arrival`: a hot spare or replacement agent holds the node now; once per
incarnation) as a fault, ordered with the ranks' own reports.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from launcher.control import fault_intake
from launcher.control.controller_settings import ControllerHooks, ControllerSettings
from launcher.control.controller_state import ControllerState
from launcher.control.decision import node_loss_outlook
from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from launcher.protocol.faults import FaultKind
from rendezvous.kv import KVStore


class NodeBook:
    def __init__(
        self,
        kv: KVStore,
        log: AgentLog,
        settings: ControllerSettings,
        hooks: ControllerHooks,
        state: ControllerState,
        save: Callable[[], None],
    ) -> None:
        self.kv, self.log, self.settings, self.hooks = kv, log, settings, hooks
        self.state = state  # the generation a report names
        self.save = save  # the controller's state for a successor
        self.lock = threading.Lock()
        self.lost_nodes: set[int] = set()  # nodes whose agent is gone: they cannot stop workers
        self.lost_at: dict[int, tuple[float, P.Fault]] = {}  # lost node -> (when, its fault)
        self.known: dict[int, int] = {}  # node -> agent incarnation accounted for
        self.arriving: set[tuple[int, int]] = set()  # (node, incarnation) being reported now
        self.aware: Callable[[], bool] | None = None  # every rank uses the runtime (the decider's)

    def live_nodes(self) -> int:
        with self.lock:
            return self.settings.nnodes - len(self.lost_nodes)

    def note_node(self, node: int, lost: bool, why: str = "", host: str = "") -> None:
        """Membership news (any thread): a lost node cannot take part in a restart barrier; its
        loss is reported as a `node-lost` fault (first news of it only), its deadline for a
        replacement starts."""
        with self.lock:
            if not lost:
                self.lost_nodes.discard(node)
                self.lost_at.pop(node, None)
                return
            first = node not in self.lost_nodes
            self.lost_nodes.add(node)
        if not first:
            return
        fault = P.Fault(
            kind=FaultKind.NODE_LOST.value,
            rank=None,
            node=node,
            generation=self.state.generation,
            message=why or "its agent is gone",
            host=host,
            evidence={"node_lost": why or True, "node_ranks": self.settings.ranks_of(node)},
        )
        with self.lock:
            self.lost_at[node] = (time.monotonic(), fault)
        seq = fault_intake.post_fault(self.kv, fault)
        self.save()
        self.log.info(
            "fault-reported",
            f"node {node} lost ({fault.message}): reported as fault #{seq}; "
            + self.outlook(fault.evidence["node_ranks"]),
            seq=seq,
            lost_node=node,
        )

    def outlook(self, ranks: list[int], lost: int | None = None) -> str:
        """What the lost node's ranks do next, in words (the rule `decide` applies); `lost`: a
        node lost but not noted yet (counted out of the nodes left)."""
        s = self.settings
        with self.lock:
            nodes_left = s.nnodes - len(self.lost_nodes | ({lost} if lost is not None else set()))
        return node_loss_outlook(
            s.chain,
            ranks,
            s.node_replace_timeout,
            None if self.aware is None else self.aware(),
            nodes_left,
            s.fewest_nodes,
        )

    def note_arrival(
        self, node: int, incarnation: int, host: str = "", why: str = ""
    ) -> int | None:
        """A hot spare or replacement agent (agent incarnation `incarnation`; 0 when unknown)
        holds `node` now: report its arrival, the round that starts the node's ranks. Once per
        incarnation; returns the fault's number, None when already reported."""
        key = (node, incarnation)
        with self.lock:  # checked and claimed at once: the takeover's reconcile and the
            # membership watch may both bring the same arrival (one report, one round)
            if incarnation and (
                key in self.arriving
                or (self.known.get(node) == incarnation and node not in self.lost_nodes)
            ):
                return None
            if incarnation:
                self.arriving.add(key)
        try:
            seq = self._post_arrival(node, incarnation, host, why)
        finally:
            with self.lock:
                self.arriving.discard(key)
        self.log.info(
            "fault-reported",
            f"node {node} taken over (incarnation {incarnation}"
            + (f", {why}" if why else "")
            + f"): reported as fault #{seq}",
            seq=seq,
            joined_node=node,
        )
        self.save()
        return seq

    def _post_arrival(self, node: int, incarnation: int, host: str, why: str) -> int:
        """Report the arrival; the node is accounted for once its report is in the store."""
        if self.hooks.fence is not None:
            self.hooks.fence(P.FAULT_SEQ)
        msg = f"hot spare or replacement agent for node {node}" + (f" ({why})" if why else "")
        seq = fault_intake.post_fault(
            self.kv,
            P.Fault(
                kind=FaultKind.NODE_LOST.value,
                rank=None,
                node=node,
                generation=self.state.generation,
                message=msg,
                host=host,
                evidence={
                    "node_joined": True,
                    "node_ranks": self.settings.ranks_of(node),
                    "incarnation": incarnation,
                },
            ),
        )
        with self.lock:
            if incarnation:
                self.known[node] = incarnation
            self.lost_nodes.discard(node)
            self.lost_at.pop(node, None)
        return seq

    def overdue(self, now: float) -> tuple[list[tuple[int, float, P.Fault]], int]:
        """The lost nodes whose node_replace_timeout ran out (node, lost at, its fault), taken
        off the book's deadlines (each is decided once), and how many nodes are live."""
        timeout = self.settings.node_replace_timeout
        with self.lock:
            late = [(n, at, f) for n, (at, f) in self.lost_at.items() if now - at >= timeout]
            for n, _, _ in late:
                del self.lost_at[n]
            return late, self.settings.nnodes - len(self.lost_nodes)

    def waiting_for_node(self, missing: list[int]) -> bool:
        """True when every rank in `missing` is on a lost node that may still be taken over."""
        with self.lock:
            waiting = {r for n in self.lost_at for r in self.settings.ranks_of(n)}
        return bool(missing) and set(missing) <= waiting

    def snapshot(self) -> tuple[dict[int, dict], dict[int, int]]:
        """For the saved state: lost node -> {"at": unix time, "fault": json}, and known."""
        with self.lock:
            lost = {
                n: {"at": time.time() - (time.monotonic() - at), "fault": f.to_json().decode()}
                for n, (at, f) in self.lost_at.items()
            }
            return lost, dict(self.known)

    def restore(self, lost: dict[int, dict], known: dict[int, int]) -> None:
        """From a saved state of this world: the lost nodes (their deadlines run on) and the
        incarnations accounted for."""
        now_wall, now = time.time(), time.monotonic()
        with self.lock:
            self.known = dict(known)
            for node, rec in lost.items():
                fault = P.Fault.from_json(rec["fault"])
                self.lost_nodes.add(node)
                self.lost_at[node] = (now - max(0.0, now_wall - float(rec["at"])), fault)
