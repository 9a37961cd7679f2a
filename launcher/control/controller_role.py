"""Which agent runs the controller, and the handoff when its node is lost.

Owns: `ControllerRole`, this agent's part in the controller role for one world. On the embedded
store (static/c10d) the controller runs on the leader node (group rank 0 at join) and stays
there: losing that node loses the store too, which ends the job (`StoreHostLostError`). With
etcd every agent runs for controller (`rendezvous.nodes.election`, lease-bound key): the first one
elected starts it; when the controller's node is lost (its lease expired: crashed or cut off)
or left, the key vanishes, another agent is elected and starts a controller that goes on from
the store (generation, restart budget, next fault, fault history, lost nodes and the round in
progress; `launcher.control.controller`). The new controller is installed before it looks at the
membership (`Controller.reconcile`: nodes lost, and nodes a hot spare took over, while no
controller ran), so membership news from then on reaches it and nothing falls in between; then
it starts. One log line per handoff names the node lost, why, and who takes over. A deposed
controller (its own lease expired) stops; its agent self-fences.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from launcher.control.controller import Controller
from launcher.observe.logs import AgentLog
from rendezvous.errors import RendezvousError
from rendezvous.kv import StoreError


class ControllerRole:
    """`start(is_leader)` after join; `controller` is the running Controller or None; `stop()`."""

    def __init__(
        self, log: AgentLog, stack: Any, build: Callable[[], Controller], group_rank: int, host: str
    ) -> None:
        self.log = log
        self.stack = stack  # launcher.agent.store_stack.StoreStack
        self._build = build
        self.group_rank = group_rank
        self.host = host
        self._lock = threading.Lock()
        self._controller: Controller | None = None
        self._election: Any = None
        self._stopped = False

    @property
    def controller(self) -> Controller | None:
        with self._lock:
            return self._controller

    @property
    def elected(self) -> bool:
        """True when the role is decided by election (etcd)."""
        return self._election is not None

    def start(self, is_leader: bool) -> None:
        if self.stack.can_elect:
            self._election = self.stack.elect(self._on_elected, self._on_deposed)
        elif is_leader:
            self._take(self._build(), self.stack.members(), [])

    def stop(self) -> None:
        """Stop the controller (the election ends with the membership). Idempotent."""
        with self._lock:
            self._stopped = True
            c, self._controller = self._controller, None
        if c is not None:
            c.stop()

    # ------------------------------------------------------------------ election callbacks
    def _on_elected(self) -> None:
        """Election thread: this agent is the controller now."""
        prev = self._election.previous if self._election is not None else None
        me = f"node {self.group_rank} ({self.host})"
        if prev is None:
            self.log.info(
                "controller-elected",
                f"{me} is the controller (elected)",
                controller=self.group_rank,
            )
        else:
            node, inc = int(prev.get("group_rank", -1)), int(prev.get("incarnation", 0))
            why = self.stack.why_gone(node, inc)
            self.log.warning(
                "controller-takeover",
                f"the controller's node {node} "
                f"({prev.get('host', '?')}) is lost: {why}; {me} takes over as "
                "controller (elected)",
                lost_node=node,
                reason=why,
                controller=self.group_rank,
            )
        self._take(self._build(), None, None)

    def _on_deposed(self) -> None:
        """Election thread: this agent's lease expired while it was the controller."""
        self.log.error(
            "controller-deposed",
            f"node {self.group_rank} is no longer the "
            "controller (its lease expired); its controller stops",
            controller=self.group_rank,
        )
        with self._lock:
            c, self._controller = self._controller, None
        if c is not None:
            c.stop()

    def _take(self, c: Controller, members: dict[int, int] | None, lost: list[int] | None) -> None:
        """Install `c` (membership news reaches it from here on), reconcile it with the
        membership now (read after installing: a join in between is reported either way, once
        per incarnation), then start it. `None`: ask the store stack."""
        with self._lock:
            if self._stopped:
                return
            self._controller = c
        try:
            c.reconcile(
                self.stack.members() if members is None else members,
                self.stack.lost_nodes() if lost is None else lost,
            )
        except (StoreError, RendezvousError) as e:  # it starts anyway: its own writes are fenced
            self.log.error(
                "controller",
                f"node {self.group_rank}: the membership was not "
                f"compared with the previous controller's state: {e}",
                controller=self.group_rank,
            )
        c.start()
