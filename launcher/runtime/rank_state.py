"""What the pieces of a worker's runtime share about their rank.

Owns: `RuntimeOptions` (the runtime's timings), `RankState` (where this rank stands: generation,
step, phase, committed step, whether its state can be trusted, its step-start snapshots, what it
registered and its replica layout) and `RankLinks` (its connections: the agent channel, the
job's store, the stop signal and the log, with the store wait every piece uses). A `Runtime`
makes one of each and shares them with its step path, recovery round and checkpoints.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from launcher.runtime.channel import AgentChannel
from launcher.runtime.env import RuntimeEnv
from launcher.runtime.logs import RankLog
from launcher.runtime.replicas import Layout
from launcher.runtime.signals import StopRequested, StopSignal
from launcher.runtime.state import Registered, Snapshot


@dataclass(frozen=True)
class RuntimeOptions:
    heartbeat_interval: float = 1.0  # seconds between heartbeats when nothing changes
    network_grace: float = 3.0  # after a collective error, wait this long for the agent's stop
    poll_interval: float = 0.01  # store polling while waiting for the controller
    plan_poll_interval: float = 0.001  # ... for the repair plan of a recovery round


@dataclass(slots=True, eq=False)
class RankState:
    """Where this rank stands. The step path moves it forward, a recovery round resets it."""

    generation: int
    needs_state: bool  # True until this rank holds a trusted state (a replacement starts so)
    layout: Layout
    reg: Registered = field(default_factory=Registered)
    registered: bool = False
    snapshots: dict[int, Snapshot] = field(default_factory=dict)  # step -> its start state
    committed: int = -1  # the last committed step
    current_step: int = -1
    phase: str = "init"
    in_update: bool = False  # inside the optimizer update: a stop there leaves the rank dirty
    dirty: bool = False  # the state is half-updated: it is repaired from a replica
    step_t0: float | None = None  # when the current step began (monotonic)
    last_step_s: float | None = None  # how long the last committed step took
    pending_exc: BaseException | None = None  # the fault a recovery answers (raised if none)
    # elastic training (launcher.runtime.elastic): the ranks of the current world, original
    # numbers in group-rank order (empty: every rank of the job), and whether this rank can
    # take part in a live shrink (the native loop over plain data parallelism)
    members: tuple[int, ...] = ()
    shrinkable: bool = True


class RankLinks:
    """The rank's connections: the agent channel (None when not under ftrun, or after finish),
    the job's store (set at start), the stop signal, the log."""

    def __init__(self, env: RuntimeEnv, stop: StopSignal, log: RankLog, options: RuntimeOptions):
        self.env = env
        self.rank = env.rank
        self.stop = stop
        self.log = log
        self.options = options
        self.store: Any = None
        self.channel: AgentChannel | None = None

    def try_get(self, key: str) -> bytes | None:
        return self.store.get(key) if self.store.check([key]) else None

    def wait_key(
        self, generation: int, key: str, what: str, max_delay: float | None = None
    ) -> bytes:
        """The store's value of `key`; raises StopRequested on a stop newer than `generation`,
        TimeoutError after the store timeout."""
        timeout = self.env.store_timeout
        deadline = time.monotonic() + timeout
        cap = self.options.poll_interval if max_delay is None else max_delay
        delay = min(0.002, cap)
        while True:
            if self.store.check([key]):
                return self.store.get(key)
            if self.stop.newer_than(generation):
                raise StopRequested(self.stop.target, f"while waiting for {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} ({key}) did not appear within {timeout:.0f} s")
            self.stop.wait_newer(generation, delay)
            delay = min(delay * 2, cap)

    def note_waiting(self, busy: bool) -> None:
        """The training thread waits on its peers (or no longer): heartbeats say so."""
        if self.channel is not None:
            self.channel.update(waiting=busy)

    def hard_exit(self, code: int) -> None:
        """Leave the process now (os._exit), after flushing stdout and stderr."""
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
