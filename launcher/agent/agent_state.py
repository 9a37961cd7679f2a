"""What one node agent knows and holds, shared by the parts of its event loop.

Owns: `AgentPhase`, the agent's phase (set by the agent, recorded in events.jsonl as `agent-phase`
records and read by its handlers), and `AgentState`, the agent's state and parts: its world and
generation, its workers, and the parts built for the world it is in (spawner, plan executor,
controller role) or once at start (channel, reaper, fault reporter, loop store). The agent
(`launcher.agent.agent`) builds and replaces them; the handlers of its events
(`worker_exits`, `worker_messages`, `membership_news`) read them here.
"""

from __future__ import annotations

import enum
import queue
import threading
from dataclasses import dataclass, field

from launcher.agent.errors import JobFailures
from launcher.agent.fault_reports import FaultReporter
from launcher.agent.hang_guard import HangGuard
from launcher.agent.loop_store import LoopStore
from launcher.agent.plan_executor import PlanExecutor
from launcher.agent.store_stack import AgentWorld, StoreStack
from launcher.config import LaunchConfig
from launcher.control.controller import Controller
from launcher.control.controller_role import ControllerRole
from launcher.control.fault_memory import FaultMemory
from launcher.observe.logs import AgentLog, RunLogDir
from launcher.protocol import plan as P
from launcher.protocol.death_notice import NoticeBoard
from launcher.workers.channel import ChannelServer
from launcher.workers.spawner import Spawner
from launcher.workers.workers import NodeWorkers, Reaper, Worker
from rendezvous.kv import KVStore


class AgentPhase(enum.Enum):
    """Where the agent is in its life (torch elastic's WorkerState, for the agent itself)."""

    STARTING = "starting"  # building its observer and store; not in a world yet
    JOINING = "joining"  # in the rendezvous, no workers: a signal raises AgentSignal at once
    ENTERING = "entering"  # joined a world: building its parts, starting its workers
    RUNNING = "running"  # the workers run; the loop reacts to their events
    AWAITING_ROUND = "awaiting-round"  # a replacement for a lost node: plans before the round
    # of its arrival are not for it (it starts no worker until that round)
    STOPPING = "stopping"  # a signal asked the agent to end (its workers get the signal)
    DONE = "done"  # shut down

    @property
    def final(self) -> bool:
        """A phase the agent never leaves but for DONE."""
        return self in (AgentPhase.STOPPING, AgentPhase.DONE)


@dataclass
class AgentState:
    """The agent's state and parts (None until built; see `launcher.agent.agent.Agent`)."""

    cfg: LaunchConfig
    log: AgentLog
    host: str
    run_dir: RunLogDir
    stack: StoreStack
    hangs: HangGuard
    fault_memory: FaultMemory
    # SimpleQueue: put() is reentrant, so the signal handler may use it
    events: "queue.SimpleQueue[object]" = field(default_factory=queue.SimpleQueue)
    stopping: threading.Event = field(default_factory=threading.Event)  # a signal: end
    signum: int | None = None  # the first signal received
    phase: AgentPhase = AgentPhase.STARTING
    generation: int = 0
    failures: JobFailures = field(default_factory=JobFailures)
    kv: KVStore | None = None
    world: AgentWorld | None = None
    role: ControllerRole | None = None  # the controller, on the leader / elected agent
    channel: ChannelServer | None = None
    reaper: Reaper | None = None
    notices: NoticeBoard | None = None  # workers' death notices (launcher.protocol.death_notice)
    workers: NodeWorkers = field(default_factory=lambda: NodeWorkers({}))
    spawner: Spawner | None = None
    executor: PlanExecutor | None = None
    reporter: FaultReporter | None = None  # fault reports to the controller
    loop_store: LoopStore | None = None  # the loop's other store writes, off the loop

    def enter(self, phase: AgentPhase) -> None:
        """Move to `phase` (recorded in events.jsonl); a stopping agent stays stopping."""
        if self.phase is phase or (self.phase.final and phase is not AgentPhase.DONE):
            return
        before, self.phase = self.phase, phase
        self.log.record(
            "agent-phase",
            f"agent {before.value} -> {phase.value}",
            phase=phase.value,
            was=before.value,
        )

    def the_world(self) -> AgentWorld:
        assert self.world is not None
        return self.world

    @property
    def controller(self) -> Controller | None:
        """The controller when this agent runs it (leader, or elected with etcd), else None."""
        return self.role.controller if self.role is not None else None

    def report(self, fault: P.Fault) -> None:
        """To the controller, off the loop (`launcher.agent.fault_reports`): a store that does not
        answer (this node cut off) never holds up the loop, and so never its self-fencing."""
        assert self.reporter is not None
        self.reporter.report(fault)

    def mark_finished(self, w: Worker) -> None:
        """Tell the controller `w`'s process is done with the job (`P.finished_key`): no
        recovery round can count on it any more."""
        assert self.loop_store is not None
        self.loop_store.put(P.finished_key(w.rank), str(w.generation).encode())
