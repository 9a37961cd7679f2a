"""The in-worker side of process-level recovery: the object a training script holds.

Owns: `Runtime` (one per worker process, made by `init()`): joining the generation (the agent
channel, the job's store, the default group), the registration of the rank's state, the replica
layout and user process groups, the interruptible collectives and `rt.ddp`, the step loop
(`steps()`) and `finish()`. It composes the pieces that do the work, which share the rank's
`RankState` and `RankLinks` (rank_state):
  - `StepPath` (step_path): steps, phase edges, the optimizer-update commit, fault reports;
  - `RecoveryRound` (recovery_round): the round a stop starts, executing the controller's plan;
  - `Checkpoints` (checkpoints): durable checkpoints and the dying-gasp dump;
  - `World` (world): the process groups of the current generation.
"""

from __future__ import annotations

import atexit
import dataclasses
import faulthandler
import gc
import os
import signal
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from launcher.protocol import death_notice
from launcher.protocol import plan as P
from launcher.protocol.messages import Hello, Imports
from launcher.runtime.buckets import BUCKET_BYTES, GradComm, GradientSyncs
from launcher.runtime.channel import AgentChannel
from launcher.runtime.checkpoints import Checkpoints
from launcher.runtime.collectives import Graveyard, Interruptible
from launcher.runtime.ddp import DDPHost, RuntimeDDP
from launcher.runtime.devices import DeviceAdapter, select_adapter
from launcher.runtime.env import RuntimeEnv
from launcher.runtime.faultplan import FaultInjector, parse_plan
from launcher.runtime.grad_sync_plan import SyncPlan
from launcher.runtime.groups import GroupHandle
from launcher.runtime.loaded import loaded_modules
from launcher.runtime.logs import RankLog
from launcher.runtime.pause import PauseGate
from launcher.runtime.rank_state import RankLinks, RankState, RuntimeOptions
from launcher.runtime.recovery_round import RecoveryRound
from launcher.runtime.replicas import Layout, parallel_groups
from launcher.runtime.signals import StopRequested, StopSignal
from launcher.runtime.state import Registered
from launcher.runtime.step_path import Step, StepPath
from launcher.runtime.world import World

__all__ = ["Runtime", "RuntimeOptions", "Step", "init"]


class Runtime:
    """See the package docstring for the training-loop contract."""

    def __init__(
        self,
        env: RuntimeEnv,
        backend: str,
        device: DeviceAdapter,
        options: RuntimeOptions | None = None,
    ) -> None:
        self.env = env
        self.rank = env.rank
        self.local_rank = env.local_rank
        self.backend = backend
        self.adapter = device
        self.device = device.device(env.local_rank)
        self.options = options or RuntimeOptions()
        self.replacement = env.replacement
        # Under plain torchrun every restart is a new attempt: its number keeps store keys apart.
        generation = env.generation if env.managed else env.restart_count
        self._state = RankState(generation, env.replacement, Layout.ddp(env.world_size))
        self.log = RankLog(env.rank, lambda: self._state.generation)
        self._stop = StopSignal()
        self._links = RankLinks(env, self._stop, self.log, self.options)
        self._finished = False
        self._total_steps: int | None = None
        self._death_notice: death_notice.Held | None = None
        self._compose()

    def _compose(self) -> None:
        """The pieces that do the work, sharing this rank's state and links."""
        state, links, adapter = self._state, self._links, self.adapter
        self._graveyard = Graveyard()
        self._world = World(state, links, self.backend, adapter, self._graveyard)
        self._injector = FaultInjector(
            parse_plan(self.env.fault_plan), self.rank, self.log, waiting=links.note_waiting
        )
        self._path = StepPath(state, links, self._injector, adapter, self._world.sockets)
        self._coll = Interruptible(
            self._stop,
            self._graveyard,
            lambda: state.generation,
            self.env.collective_timeout,
            self._path.on_collective_error,
            self._world.abort_groups,
            # gloo: its own wait in 5 ms slices (~0.16 ms less CPU per wait)
            on_busy=links.note_waiting,
            sliced=self.backend == "gloo",
        )
        self._checkpoints = Checkpoints(state, links, adapter, self._path.set_phase)
        self._pause = PauseGate(
            state, links, lambda: self._world.elastic.members, self._path.set_phase
        )
        self._round = RecoveryRound(
            state,
            links,
            self._world,
            self._coll,
            adapter,
            self._injector,
            self._path,
            self._checkpoints,
        )
        self._sync_plan = SyncPlan(links, state)  # a replacement's syncs made before backward
        self._grad_syncs = GradientSyncs(self._sync_plan.record)
        self._world.listeners.append(lambda g: self._grad_syncs.abandon_all())
        self._world.elastic.listeners.append(self._resized)
        # called with (old, new) world size after a live shrink (elastic-training) rebuilt the
        # default group: a framework updates what it derived from the world size there
        self.on_resize: Callable[[int, int], None] | None = None

    def _resized(self, old: int, new: int) -> None:
        self._grad_syncs.remove_all()  # their buckets and hooks were for the old world
        self._grad_syncs = GradientSyncs(self._sync_plan.record)
        if self.on_resize is not None:
            self.on_resize(old, new)

    # ================================================================ what the pieces know
    @property
    def generation(self) -> int:
        return self._state.generation

    @property
    def world_size(self) -> int:
        """Ranks in the current world (smaller after a live shrink; `rt.rank` stays)."""
        return self._world.elastic.size

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas of this rank's state in the current world."""
        return self._world.elastic.dp_size

    @property
    def micro_batches(self) -> list[int]:
        """Micro-batches per step: [own replica index], more after a shrink (runtime.elastic)."""
        return self._world.elastic.micro_batches

    @property
    def committed_step(self) -> int:
        return self._state.committed

    @property
    def receives_state(self) -> bool:
        """True in a replacement until its state arrived from a replica (before its first
        step): the values of what it builds (model, optimizer) are overwritten by then, so a
        framework may skip its own random parameter init (Megatron: `perform_initialization`)."""
        return self._state.needs_state

    @property
    def shard(self) -> str:
        return self._state.layout.shard_of(self.rank)

    @property
    def last_recovery(self) -> dict[str, float]:
        """Timings of the latest recovery round (seconds by phase)."""
        return self._round.last_recovery

    @property
    def last_plan(self) -> P.RepairPlan | None:
        """The plan of the latest completed recovery round."""
        return self._round.last_plan

    @property
    def on_rebuild(self) -> Callable[[int], None] | None:
        """Called with the generation once a recovery round has rebuilt the default group and
        the runtime's own groups: a framework re-creates its groups here (see callbacks)."""
        return self._world.on_rebuild

    @on_rebuild.setter
    def on_rebuild(self, fn: Callable[[int], None] | None) -> None:
        self._world.on_rebuild = fn

    # ================================================================ registration
    def register(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module] | None = None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        scheduler: Any | Sequence[Any] | None = None,
        data: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
        extra: dict[str, torch.Tensor] | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int = 0,
        on_rollback: Callable[[int], None] | None = None,
    ) -> None:
        """Declare the rank's state. `data` = (get_position, set_position); `extra` = global
        tensors repaired with the model; `on_rollback(step)` re-initialises anything else."""
        if self._state.registered:
            raise RuntimeError(
                "register() was already called; call it once with every stateful object"
            )
        models, opts, scheds = _as_list(model), _as_list(optimizer), _as_list(scheduler)
        extras = dict(extra or {})
        _check_registration(models, opts, scheds, data, extras)
        _check_checkpointing(checkpoint_dir, checkpoint_every)
        self._state.reg = Registered(models, opts, scheds, data, extras, on_rollback)
        self._path.stop_points.watch(models)  # a stop ends a long forward/backward early
        self._checkpoints.configure(checkpoint_dir, checkpoint_every)
        self._state.registered = True
        self._round.mark("registered")  # a replacement: its script has built model and optimizer

    def set_layout(
        self, dp: int, tp: int = 1, pp: int = 1, optimizer_shards: int = 1
    ) -> dict[str, GroupHandle]:
        """Megatron-style layout: creates the "dp", "tp" and "pp" groups (those larger than one
        rank) and derives replica identity. Returns this rank's handles by name."""
        world = self.env.world_size
        self._set_layout(Layout.from_parallel(world, dp, tp, pp, optimizer_shards))
        handles = {}
        for name, partition in parallel_groups(world, dp, tp, pp).items():
            if len(partition[0]) > 1:
                handles[name] = self.new_group(name, partition)
            else:
                handles[name] = GroupHandle(name, [self.rank], None, self.generation)
        return handles

    def set_replica_groups(self, groups: Sequence[Sequence[int]]) -> None:
        """Explicit replica groups: ranks in one group hold equal state."""
        self._set_layout(Layout.from_groups(groups, self.env.world_size))

    def _set_layout(self, layout: Layout) -> None:
        self._state.layout = layout
        # a live shrink drops whole data-parallel replicas (launcher.control.shrink)
        self._state.shrinkable = self._state.shrinkable and layout.shrinks_by_replicas()
        self._publish_shard()

    def _publish_shard(self) -> None:
        if self.env.managed:
            self._links.store.set(P.replica_key(self.rank), self.shard.encode())

    def new_group(self, name: str, ranks: Sequence[int] | Sequence[Sequence[int]]) -> GroupHandle:
        """Create a process group every rank calls in the same order; the handle's `.group` is
        re-pointed after each recovery. `ranks` is one list or a partition (list of lists)."""
        partition = (
            [list(r) for r in ranks]
            if ranks and isinstance(ranks[0], (list, tuple))
            else [list(ranks)]
        )
        with self._world.sockets.track(self.generation):
            return self._world.groups.create(name, partition, self.generation)  # type: ignore[arg-type]

    def group(self, name: str) -> GroupHandle:
        return self._world.groups.get(name)

    # ================================================================ collectives
    def all_reduce(
        self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: GroupHandle | None = None
    ) -> torch.Tensor:
        """In-place all_reduce that a stop can interrupt (raises StopRequested)."""
        if group is not None and group.size <= 1:
            return tensor
        return self._coll.all_reduce(tensor, op, _pg(group))

    def broadcast(
        self, tensor: torch.Tensor, src: int, group: GroupHandle | None = None
    ) -> torch.Tensor:
        """`src` is a rank number (`rt.rank`'s numbering, also after a live shrink)."""
        if group is not None and group.size <= 1:
            return tensor
        return self._coll.broadcast(tensor, self._world.elastic.torch_rank(src), _pg(group))

    def all_gather(
        self, tensor: torch.Tensor, group: GroupHandle | None = None
    ) -> list[torch.Tensor]:
        size = self.world_size if group is None else group.size
        out = [torch.empty_like(tensor) for _ in range(size)]
        if size == 1:
            out[0].copy_(tensor)
            return out
        return self._coll.all_gather(out, tensor, _pg(group))

    def barrier(self, group: GroupHandle | None = None) -> None:
        if group is not None and group.size <= 1:
            return
        self._coll.barrier(_pg(group))

    def allreduce_gradients(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        group: GroupHandle | None = None,
        average: bool = True,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        """Sum (and average) the gradients of `model` across `group` (default: all ranks) in
        buckets, interruptible like every runtime collective. The first call installs hooks:
        from then on each bucket's all-reduce starts during backward, as soon as its gradients
        are accumulated, and this call only waits for them (see launcher.runtime.buckets). The
        parameters taking part (those with requires_grad) are read at the first call for
        `model`."""
        models = tuple(model) if isinstance(model, (list, tuple)) else (model,)
        self._grad_syncs.sync(
            models,
            None if group is None else group.name,
            lambda: self._grad_comm(group),
            average,
            bucket_bytes,
        )

    def ddp(self, module: torch.nn.Module, **ddp_kwargs: Any) -> torch.nn.Module:
        """`torch.nn.parallel.DistributedDataParallel(module, **ddp_kwargs)` whose collectives go
        through the runtime; `process_group` takes a GroupHandle (see launcher.runtime.ddp)."""
        state = self._state
        host = DDPHost(
            rank=self.rank,
            log=self.log,
            comm_mode=self.env.ddp_comm,
            grad_comm=self._grad_comm,
            current_step=lambda: state.current_step,
            enable_cpp_waits=self._world.enable_cpp_waits,
            needs_state=state.needs_state,
            on_rebuild=self._world.listeners.append,
        )
        return RuntimeDDP.build(host, module, **ddp_kwargs)

    def _grad_comm(self, group: GroupHandle | None) -> GradComm:
        return self._world.grad_comm(self._coll, group)

    # ================================================================ step loop
    def steps(self, total: int) -> Iterator[Step]:
        """Yield Step(k) for k from the resume point to total-1; recovery happens in here."""
        if not isinstance(total, int) or total < 0:
            raise ValueError(f"total steps {total!r} must be a non-negative integer")
        if not self._state.registered:
            raise RuntimeError("call rt.register(...) before rt.steps()")
        self._total_steps = total
        self._publish_shard()
        path, recover = self._path, self._round.recover
        s = self._first_step()
        while s < total:
            if self._stop.newer_than(self._state.generation):
                s = recover()
                continue
            step = Step(path, s)
            yield step
            if not step.entered:
                raise RuntimeError("each Step from rt.steps() must be used as `with step:`")
            if step.interrupted:
                s = recover()
                continue
            if not step.updated:
                path.commit(s)
            try:
                self._checkpoints.maybe_save(s + 1)
            except StopRequested as exc:
                self.log(f"checkpoint of iteration {s + 1} abandoned: {exc}")
                s = recover()
                continue
            self.pause_point(s)
            s += 1
        path.set_phase("done")

    def pause_point(self, step: int) -> None:
        """Step `step` ended (committed): while an `ftctl pause` is pending, the rank halts here
        until the resume (launcher.runtime.pause). `steps()` and the framework hooks call it."""
        if self._pause.request is not None:
            self._pause.at_step_end(step)

    def _first_step(self) -> int:
        """The step to start at: a replacement's resume step (after its repair), a loaded
        checkpoint's, or 0."""
        if self._round.pending_plan is not None:
            resume = self._round.resume_replacement()
            self._sync_plan.install(
                lambda m, avg, cap: self._grad_syncs.prepare(
                    m, None, lambda: self._grad_comm(None), avg, cap
                )
            )
            return resume
        state = self._state
        # whether a replacement of this rank may skip its random init (launcher.runtime.skip_init)
        self._round.init_window.close(state.reg.overwritten())
        start = self._checkpoints.load()
        state.snapshots = {start: state.reg.snapshot(start, self.adapter)}
        state.committed = start - 1
        state.current_step = start - 1
        state.needs_state = False
        return start

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
        self._path.report_fault(kind, message, injected, fatal, collective)

    # ================================================================ checkpoints
    def save_checkpoint(self, iteration: int) -> None:
        """Durable checkpoint of the state at the start of step `iteration` (between steps)."""
        self._checkpoints.save(iteration)

    def load_checkpoint(self) -> int:
        """Load the latest durable checkpoint (if any) into the registered objects; returns the
        step to start at (0 without a checkpoint)."""
        return self._checkpoints.load()

    # ================================================================ the end
    def finish(self) -> None:
        """Say goodbye to the agent and leave. When collectives of earlier generations were
        abandoned this exits the process (os._exit(0)) so their destructors cannot block:
        call it last."""
        if self._finished:
            return
        self._finished = True
        if self._world.stuck_alarm is not None:
            self._world.stuck_alarm.cancel()
        self._path.set_phase("done")
        self._pause.close(f"rank {self.rank} finished the job")
        abandoned = len(self._graveyard)
        if not abandoned and dist.is_initialized():
            dist.destroy_process_group()
        if self._links.channel is not None:
            self._links.channel.close(bye=True)
            self._links.channel = None
        # the job's store connection goes with the job (without an agent it is the store
        # itself, torch's env:// server: atexit keeps this runtime, so drop it here)
        self._links.store = None
        self.log(
            "finished"
            + (f"; {abandoned} abandoned collectives/groups, exiting now" if abandoned else "")
        )
        if abandoned:
            self._links.hard_exit(0)
        # at the interpreter's exit (before its own final collections, after the script's last
        # line): one collection (finalizers of what is garbage run), then the survivors frozen,
        # so the exit no longer walks torch's whole object graph (1-3 s per rank on a busy
        # 2-core node, 0.5 s frozen); code after finish() keeps a normal collector
        atexit.register(_freeze_heap)

    def _atexit(self) -> None:
        if len(self._graveyard) and not self._finished:
            self.log(
                "interpreter exit without rt.finish() while abandoned collectives exist; "
                "exiting hard"
            )
            self._links.hard_exit(1)


def _freeze_heap() -> None:
    gc.collect()
    gc.freeze()


def _start(rt: Runtime) -> None:
    """Join the job: the agent channel and the job's store (under ftrun), then the default group
    of the current generation (a replacement joins its recovery round)."""
    env = rt.env
    atexit.register(rt._atexit)
    if not env.managed:
        rt.log(
            "no FTRUN_AGENT_SOCKET: running without an ftrun agent, so no process-level recovery"
        )
        if not dist.is_initialized():
            dist.init_process_group(rt.backend, timeout=timedelta(seconds=env.store_timeout))
        rt._links.store = dist.distributed_c10d._get_default_store()
        return
    rt._death_notice, rt._links.channel = _connect_agent(
        env, rt._stop, rt.log, rt.options, rt._injector, rt._pause
    )
    rt._links.channel.set_progress_source(rt._path.progress_now)
    rt._links.channel.update(generation=rt.generation)
    if not env.replacement:  # the script's imports so far: the spares import them meanwhile
        rt._links.channel.send(Imports(env.rank, loaded_modules(), at="start"))
    rt._links.store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        is_master=False,
        timeout=timedelta(seconds=env.store_timeout),
        wait_for_workers=False,
    )
    if env.replacement:
        rt._round.join_as_replacement()
    else:
        rt._world.build(rt.generation, rebuild_groups=False)
        rt._round.init_window.open(replacement=False)  # closed at the first step
    rt.log(
        f"joined generation {rt.generation} (world {rt.world_size}, backend "
        f"{rt.backend}, device {rt.adapter.name})"
    )


def _connect_agent(
    env: RuntimeEnv,
    stop: StopSignal,
    log: RankLog,
    options: RuntimeOptions,
    inj: FaultInjector,
    pause: PauseGate,
) -> tuple[death_notice.Held | None, AgentChannel]:
    """Hold the death notice and say hello on the agent channel (an ftrun-managed start)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # held on this (the training) thread until the process ends: the agent learns of this
    # process's death before the kernel has torn it down (launcher.protocol.death_notice)
    notice = death_notice.hold(env.death_notice)
    channel = AgentChannel(
        env.agent_socket or "",
        env.rank,
        stop,
        log,
        heartbeat_interval=options.heartbeat_interval,
        on_inject=lambda m: inj.arm(dataclasses.asdict(m)),
        on_pause=pause.notice,
    )
    channel.start(
        Hello(
            rank=env.rank,
            local_rank=env.local_rank,
            pid=os.getpid(),
            generation=env.generation,
            replacement=env.replacement,
            notice_tid=notice.tid if notice else 0,
        )
    )
    return notice, channel


def _pg(group: GroupHandle | None) -> Any:
    """The torch group of a handle (None: the default group)."""
    return None if group is None else group.group


def _as_list(x: Any) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def _check_registration(
    models: list, opts: list, scheds: list, data: Any, extras: dict[str, Any]
) -> None:
    """TypeError for an argument of `register` that is not what it must be."""
    for m in models:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(m).__name__}")
    for o in opts:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(o).__name__}")
    for s in scheds:
        if not (hasattr(s, "state_dict") and hasattr(s, "load_state_dict")):
            raise TypeError(f"scheduler {type(s).__name__} lacks state_dict/load_state_dict")
    if data is not None and (len(data) != 2 or not all(callable(f) for f in data)):
        raise TypeError("data must be a (get_position, set_position) pair of callables")
    for k, v in extras.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"extra[{k!r}] must be a tensor, got {type(v).__name__}")


def _check_checkpointing(directory: str | os.PathLike | None, every: int) -> None:
    if every < 0:
        raise ValueError(f"checkpoint_every={every} must be >= 0")
    if every and not directory:
        raise ValueError("checkpoint_every needs checkpoint_dir")


def init(
    backend: str = "gloo",
    device: str | None = None,
    options: RuntimeOptions | None = None,
    environ: dict[str, str] | None = None,
) -> Runtime:
    """Join the job: read the launch environment, connect to the agent (if any) and build the
    default process group of the current generation. A replacement rank also joins the
    running recovery round here and receives its state when `steps()` starts."""
    env = RuntimeEnv.from_environ(environ)
    rt = Runtime(env, backend, select_adapter(backend, device), options)
    _start(rt)
    return rt
