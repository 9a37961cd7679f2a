"""The training step as the runtime sees it: the hot path, measured against plain DDP.

Owns: `Step` (what `rt.steps()` yields; `with step:`, `step.phase(name)`,
`step.optimizer_update()`) and `StepPath`: a step's begin (its step-start snapshot), its phase
edges (stop check, fault injection, the phase the heartbeats report), the optimizer-update
commit, a step's end (a stop, or a fault it classifies and reports to the agent), and the wait
for the agent's stop after a collective failed. The recovery round that follows a stop is
`recovery_round`'s.
"""

from __future__ import annotations

import time
from typing import Any

from launcher.protocol.faults import WORKER_FAULT_KINDS
from launcher.protocol.messages import FaultReport, Imports
from launcher.runtime import heap
from launcher.runtime.collectives import CollectiveError, is_backend_failure
from launcher.runtime.devices import (
    EXCEPTION,
    NETWORK,
    UCE_HIGH,
    UNSAFE_DATA,
    DeviceAdapter,
    InjectedFault,
)
from launcher.runtime.faultplan import FaultInjector
from launcher.runtime.group_sockets import SocketLedger
from launcher.runtime.loaded import loaded_modules
from launcher.runtime.rank_state import RankLinks, RankState
from launcher.runtime.signals import StopRequested
from launcher.runtime.stop_points import StopPoints

# phases the agent hears at once (the channel's writer is woken); a step's phase edges are read
# at its next poll (MIN_HEARTBEAT_GAP), as coalesced heartbeats always were
_PROMPT_PHASES = frozenset({"recovering", "resumed", "checkpoint", "paused", "done"})


class Step:
    """One training step; use as `with step:` and mark phases inside it."""

    __slots__ = ("_path", "index", "entered", "interrupted", "updated")

    def __init__(self, path: StepPath, index: int) -> None:
        self._path = path
        self.index = index
        self.entered = False
        self.interrupted = False
        self.updated = False

    def __enter__(self) -> Step:
        self.entered = True
        self._path.begin(self)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        return self._path.end(self, exc)

    def phase(self, name: str) -> _Phase:
        """A named part of the step (forward, backward, ...): heartbeat + stop check at its
        edges."""
        return _Phase(self, name)

    def optimizer_update(self) -> _OptimizerUpdate:
        """The optimizer update: completing it commits the step (it runs even when a stop came
        after the step's gradients were complete); a stop that breaks a collective inside it
        marks the rank dirty (its state is repaired from a replica)."""
        return _OptimizerUpdate(self)


class _Phase:
    """`with step.phase(name):` (a plain context manager: it runs several times per step)."""

    __slots__ = ("_step", "_name")

    def __init__(self, step: Step, name: str) -> None:
        self._step = step
        self._name = name

    def __enter__(self) -> None:
        # StepPath.enter_phase, inlined: a phase edge runs right after the step's computation,
        # with cold caches, where every Python call costs about a microsecond
        path = self._step._path
        state = path.state
        if path.stop.newer_than(state.generation):
            raise StopRequested(path.stop.target, f"start of {self._name}")
        state.phase = self._name
        if path.first_step:
            path.note_heap()
        if path.injector.armed:
            path.injector.maybe_fire(state.generation, self._step.index, self._name)

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        # no stop check here: a phase that completed (its collectives included) is kept; the
        # next phase's start, a collective or the next step takes the stop (see
        # _OptimizerUpdate)
        return False


class _OptimizerUpdate:
    """`with step.optimizer_update():` -- an exception inside leaves the rank marked as inside
    the update (dirty), as the step's exit expects."""

    __slots__ = ("_step",)

    def __init__(self, step: Step) -> None:
        self._step = step

    def __enter__(self) -> None:
        # A stop pending here does not keep the update from running: the step's gradients are
        # complete (a collective the stop broke has raised already), so the rank commits the
        # step and the round finds it up to date instead of one step behind (a laggard needs a
        # replica's whole state, and a shard whose replicas all lag leaves only restart-all).
        # A collective inside the update still takes the stop: the rank is then dirty.
        path = self._step._path
        state = path.state
        state.in_update = True
        state.phase = "optimizer"
        if path.first_step:
            path.note_heap()
        if path.injector.armed:
            path.injector.maybe_fire(state.generation, self._step.index, "optimizer")

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc_type is None:
            path = self._step._path
            path.state.in_update = False
            self._step.updated = True
            path.commit(self._step.index)
        return False


class StepPath:
    """A rank's steps: begin, phase edges, commit, end; fault reports to the agent."""

    def __init__(
        self,
        state: RankState,
        links: RankLinks,
        injector: FaultInjector,
        adapter: DeviceAdapter,
        sockets: SocketLedger,
    ) -> None:
        self.state = state
        self.links = links
        self.stop = links.stop
        self.injector = injector
        self.adapter = adapter
        self._sockets = sockets  # enabled: collectives wait in C++ (rt.ddp's reducer)
        self._heap_at_start = heap.in_use_bytes()  # the heap grown by its first commit is told
        self._heap_peak = self._heap_at_start  # at its first step's phase edges (activations)
        self.first_step = True  # until the first commit: the phase edges note the heap's peak
        # a stop inside a long forward/backward (armed at the first commit)
        self.stop_points = StopPoints(self.stop, state, links.env.managed and links.env.stop_points)

    # ---------------------------------------------------------------- a step's edges
    def begin(self, step: Step) -> None:
        state = self.state
        index = step.index
        state.current_step = index
        state.step_t0 = time.monotonic()
        snaps = state.snapshots
        if len(snaps) == 2 and index in snaps and index - 1 in snaps:
            del snaps[index - 1]  # the usual case: the previous step's, kept until this one began
        elif len(snaps) > 1 or index not in snaps:
            state.snapshots = snaps = {k: v for k, v in snaps.items() if k >= index}
        # Usually taken when the previous step committed: that snapshot already is the state a
        # committed recovery resumes from (so it is complete), and re-taking it costs per step.
        if index not in snaps:
            snaps[index] = state.reg.snapshot(index, self.adapter)
        state.phase = "step"

    def enter_phase(self, step: Step, name: str, check: bool = True) -> None:
        if check:
            self.check_stop(f"start of {name}")
        if self.first_step:
            self.note_heap()
        self.set_phase(name)
        self.injector.maybe_fire(self.state.generation, step.index, name)

    def note_heap(self) -> None:
        """At a phase edge of the rank's first step: the heap's peak so far (the forward's
        activations count; ~0.1 ms, the first step only)."""
        self._heap_peak = max(self._heap_peak, heap.in_use_bytes())

    def set_phase(self, name: str) -> None:
        """The rank's phase. The agent channel's writer reads it (`progress_now`) at its next
        poll: a phase edge of a step costs an attribute store, no call into the channel; the
        runtime's own phases outside steps (recovering, resumed, checkpoint, done) wake it."""
        self.state.phase = name
        if name in _PROMPT_PHASES and self.links.channel is not None:
            self.links.channel.wake()

    def progress_now(self) -> tuple[int, str, int, float | None]:
        """(step, phase, committed step, last step time) for the channel's heartbeats."""
        state = self.state
        return state.current_step, state.phase, state.committed, state.last_step_s

    def check_stop(self, where: str) -> None:
        if self.stop.newer_than(self.state.generation):
            raise StopRequested(self.stop.target, where)

    def commit(self, index: int) -> None:
        state = self.state
        state.committed = index
        state.snapshots[index + 1] = state.reg.snapshot(index + 1, self.adapter)
        # the agent's hang watch learns step times from this, however the heartbeats of a fast
        # loop are coalesced (it may never see two steps' starts apart)
        if state.step_t0 is not None:
            state.last_step_s = time.monotonic() - state.step_t0
        if self.first_step:
            self._first_commit()
        state.phase = "committed"

    def _first_commit(self) -> None:
        """Once, when the optimizer state exists: the stop points armed for a long step, and the
        agent told the heap this rank needed (its spares fault in that much) and what it
        imported by now (launcher.runtime.loaded; what the script had imported when it joined
        was told then)."""
        self.first_step = False  # told once (or nobody to tell: no agent)
        state = self.state
        self.stop_points.arm(state.last_step_s)
        if self.links.channel is None:
            return
        grown = max(0, max(self._heap_peak, heap.in_use_bytes()) - self._heap_at_start)
        self.links.channel.update(state_bytes=state.reg.state_bytes(), heap_bytes=grown)
        if not self.links.env.replacement:  # a spare's copy would name the spare's
            self.links.channel.send(Imports(self.links.rank, loaded_modules()))

    def end(self, step: Step, exc: BaseException | None) -> bool:
        """A step's exit: True when the exception is handled (the step is interrupted and a
        recovery round follows), False to let it propagate."""
        if exc is None:
            return False
        if isinstance(exc, StopRequested):
            return self._stopped(step, exc)
        if not isinstance(exc, Exception) or not self.links.env.managed:
            return False
        if isinstance(exc, CollectiveError):
            return False  # the agent never answered: let it propagate
        if self._sockets.enabled and isinstance(exc, RuntimeError):
            stop = self._left_cpp_wait(exc)
            if stop is not None:
                return self._stopped(step, stop)
            if is_backend_failure(exc):
                return False  # the agent never answered: let it propagate
        self._faulted(exc)
        step.interrupted = True
        return True

    def _faulted(self, exc: Exception) -> None:
        """A step raised a fault: report it to the agent (which answers with a stop)."""
        state = self.state
        found = self.adapter.classify_exception(exc)
        kind = found.kind if found else EXCEPTION
        lost_state = kind in (UCE_HIGH, UNSAFE_DATA) or state.in_update
        self.report_fault(
            kind,
            f"{type(exc).__name__}: {exc}",
            injected=isinstance(exc, InjectedFault),
            fatal=bool(found and found.fatal),
        )
        if found and found.fatal:
            self.links.log("fault is process-fatal; exiting so the agent restarts this rank")
            self.links.hard_exit(1)
        state.dirty = state.dirty or lost_state
        state.in_update = False
        state.pending_exc = exc

    def _stopped(self, step: Step, exc: StopRequested) -> bool:
        state = self.state
        step.interrupted = True
        state.dirty = state.dirty or state.in_update
        how = "inside the optimizer update" if state.in_update else "state clean"
        self.links.log(f"stopped in step {step.index} phase {state.phase} ({how}): {exc}")
        state.in_update = False
        return True

    def _left_cpp_wait(self, exc: RuntimeError) -> StopRequested | None:
        """A collective torch waited for in C++ (rt.ddp's reducer) failed: because a stop broke
        it (a stop is pending) or a peer is gone (then wait for the agent's stop, as a failed
        runtime collective does). The stop to handle, or None: not a collective failure, or
        the agent never answered."""
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        if self.stop.newer_than(self.state.generation):
            return StopRequested(self.stop.target, f"left DDP's collective in C++: {first}")
        if not is_backend_failure(exc):
            return None
        try:
            self.on_collective_error(exc, "DDP collective")
        except StopRequested as stop:
            return stop
        return None

    # ---------------------------------------------------------------- faults
    def report_fault(
        self,
        kind: str,
        message: str,
        injected: bool = False,
        fatal: bool = False,
        collective: str = "",
    ) -> None:
        """Tell the agent about a fault this worker detected itself (the agent answers with a
        stop, which the runtime handles at the next phase edge or collective)."""
        if kind not in WORKER_FAULT_KINDS:
            raise ValueError(f"fault kind {kind!r}; allowed: {', '.join(WORKER_FAULT_KINDS)}")
        state = self.state
        label = "INJECTED " if injected else ""
        self.links.log(
            f"{label}fault kind={kind} in step {state.current_step} phase {state.phase}: {message}"
        )
        if self.links.channel is not None:
            self.links.channel.send(
                FaultReport(
                    self.links.rank,
                    kind,
                    message[:2000],
                    state.current_step,
                    state.phase,
                    injected=injected,
                    fatal=fatal,
                    generation=state.generation,
                    collective=collective,
                )
            )

    def on_collective_error(self, exc: BaseException, what: str) -> None:
        """A collective failed: wait for the agent's stop (raised as StopRequested); report a
        network fault when none comes within the grace. Returns when the agent never
        answers (or without an agent)."""
        links = self.links
        if not links.env.managed:
            return
        gen = self.state.generation
        grace = links.options.network_grace
        links.log(
            f"{what} failed ({str(exc).splitlines()[0][:200]}); waiting {grace:.0f} s "
            "for the agent's stop"
        )
        if self.stop.wait_newer(gen, grace):
            raise StopRequested(self.stop.target, f"after {what} error")
        self.report_fault(NETWORK, f"{what}: {exc}", collective=what)
        if self.stop.wait_newer(gen, links.env.store_timeout):
            raise StopRequested(self.stop.target, f"after {what} error")
