"""Process-level recovery for frameworks that own their training loop (Megatron, MindSpeed).

Owns: `attach()` (join the job like `init()`, and route the framework's own torch.distributed
collectives through the runtime so a stop can interrupt them), `FrameworkCallbacks` (what the
framework registers for ftrun to call back) and `FrameworkHooks` (what the framework's loop
calls: `start`, `step_start`, `phase`, `optimizer_update_start/end`, `step_end`, `recover`,
`finish`). In the spirit of MindIO TTP: the framework reports step start and the
optimizer-update window; on a fault ftrun calls it back to stop, clean, rebuild its process
groups, repairs the registered state (send/receive along the controller's plan), and calls
rollback or commit with the step to resume at. The recovery round itself (post RankStatus ->
RepairPlan -> rebuild -> transfer -> resume) is the runtime's (`RecoveryRound.recover`); this module
only maps the framework's calls onto the runtime's step machinery and adds the callbacks.

Order of one recovery (every rank of the round, the replacement included from "rebuild_groups"):
  the fault: a routed collective fails or is interrupted (StopRequested), a phase edge sees the
  stop, or the framework raises -> the framework's loop hands the exception to `recover(exc)` ->
  stop(reason) -> clean() -> [runtime: tear down every group, post status, wait for the plan,
  build the new generation's default group] -> rebuild_groups(generation) -> [runtime: restore
  the step-start snapshot, send/receive full state] -> rollback(step) when the plan re-runs a
  step that had started, else commit(step) (falls back to rollback when commit is not given)
  -> `recover` returns `step`; the loop continues there.

A live shrink (elastic-training) and its grow back: a framework that registers `resize(old,
new)` says its `rebuild_groups` re-creates its groups for whatever world the runtime is in
(`hooks.world_size`, `hooks.members`: the ranks still in it; `hooks.dp_size`,
`hooks.micro_batches`); then a lost rank's whole data-parallel replica leaves the world and the
others go on live, `resize` called after `rebuild_groups` with the world sizes before and after.
Without `resize` an elastic-training round falls back to restart-all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from launcher.protocol import plan as P
from launcher.runtime.devices import NETWORK, InjectedFault
from launcher.runtime.replicas import Layout
from launcher.runtime.runtime import Runtime, RuntimeOptions, init
from launcher.runtime.signals import StopRequested
from launcher.runtime.step_path import Step
from launcher.runtime.torch_collectives import CollectiveRouting

T = TypeVar("T")


@dataclass
class FrameworkCallbacks:
    """Callables ftrun calls during a recovery round (all optional), in this order:

    stop(reason)              the stop landed in this rank; halt asynchronous work
    clean()                   free residue (gradients, buffers) before the groups are torn down
    rebuild_groups(generation) the new generation's default group exists: re-create the
                              framework's groups on it (e.g. megatron.rebuild_parallel_state)
    rollback(step)            state is that of the start of `step`, which had started on some
                              rank and is re-run: re-derive step-dependent state (iterators,
                              counters)
    commit(step)              state is that of the start of `step`; the previous step's update
                              completed everywhere and `step` had not started
    resize(old, new)          (a live shrink or its grow back, after rebuild_groups) the world
                              has `new` ranks instead of `old`: re-derive what depends on it
    """

    stop: Callable[[str], None] | None = None
    clean: Callable[[], None] | None = None
    rebuild_groups: Callable[[int], None] | None = None
    rollback: Callable[[int], None] | None = None
    commit: Callable[[int], None] | None = None
    resize: Callable[[int, int], None] | None = None


def resume_callback(callbacks: FrameworkCallbacks, action: str) -> Callable[[int], None] | None:
    """The callback that ends a round whose plan says `action` ("rollback" or "commit")."""
    if action not in ("rollback", "commit"):
        raise ValueError(f"repair plan action {action!r}; allowed: rollback, commit")
    if action == "commit" and callbacks.commit is not None:
        return callbacks.commit
    return callbacks.rollback


class FrameworkHooks:
    """What a framework's own training loop calls (see the module docstring for the order)."""

    def __init__(self, rt: Runtime, routing: CollectiveRouting) -> None:
        self.runtime = rt
        self._routing = routing
        self._callbacks = FrameworkCallbacks()
        self._step: Step | None = None
        self._next = -1  # the step the framework must start next (-1: start() not called)
        rt.on_rebuild = self._rebuild

    # ---------------------------------------------------------------- set-up
    @property
    def rank(self) -> int:
        return self.runtime.rank

    @property
    def world_size(self) -> int:
        return self.runtime.world_size

    @property
    def generation(self) -> int:
        return self.runtime.generation

    @property
    def members(self) -> list[int]:
        """The ranks of the current world (original numbers, in torch's rank order)."""
        return self.runtime._world.elastic.members

    @property
    def dp_size(self) -> int:
        return self.runtime.dp_size

    @property
    def micro_batches(self) -> list[int]:
        return self.runtime.micro_batches

    @property
    def committed_step(self) -> int:
        return self.runtime.committed_step

    @property
    def receives_state(self) -> bool:
        """True in a replacement, whose model and optimizer values come from a replica before
        its first step: build them without random init (Megatron:
        `TransformerConfig(perform_initialization=not hooks.receives_state)`)."""
        return self.runtime.receives_state

    def register(self, callbacks: FrameworkCallbacks, **state: Any) -> None:
        """The callbacks, and the state ftrun snapshots and repairs: the keyword arguments of
        `Runtime.register` (model, optimizer, scheduler, data=(get, set), extra, checkpoint_dir,
        checkpoint_every). `data` may carry any small picklable state (positions, counters)."""
        if not isinstance(callbacks, FrameworkCallbacks):
            raise TypeError(
                f"callbacks must be a FrameworkCallbacks, got {type(callbacks).__name__}"
            )
        if "on_rollback" in state:
            raise TypeError(
                "pass rollback through FrameworkCallbacks(rollback=...), not on_rollback"
            )
        for name in ("stop", "clean", "rebuild_groups", "rollback", "commit", "resize"):
            fn = getattr(callbacks, name)
            if fn is not None and not callable(fn):
                raise TypeError(f"callback {name} must be callable, got {type(fn).__name__}")
        self.runtime.register(**state)
        self._callbacks = callbacks
        rt = self.runtime
        # a live shrink needs the framework to rebuild its groups for a smaller world: it says
        # it does by registering resize
        rt._state.shrinkable = (
            callbacks.resize is not None and rt._state.layout.shrinks_by_replicas()
        )
        rt.on_resize = callbacks.resize

    def set_layout(self, dp: int, tp: int = 1, pp: int = 1, optimizer_shards: int = 1) -> None:
        """Replica identity of a Megatron grid (rank order tp fastest, then dp, then pp); creates
        no group: the framework builds its own."""
        self.runtime._set_layout(
            Layout.from_parallel(self.world_size, dp, tp, pp, optimizer_shards)
        )

    def set_replica_groups(self, groups: list[list[int]]) -> None:
        self.runtime.set_replica_groups(groups)

    def start(self) -> int:
        """After register(): the step to start at (0, a checkpoint's, or for a replacement the
        resume step of the round it joined, after its state arrived and rollback/commit ran)."""
        rt = self.runtime
        if not rt._state.registered:
            raise RuntimeError("call hooks.register(...) before hooks.start()")
        rt._publish_shard()
        self._next = rt._first_step()  # a replacement's round (or a newer one) completes here
        if rt.last_plan is not None:
            self._resume_callback(rt.last_plan, self._next)
        return self._next

    # ---------------------------------------------------------------- the step
    def step_start(self, step: int) -> None:
        """Step `step` begins (before its first forward): snapshot point and stop check."""
        if self._next < 0:
            raise RuntimeError("call hooks.start() before the first step_start()")
        if self._step is not None:
            self.step_end()
        if step != self._next:
            raise ValueError(
                f"step_start({step}): ftrun expects step {self._next} (continue at the "
                "step start()/recover() returned, one step after another)"
            )
        rt = self.runtime
        path = rt._path
        path.check_stop(f"start of step {step}")
        cur = Step(path, step)
        cur.entered = True
        path.begin(cur)
        self._step = cur

    def phase(self, name: str) -> None:
        """Optional marker (e.g. "forward", "backward"): heartbeat, stop check, fault injection."""
        self.runtime._path.enter_phase(self._open("phase"), name)

    def optimizer_update_start(self) -> None:
        """The optimizer update begins; a stop inside it marks this rank's state dirty."""
        cur = self._open("optimizer_update_start")
        path = self.runtime._path
        path.check_stop("before optimizer update")
        path.state.in_update = True
        path.enter_phase(cur, "optimizer", check=False)

    def optimizer_update_end(self) -> None:
        """The optimizer update completed: the step is committed."""
        cur = self._open("optimizer_update_end")
        path = self.runtime._path
        if not path.state.in_update:
            raise RuntimeError("optimizer_update_end() without optimizer_update_start()")
        path.state.in_update = False
        cur.updated = True
        path.commit(cur.index)

    def step_end(self) -> None:
        """The step is over (optional: the next step_start() or finish() ends it too). A step
        without an optimizer update commits here; periodic checkpoints are written here, and an
        `ftctl pause` halts the rank here (`Runtime.pause_point`)."""
        cur = self._open("step_end")
        rt = self.runtime
        if rt._state.in_update:
            raise RuntimeError(
                f"step {cur.index} ended inside its optimizer update "
                "(optimizer_update_end() missing)"
            )
        if not cur.updated:
            rt._path.commit(cur.index)
        self._step = None
        self._next = cur.index + 1
        rt._checkpoints.maybe_save(cur.index + 1)
        rt.pause_point(cur.index)  # `ftctl pause`: may halt here until the resume

    def _open(self, what: str) -> Step:
        if self._step is None:
            raise RuntimeError(f"{what}() outside a step: call step_start(step) first")
        return self._step

    # ---------------------------------------------------------------- recovery
    def recover(self, exc: BaseException) -> int:
        """Hand an exception from the training loop to ftrun. A stop, a failed collective or a
        fault the runtime recognises runs the recovery round with the callbacks and returns
        the step to continue at; anything else is re-raised."""
        rt = self.runtime
        cur = self._step or Step(rt._path, rt._state.current_step)
        exc = self._as_stop(exc)
        if not isinstance(exc, Exception) or not rt._path.end(cur, exc):
            raise exc
        self._step = None
        cb = self._callbacks
        if cb.stop is not None:
            cb.stop(str(exc))
        if cb.clean is not None:
            cb.clean()
        resume = rt._round.recover()
        assert rt.last_plan is not None
        self._next = resume
        self._resume_callback(rt.last_plan, resume)
        return resume

    def _as_stop(self, exc: BaseException) -> BaseException:
        """A transport error from a collective this module does not route (e.g. pipeline
        send/recv) waits for the agent's stop like a routed one."""
        rt = self.runtime
        if isinstance(exc, StopRequested) or isinstance(exc, InjectedFault) or not rt.env.managed:
            return exc
        found = rt.adapter.classify_exception(exc)
        if found is None or found.kind != NETWORK:
            return exc
        try:
            rt._path.on_collective_error(exc, "framework collective")
        except StopRequested as stop:
            return stop
        return exc

    def _rebuild(self, generation: int) -> None:
        if self._callbacks.rebuild_groups is not None:
            self._callbacks.rebuild_groups(generation)

    def _resume_callback(self, plan: P.RepairPlan, step: int) -> None:
        fn = resume_callback(self._callbacks, plan.action)
        if fn is not None:
            fn(step)

    def run(self, train: Callable[[int], T]) -> T:
        """MindIO-style wrapper: `train(start_step)` is the framework's loop; after a recovery it
        is called again with the resume step."""
        start = self.start()
        while True:
            try:
                return train(start)
            except Exception as exc:  # noqa: BLE001 - recover() re-raises what it does not handle
                start = self.recover(exc)

    def finish(self) -> None:
        """End an open step, stop routing collectives, leave the job (call last: may os._exit)."""
        if self._step is not None:
            self.step_end()
        self._routing.uninstall()
        self.runtime.finish()


def framework_environ(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The launch environment as the framework path reads it: FTRUN_SKIP_INIT defaults to 0."""
    env = dict(os.environ if environ is None else environ)
    env.setdefault("FTRUN_SKIP_INIT", "0")
    return env


def attach(
    backend: str = "gloo",
    device: str | None = None,
    options: RuntimeOptions | None = None,
    environ: dict[str, str] | None = None,
) -> FrameworkHooks:
    """Join the job (`launcher.runtime.init`) and route torch.distributed's collectives through
    the runtime. Call it before the framework creates its process groups.

    A framework owns its initialisation (Megatron's CPU init fills full master weights outside the
    state it hands over), so here a replacement runs its random init like any start unless
    FTRUN_SKIP_INIT=1 asks for the skip (`launcher.runtime.skip_init`)."""
    rt = init(backend=backend, device=device, options=options, environ=framework_environ(environ))
    rt._state.shrinkable = False  # a live shrink needs the framework's groups resized: not yet
    return FrameworkHooks(rt, CollectiveRouting(rt._coll).install())
