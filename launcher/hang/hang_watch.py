"""Hang detection for runtime-aware ranks: a progress clock per rank, fed by its heartbeats, with
a timeout that adapts to the job.

Owns: `HangPolicy` (how long a rank may go without progress: `--hang-timeout auto` derives it
from the step times seen so far, `--hang-timeout S` fixes it, `0` turns it off; the knobs
`FTRUN_HANG_FLOOR`, `FTRUN_HANG_MULTIPLIER`, `FTRUN_HANG_FIRST_STEP`, `FTRUN_HANG_UNMODIFIED`,
`FTRUN_HANG_STOP`, read and checked by `launcher.config`, which keeps the policy as
`LaunchConfig.hang`), and `HangWatch`: for each local rank, when its heartbeat last showed
progress (a new step, phase or committed step; mere liveness does not count), when it last sent
a heartbeat at all, whether it says it waits on its peers inside a collective, its recent step
and checkpoint durations, and `overdue()`: the ranks that hang, each as a `Hang` with the
evidence. The agent acts on what it returns (stack dump, kill) and remembers the ranks it
killed, so their exit is a hang.

The rule (auto):
  - a step: max(floor, multiplier x the slowest of the rank's last 20 steps) without progress
    (step times as the rank measured them, sent with its heartbeats; the agent's own clock for
    ranks that do not send them)
    (defaults: 30 s floor, x10);
  - the first step of a process (no step time known yet) and checkpoint saves: the first-step
    allowance (default 300 s), or multiplier x the slowest save seen, whichever is longer;
  - start-up ("init"), recovery rounds, an `ftctl pause` ("paused") and "done" are not timed
    (the runtime's own timeouts, the pause's maximum and the controller's phase timeouts bound
    them);
  - a rank blocked in a collective (`waiting`) waits on a peer and is not hung itself, unless its
    process is stopped (SIGSTOP, state T) or stuck in the kernel (state D), or its heartbeats
    stopped (the runtime's heartbeat thread only stops when the whole process is frozen): then it
    counts as hung in any phase;
  - a survivor the agent sent a recovery round's stop that still waits in a collective
    `FTRUN_HANG_STOP` (3 s) later, without having entered the round (a "recovering"
    heartbeat, or any heartbeat of that generation or a newer one), is hung. The stop shuts
    down the sockets its gloo waits use, which ends such a wait within milliseconds -- except
    one on a send gloo had already queued on a connection that failed (a peer killed while this
    rank sent to it): gloo's TCP pair fails only bound buffers in its transmit queue, not the
    unbound ones collectives use, so that send waits for the group's whole timeout (found with
    gdb in a survivor stuck in DDP's ring all-reduce; reproduced in
    tests/test_runtime_group_sockets.py). It happened in one kill in ten to forty during DDP's
    all-reduces here. Such a rank usually says so itself (heartbeat `stuck`: its training thread
    stayed in the wait, without CPU, a second after the break; launcher.runtime.wait_probe):
    then it is hung at once. Killed, the rank is a fault of the round in progress and is
    repaired with it, seconds after the stop (before: the controller's 120 s phase timeout,
    then restart-all);
  - leaving a collective wait (waiting turns false) restarts the rank's clock: the time spent
    waiting on peers is not its own. (Before, a survivor that left a long wait on a hung peer
    because of the agent's stop sent one heartbeat "backward, not waiting" before its
    "recovering" one, and a health check in between found it idle since the wait began: the
    survivors of a recovered hang were killed as hung themselves.)
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from launcher.protocol.faults import FROZEN_STATES
from launcher.protocol.messages import Heartbeat

UNTIMED_PHASES = frozenset({"init", "recovering", "paused", "done"})
RECENT_STEPS = 20

DEFAULT_FLOOR = 30.0
DEFAULT_MULTIPLIER = 10.0
DEFAULT_FIRST_STEP = 300.0
DEFAULT_UNMODIFIED = 600.0  # unmodified scripts with auto: NCCL's default collective timeout
DEFAULT_STOP_ANSWER = 3.0  # a survivor still blocked in a collective this long after a stop


@dataclass(frozen=True)
class HangPolicy:
    """How long a rank may go without progress. `timeout` is --hang-timeout: None = auto, 0 =
    off, else seconds; the rest are the FTRUN_HANG_* knobs (read by `launcher.config`)."""

    timeout: float | None = None
    floor: float = DEFAULT_FLOOR
    multiplier: float = DEFAULT_MULTIPLIER
    first_step: float = DEFAULT_FIRST_STEP
    unmodified: float = DEFAULT_UNMODIFIED
    stop_answer: float = DEFAULT_STOP_ANSWER

    @property
    def enabled(self) -> bool:
        return self.timeout != 0

    def step_timeout(self, recent: "deque[float] | list[float]") -> float:
        """A step after the first: the fixed timeout, or max(floor, multiplier x slowest)."""
        if not recent:
            return self.first_timeout()
        if self.timeout:
            return self.timeout
        return max(self.floor, self.multiplier * max(recent))

    def first_timeout(self) -> float:
        """The first step of a process (no step time known yet)."""
        return max(self.timeout or 0.0, self.first_step)

    def checkpoint_timeout(self, recent: "deque[float] | list[float]") -> float:
        longest = max(recent) if recent else 0.0
        return max(self.first_timeout(), self.multiplier * longest)

    def unmodified_timeout(self) -> float:
        """Workers that do not use launcher.runtime (no heartbeats): the fixed timeout, or the
        default."""
        return self.timeout or self.unmodified

    def describe(self) -> str:
        if not self.enabled:
            return "off"
        auto = f"{self.multiplier:g} x slowest of the last {RECENT_STEPS} steps"
        steps = f"{self.timeout:g}s" if self.timeout else f"max({self.floor:g}s, {auto})"
        return (
            f"{steps}; first step and checkpoints {self.first_timeout():g}s; "
            f"unmodified scripts {self.unmodified_timeout():g}s; "
            f"still in a collective after a recovery stop {self.stop_answer:g}s"
        )


@dataclass
class Hang:
    """A rank found hung, with the evidence the fault report carries."""

    rank: int
    idle_s: float  # seconds since its last progress
    timeout_s: float  # the allowance it ran past
    basis: str  # why it counts as hung, for people
    state: str = ""  # its process state (/proc/<pid>/stat), when read
    waiting: bool = False  # its last heartbeat said it waits in a collective
    silent_s: float = 0.0  # seconds since its last heartbeat (runtime-aware ranks)
    weak: bool = False  # blamed only for going silent first: the controller may blame another

    def evidence(self) -> dict:
        return {
            "idle_s": round(self.idle_s, 3),
            "timeout_s": round(self.timeout_s, 3),
            "basis": self.basis,
            "proc_state": self.state,
            "waiting": self.waiting,
            "silent_s": round(self.silent_s, 3),
            "weak": self.weak,
        }


@dataclass
class RankClock:
    """One rank's progress as its heartbeats tell it."""

    mark: tuple | None = None
    phase: str = "init"
    waiting: bool = False
    last_progress: float = 0.0
    last_beat: float = 0.0
    step_start: tuple[int, float] | None = None  # (step, when it was first seen)
    committed_seen: int = -1  # the last committed step a heartbeat showed
    stop: tuple[int, float] | None = None  # (generation, when) of a stop it has not answered yet
    generation: int = -1  # the newest generation its heartbeats said it entered (-1: unknown)
    stuck: bool = False  # the rank itself found its C++ wait outlived the stop's socket shutdown
    ckpt_start: float | None = None
    steps: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    checkpoints: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))

    def beat(self, hb: Heartbeat, now: float) -> None:
        self.last_beat = now
        self.generation = max(self.generation, hb.generation)
        self.stuck = hb.stuck
        if hb.phase in ("recovering", "done") or (
            self.stop is not None and self.generation >= self.stop[0]
        ):
            # it entered the round (or left the job): the stop was answered. The generation
            # counts even when the 'recovering' heartbeat itself was coalesced away (a quick
            # round): a stale stop must not blame this rank for a later wait on a hung peer.
            self.stop = None
        left_wait = self.waiting and not hb.waiting
        self.waiting = hb.waiting
        mark = hb.progress()
        if mark == self.mark:
            if left_wait:
                # It left a collective (completed, failed or interrupted by a stop) and still
                # shows the phase it waited in: its own idleness starts now, not when it began
                # to wait (the first heartbeat after a stop often carries the old phase).
                self.last_progress = now
            return  # alive, same place: no progress
        self.mark, self.last_progress = mark, now
        if self.phase == "checkpoint" and hb.phase != "checkpoint" and self.ckpt_start is not None:
            self.checkpoints.append(now - self.ckpt_start)
            self.step_start = None  # the save is not part of a step's time
        if hb.phase == "checkpoint" and self.phase != "checkpoint":
            self.ckpt_start = now
        self.phase = hb.phase
        if hb.phase in UNTIMED_PHASES or hb.phase == "resumed":
            self.step_start = None  # a recovery round is not a step
        elif hb.step >= 0 and hb.phase != "checkpoint":
            if hb.step_s > 0:  # the rank timed its steps itself
                if hb.committed_step != self.committed_seen:
                    self.steps.append(hb.step_s)
            elif self.step_start is not None and hb.step > self.step_start[0]:
                s0, t0 = self.step_start
                self.steps.append((now - t0) / (hb.step - s0))
            if self.step_start is None or hb.step != self.step_start[0]:
                self.step_start = (hb.step, now)
        self.committed_seen = hb.committed_step

    def allowance(self, policy: HangPolicy) -> float:
        if self.phase == "checkpoint":
            return policy.checkpoint_timeout(self.checkpoints)
        return policy.step_timeout(self.steps)


StateReader = Callable[[int], str]  # rank -> process state letter ("" when unknown)


@dataclass
class HangWatch:
    policy: HangPolicy
    clocks: dict[int, RankClock] = field(default_factory=dict)
    _killed: dict[int, Hang] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.policy.enabled

    def on_heartbeat(self, hb: Heartbeat, now: float | None = None) -> None:
        self.clocks.setdefault(hb.rank, RankClock()).beat(hb, time.time() if now is None else now)

    def stop_clock(self, rank: int) -> None:
        """The rank said goodbye: it is not training any more."""
        clock = self.clocks.get(rank)
        if clock is not None:
            clock.phase = "done"

    def stop_sent(self, rank: int, generation: int, now: float | None = None) -> None:
        """The agent sent the rank the stop of recovery round `generation`."""
        clock = self.clocks.get(rank)
        if (
            clock is not None
            and clock.phase not in ("recovering", "done")
            and clock.generation < generation
        ):
            clock.stop = (generation, time.time() if now is None else now)

    def forget(self, rank: int) -> None:
        """The rank got a new process: its clock starts with that process's first heartbeat."""
        self.clocks.pop(rank, None)

    def overdue(
        self, ranks: list[int], now: float | None = None, state_of: StateReader = lambda rank: ""
    ) -> list[Hang]:
        """The ranks of `ranks` that hang (see the module docstring for the rule)."""
        if not self.enabled:
            return []
        now = time.time() if now is None else now
        out = []
        for rank in ranks:
            clock = self.clocks.get(rank)
            if clock is None or clock.phase == "done" or rank in self._killed:
                continue
            hang = self._judge(rank, clock, now, state_of)
            if hang is not None:
                out.append(hang)
        return out

    def _judge(self, rank: int, clock: RankClock, now: float, state_of: StateReader) -> Hang | None:
        overdue_stop = (
            clock.waiting
            and clock.stop is not None
            and now - clock.stop[1] > self.policy.stop_answer
        )
        if clock.stop is not None and (clock.stuck or overdue_stop):
            g, sent = clock.stop
            why = (
                "its own check: the C++ wait outlived the shutdown of its sockets, a send gloo "
                "queued on a failed connection"
                if clock.stuck
                else "the stop did not release it; allowance FTRUN_HANG_STOP "
                f"{self.policy.stop_answer:g}s"
            )
            return Hang(
                rank,
                now - clock.last_progress,
                self.policy.stop_answer,
                f"still blocked in a collective in phase {clock.phase!r} {now - sent:.1f}s "
                f"after the stop for generation {g} ({why})",
                state_of(rank),
                True,
                now - clock.last_beat,
            )
        timed = clock.phase not in UNTIMED_PHASES
        limit = clock.allowance(self.policy) if timed else self.policy.first_timeout()
        idle, silent = now - clock.last_progress, now - clock.last_beat
        if idle <= limit:
            return None
        state = state_of(rank)
        frozen = FROZEN_STATES.get(state)
        if frozen is None and silent > limit:
            frozen = f"its heartbeats stopped {silent:.1f}s ago (the process is frozen)"
        if frozen is not None:
            basis = f"process {frozen}" if state in FROZEN_STATES else frozen
        elif not timed or clock.waiting:
            return None  # untimed phase, or blocked in a collective: it waits on a peer
        else:
            basis = (
                f"no progress in phase {clock.phase!r} for {idle:.1f}s "
                f"(allowance {limit:.1f}s) while not waiting in a collective"
            )
        return Hang(rank, idle, limit, basis, state, clock.waiting, silent)

    def killed(self, hang: Hang) -> None:
        """The agent kills `hang.rank` for hanging: its exit is a hang, not a signal."""
        self._killed[hang.rank] = hang

    def take_killed(self, rank: int) -> Hang | None:
        """The hang that made the agent kill `rank` (asked once per exit)."""
        return self._killed.pop(rank, None)

    def progress_of(self, rank: int, now: float) -> dict | None:
        """The rank's progress record (published for the controller's blame), None without one."""
        clock = self.clocks.get(rank)
        if clock is None:
            return None
        return {
            "aware": True,
            "phase": clock.phase,
            "waiting": clock.waiting,
            "idle_s": round(now - clock.last_progress, 3),
            "silent_s": round(now - clock.last_beat, 3),
            "step": clock.mark[0] if clock.mark else -1,
        }
