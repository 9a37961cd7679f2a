"""The in-worker side of process-level recovery.

Owns: `Runtime` (one per worker process, made by `init()`): joining the generation, the default
and user process groups on the generation's store prefix, the step loop with its step-start
snapshots and optimizer-update commit marker, interruptible collectives, fault reports to the
agent, and the recovery round a stop starts: post RankStatus -> wait for the controller's
RepairPlan -> rebuild groups for the new generation -> restore the step-start state, send or
receive full state along the plan's pairs -> resume. Durable checkpoints (periodic saves, the
restart-all start, the dying-gasp dump) are coordinated here and written by `checkpoint`.
"""

from __future__ import annotations

import atexit
import dataclasses
import faulthandler
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from launcher.protocol import death_notice
from launcher.protocol import plan as P
from launcher.protocol.faults import WORKER_FAULT_KINDS
from launcher.protocol.messages import FaultReport, Hello, Recovered
from launcher.runtime import checkpoint as ckpt
from launcher.runtime import heap
from launcher.runtime.buckets import BUCKET_BYTES, GradComm, GradientSyncs
from launcher.runtime.channel import AgentChannel
from launcher.runtime.collectives import (
    CollectiveError,
    Graveyard,
    Interruptible,
    is_backend_failure,
)
from launcher.runtime.ddp import RuntimeDDP
from launcher.runtime.devices import (
    EXCEPTION,
    NETWORK,
    UCE_HIGH,
    UNSAFE_DATA,
    DeviceAdapter,
    InjectedFault,
    select_adapter,
)
from launcher.runtime.env import RuntimeEnv
from launcher.runtime.faultplan import FaultInjector, parse_plan
from launcher.runtime.group_sockets import SocketLedger
from launcher.runtime.groups import GroupHandle, GroupRegistry
from launcher.runtime.logs import RankLog
from launcher.runtime.replicas import Layout, parallel_groups
from launcher.runtime.signals import StopRequested, StopSignal
from launcher.runtime.skip_init import InitSkip
from launcher.runtime.state import Registered, Snapshot
from launcher.runtime.transfer import recv_state, send_state
from launcher.runtime.wait_probe import (
    STUCK_AFTER_BREAK_S,
    CppWaitProbe,
    StuckWaitAlarm,
    cpp_wait_codes,
)

# phases the agent hears at once (the channel's writer is woken); a step's phase edges are read at
# its next poll (MIN_HEARTBEAT_GAP), as coalesced heartbeats always were
_PROMPT_PHASES = frozenset({"recovering", "resumed", "checkpoint", "done"})


@dataclass(frozen=True)
class RuntimeOptions:
    heartbeat_interval: float = 1.0  # seconds between heartbeats when nothing changes
    network_grace: float = 3.0  # after a collective error, wait this long for the agent's stop
    poll_interval: float = 0.01  # store polling while waiting for the controller
    plan_poll_interval: float = 0.001  # ... for the repair plan of a recovery round


class Step:
    """One training step; use as `with step:` and mark phases inside it."""

    __slots__ = ("_rt", "index", "entered", "interrupted", "updated")

    def __init__(self, rt: "Runtime", index: int) -> None:
        self._rt = rt
        self.index = index
        self.entered = False
        self.interrupted = False
        self.updated = False

    def __enter__(self) -> "Step":
        self.entered = True
        self._rt._begin_step(self)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        return self._rt._end_step(self, exc)

    def phase(self, name: str) -> "_Phase":
        """A named part of the step (forward, backward, ...): heartbeat + stop check at its edges."""
        return _Phase(self, name)

    def optimizer_update(self) -> "_OptimizerUpdate":
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
        # Runtime._enter_phase, inlined: a phase edge runs right after the step's computation,
        # with cold caches, where every Python call costs about a microsecond
        rt = self._step._rt
        if rt._stop.newer_than(rt.generation):
            raise StopRequested(rt._stop.target, f"start of {self._name}")
        rt._phase = self._name
        if rt._injector.armed:
            rt._injector.maybe_fire(rt.generation, self._step.index, self._name)

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        # no stop check here: a phase that completed (its collectives included) is kept; the
        # next phase's start, a collective or the next step takes the stop (see _OptimizerUpdate)
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
        rt = self._step._rt
        rt._in_update = True
        rt._phase = "optimizer"
        if rt._injector.armed:
            rt._injector.maybe_fire(rt.generation, self._step.index, "optimizer")

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc_type is None:
            rt = self._step._rt
            rt._in_update = False
            self._step.updated = True
            rt._commit(self._step.index)
        return False


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
        self.world_size = env.world_size
        self.local_rank = env.local_rank
        self.backend = backend
        self.adapter = device
        self.device = device.device(env.local_rank)
        self.options = options or RuntimeOptions()
        # Under plain torchrun every restart is a new attempt: its number keeps store keys apart.
        self.generation = env.generation if env.managed else env.restart_count
        self.replacement = env.replacement
        self.log = RankLog(env.rank, lambda: self.generation)
        self._stop = StopSignal()
        # sockets of every gloo group, so that a stop can break waits torch runs in C++ (rt.ddp)
        self._sockets = SocketLedger(lambda: self._stop.target)
        self._stop.on_request(self._break_old_groups)
        self._stuck_alarm: StuckWaitAlarm | None = None  # set with the C++ waits (rt.ddp on gloo)
        self._graveyard = Graveyard()
        self._coll = Interruptible(
            self._stop,
            self._graveyard,
            lambda: self.generation,
            env.collective_timeout,
            self._on_collective_error,
            self._abort_groups,
            # gloo: its own wait in 5 ms slices (~0.16 ms less CPU per wait)
            on_busy=self._note_waiting,
            sliced=backend == "gloo",
        )
        self._groups = GroupRegistry(env.rank, env.world_size, backend)
        self._reg = Registered()
        self._registered = False
        self._layout = Layout.ddp(env.world_size)
        self._injector = FaultInjector(
            parse_plan(env.fault_plan), env.rank, self.log, waiting=self._note_waiting
        )
        self._channel: AgentChannel | None = None
        self._death_notice: death_notice.Held | None = None
        self._state_told = False  # the agent knows the bytes of this rank's state
        self._store: Any = None
        self._snapshots: dict[int, Snapshot] = {}
        self._committed = -1
        self._current_step = -1
        self._step_t0: float | None = None  # when the current step began (monotonic)
        self._last_step_s: float | None = None  # how long the last committed step took
        self._phase = "init"
        self._in_update = False
        self._dirty = False
        self._needs_state = env.replacement  # True until this rank holds a trusted state
        self._pending_plan: P.RepairPlan | None = None
        self._init_skip: InitSkip | None = None  # a replacement's skipped random init (skip_init)
        self._pending_exc: BaseException | None = None
        self._ckpt_dir: str | None = None
        self._ckpt_every = 0
        self._finished = False
        self._total_steps: int | None = None
        self.last_recovery: dict[str, float] = {}
        self.last_plan: P.RepairPlan | None = None  # the plan of the latest completed round
        # Called with the generation once a recovery round has rebuilt the default group and
        # the runtime's own groups: a framework re-creates its groups here (see callbacks).
        self.on_rebuild: Callable[[int], None] | None = None
        self._t_created = time.monotonic()
        # wall-clock edges of the current recovery round (sent with "recovered"; events.jsonl
        # `rank-recovered.marks`, drawn by `ftctl report`) and the state bytes moved in it
        self._marks: dict[str, float] = {"started": time.time()} if env.replacement else {}
        self._moved = {"transfer_bytes": 0, "transfer_s": 0.0}
        self._grad_syncs = GradientSyncs()
        # called with the new generation after every group rebuild (rt.ddp rebuilds DDP there)
        self._rebuild_listeners: list[Callable[[int], None]] = [
            lambda g: self._grad_syncs.abandon_all()
        ]

    # ================================================================ start-up
    def _start(self) -> None:
        env = self.env
        atexit.register(self._atexit)
        if not env.managed:
            self.log(
                "no FTRUN_AGENT_SOCKET: running without an ftrun agent, so no process-level recovery"
            )
            if not dist.is_initialized():
                dist.init_process_group(self.backend, timeout=timedelta(seconds=env.store_timeout))
            self._store = dist.distributed_c10d._get_default_store()
            return
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        # held on this (the training) thread until the process ends: the agent learns of this
        # process's death before the kernel has torn it down (launcher.protocol.death_notice)
        self._death_notice = death_notice.hold(env.death_notice)
        self._channel = AgentChannel(
            env.agent_socket or "",
            env.rank,
            self._stop,
            self.log,
            heartbeat_interval=self.options.heartbeat_interval,
            on_inject=lambda m: self._injector.arm(dataclasses.asdict(m)),
        )
        self._channel.start(
            Hello(
                rank=env.rank,
                local_rank=env.local_rank,
                pid=os.getpid(),
                generation=env.generation,
                replacement=env.replacement,
                notice_tid=self._death_notice.tid if self._death_notice else 0,
            )
        )
        self._channel.set_progress_source(self._progress_now)
        self._channel.update(generation=self.generation)
        self._store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            is_master=False,
            timeout=timedelta(seconds=env.store_timeout),
            wait_for_workers=False,
        )
        if env.replacement:
            self.log(f"replacement for rank {env.rank}: joining generation {self.generation}")
            while True:
                try:
                    self._pending_plan = self._join_round(self.generation)
                    break
                except StopRequested:
                    # our round was superseded (another rank failed meanwhile): join the newer one
                    self.log(
                        f"generation {self.generation} superseded before it completed; joining "
                        f"generation {self._stop.target}"
                    )
                    self.generation = self._stop.target
            self._build_world(self.generation, rebuild_groups=False)
            if env.skip_init and self._store_try_get(P.skip_init_off_key()) is None:
                self._init_skip = InitSkip()
                self._init_skip.open()  # closed before the received state is applied
        else:
            self._build_world(self.generation, rebuild_groups=False)
        self.log(
            f"joined generation {self.generation} (world {self.world_size}, backend {self.backend}, "
            f"device {self.adapter.name})"
        )

    def _build_world(self, generation: int, rebuild_groups: bool) -> None:
        store = dist.PrefixStore(P.pg_prefix(generation), self._store)
        with self._sockets.track(generation):
            dist.init_process_group(
                self.backend,
                store=store,
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=self.env.store_timeout),
            )
            if rebuild_groups:
                self._groups.rebuild(generation)
        if rebuild_groups:
            for listener in list(self._rebuild_listeners):
                listener(generation)
            if self.on_rebuild is not None:
                self.on_rebuild(generation)
        self._mark("rebuilt")

    def _teardown_world(self) -> None:
        if not dist.is_initialized():
            return
        c10d = dist.distributed_c10d
        groups = list(c10d._world.pg_map.keys())
        self._graveyard.keep(*groups)  # never let a group with a stuck op be destroyed
        self._sockets.forget(self._stop.target)  # every group is about to be destroyed
        self.adapter.abort_groups(groups)
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - the old world is discarded either way
            self.log(
                f"destroying generation {self.generation}'s groups failed ({exc}); dropping them"
            )
            c10d._update_default_pg(None)
            for table in (
                c10d._world.pg_map,
                c10d._world.pg_names,
                c10d._world.pg_group_ranks,
                c10d._world.pg_backend_config,
                c10d._world.pg_to_tag,
                c10d._world.tags_to_pg,
            ):
                table.clear()
            c10d._world.group_count = 0

    def _break_old_groups(self, target: int) -> None:
        """On a stop (the channel's reader thread): with collectives that wait in C++ (DDP's own
        reducer under rt.ddp), shut down the sockets of the older generations' groups so that such a
        wait fails at once instead of waiting for a hung peer (see group_sockets)."""
        if self._sockets.enabled:
            n = self._sockets.break_before(target)
            if n:
                self.log(
                    f"stop for generation {target}: shut down {n} sockets of the older groups "
                    "(leaves DDP's waits in C++)"
                )
            if self._stuck_alarm is not None:
                self._stuck_alarm.arm(target)

    def _report_stuck(self, target: int) -> None:
        """(the alarm's timer) The training thread stayed in its C++ wait after the break: tell
        the agent, which replaces this rank in the round now (see StuckWaitAlarm)."""
        self.log(
            f"still inside a collective wait in C++ {STUCK_AFTER_BREAK_S:g}s after the stop for generation "
            f"{target} shut down its sockets: a send gloo had queued on a failed connection, which gloo "
            "never fails; asking the agent to replace this rank"
        )
        if self._channel is not None:
            self._channel.update(stuck=True)

    def _enable_cpp_waits(self) -> None:
        """Something waits for collectives in C++ from now on (DDP's own reducer): break
        those waits on a stop, and report them to the agent as waiting on peers. gloo only: its
        waits block the training thread on sockets. NCCL/HCCL waits do not block the host (the
        stream waits), their groups are aborted through the device adapter, and there the
        backward runs on device threads, so a training thread without CPU inside backward is
        computing, not waiting: the probe would be wrong."""
        if self._sockets.enabled or self.backend != "gloo":
            return
        self._sockets.enabled = True
        if self._channel is not None:
            codes = cpp_wait_codes()
            self._channel.set_wait_probe(CppWaitProbe(codes))
            self._stuck_alarm = StuckWaitAlarm(
                codes, lambda g: self.generation >= g, self._report_stuck
            )

    def _note_waiting(self, busy: bool) -> None:
        if self._channel is not None:
            self._channel.update(waiting=busy)

    def _abort_groups(self) -> None:
        if dist.is_initialized():
            self.adapter.abort_groups(list(dist.distributed_c10d._world.pg_map.keys()))

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

        def as_list(x: Any) -> list:
            return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]

        if self._registered:
            raise RuntimeError(
                "register() was already called; call it once with every stateful object"
            )
        models, opts, scheds = as_list(model), as_list(optimizer), as_list(scheduler)
        for m in models:
            if not isinstance(m, torch.nn.Module):
                raise TypeError(f"model must be a torch.nn.Module, got {type(m).__name__}")
        for o in opts:
            if not isinstance(o, torch.optim.Optimizer):
                raise TypeError(
                    f"optimizer must be a torch.optim.Optimizer, got {type(o).__name__}"
                )
        for s in scheds:
            if not (hasattr(s, "state_dict") and hasattr(s, "load_state_dict")):
                raise TypeError(f"scheduler {type(s).__name__} lacks state_dict/load_state_dict")
        if data is not None and (len(data) != 2 or not all(callable(f) for f in data)):
            raise TypeError("data must be a (get_position, set_position) pair of callables")
        extras = dict(extra or {})
        for k, v in extras.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"extra[{k!r}] must be a tensor, got {type(v).__name__}")
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every={checkpoint_every} must be >= 0")
        if checkpoint_every and not checkpoint_dir:
            raise ValueError("checkpoint_every needs checkpoint_dir")
        self._reg = Registered(models, opts, scheds, data, extras, on_rollback)
        self._ckpt_dir = os.fspath(checkpoint_dir) if checkpoint_dir else None
        self._ckpt_every = checkpoint_every
        self._registered = True
        self._mark("registered")  # a replacement: its script has built model and optimizer

    def set_layout(
        self, dp: int, tp: int = 1, pp: int = 1, optimizer_shards: int = 1
    ) -> dict[str, GroupHandle]:
        """Megatron-style layout: creates the "dp", "tp" and "pp" groups (those larger than one
        rank) and derives replica identity. Returns this rank's handles by name."""
        self._set_layout(Layout.from_parallel(self.world_size, dp, tp, pp, optimizer_shards))
        handles = {}
        for name, partition in parallel_groups(self.world_size, dp, tp, pp).items():
            if len(partition[0]) > 1:
                handles[name] = self.new_group(name, partition)
            else:
                handles[name] = GroupHandle(name, [self.rank], None, self.generation)
        return handles

    def set_replica_groups(self, groups: Sequence[Sequence[int]]) -> None:
        """Explicit replica groups: ranks in one group hold equal state."""
        self._set_layout(Layout.from_groups(groups, self.world_size))

    def _set_layout(self, layout: Layout) -> None:
        self._layout = layout
        self._publish_shard()

    def _publish_shard(self) -> None:
        if self.env.managed:
            self._store.set(P.replica_key(self.rank), self._layout.shard_of(self.rank).encode())

    @property
    def shard(self) -> str:
        return self._layout.shard_of(self.rank)

    def new_group(self, name: str, ranks: Sequence[int] | Sequence[Sequence[int]]) -> GroupHandle:
        """Create a process group every rank calls in the same order; the handle's `.group` is
        re-pointed after each recovery. `ranks` is one list or a partition (list of lists)."""
        partition = (
            [list(r) for r in ranks]
            if ranks and isinstance(ranks[0], (list, tuple))
            else [list(ranks)]
        )
        with self._sockets.track(self.generation):
            return self._groups.create(name, partition, self.generation)  # type: ignore[arg-type]

    def group(self, name: str) -> GroupHandle:
        return self._groups.get(name)

    # ================================================================ collectives
    def _pg(self, group: GroupHandle | None) -> Any:
        return None if group is None else group.group

    def all_reduce(
        self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: GroupHandle | None = None
    ) -> torch.Tensor:
        """In-place all_reduce that a stop can interrupt (raises StopRequested)."""
        if group is not None and group.size <= 1:
            return tensor
        return self._coll.all_reduce(tensor, op, self._pg(group))

    def broadcast(
        self, tensor: torch.Tensor, src: int, group: GroupHandle | None = None
    ) -> torch.Tensor:
        if group is not None and group.size <= 1:
            return tensor
        return self._coll.broadcast(tensor, src, self._pg(group))

    def all_gather(
        self, tensor: torch.Tensor, group: GroupHandle | None = None
    ) -> list[torch.Tensor]:
        size = self.world_size if group is None else group.size
        out = [torch.empty_like(tensor) for _ in range(size)]
        if size == 1:
            out[0].copy_(tensor)
            return out
        return self._coll.all_gather(out, tensor, self._pg(group))

    def barrier(self, group: GroupHandle | None = None) -> None:
        if group is not None and group.size <= 1:
            return
        self._coll.barrier(self._pg(group))

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
        parameters taking part (those with requires_grad) are read at the first call for `model`."""
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
        return RuntimeDDP.build(self, module, **ddp_kwargs)

    def _grad_comm(self, group: GroupHandle | None) -> GradComm:
        if group is not None and self.rank not in group.ranks:
            raise ValueError(
                f"rank {self.rank} is not a member of group {group.name!r} ({group.ranks})"
            )
        return GradComm(
            self._coll,
            lambda: self._pg(group),
            self.world_size if group is None else group.size,
            0 if group is None else group.ranks[0],
            tuple(range(self.world_size)) if group is None else tuple(group.ranks),
        )

    # ================================================================ step loop
    def steps(self, total: int) -> Iterator[Step]:
        """Yield Step(k) for k from the resume point to total-1; recovery happens in here."""
        if not isinstance(total, int) or total < 0:
            raise ValueError(f"total steps {total!r} must be a non-negative integer")
        if not self._registered:
            raise RuntimeError("call rt.register(...) before rt.steps()")
        self._total_steps = total
        self._publish_shard()
        s = self._first_step()
        while s < total:
            if self._stop.newer_than(self.generation):
                s = self._recover()
                continue
            step = Step(self, s)
            yield step
            if not step.entered:
                raise RuntimeError("each Step from rt.steps() must be used as `with step:`")
            if step.interrupted:
                s = self._recover()
                continue
            if not step.updated:
                self._commit(s)
            try:
                self._maybe_checkpoint(s + 1)
            except StopRequested as exc:
                self.log(f"checkpoint of iteration {s + 1} abandoned: {exc}")
                s = self._recover()
                continue
            s += 1
        self._set_phase("done")

    def _first_step(self) -> int:
        if self._pending_plan is not None:
            plan, self._pending_plan = self._pending_plan, None
            if self._stop.newer_than(self.generation):
                return self._recover()  # our round was superseded before we got here
            try:
                t0 = time.monotonic()
                resume = self._execute(plan)
            except StopRequested:
                return self._recover()
            self.last_recovery = {
                "repair_s": time.monotonic() - t0,
                "since_init_s": time.monotonic() - self._t_created,
            }
            self.log(
                f"replacement resumes at step {resume} (repair {self.last_recovery['repair_s']:.3f} s)"
            )
            if self._channel is not None:
                self._channel.send(
                    Recovered(
                        self.rank,
                        plan.generation,
                        resume,
                        plan.action,
                        replacement=True,
                        timings=self._timings(),
                        **self._take_marks(),
                    )
                )
            heap.settle()  # the heap its spare faulted in is used: shrink like any process again
            return resume
        start = 0
        if self._ckpt_dir:
            start = self.load_checkpoint()
        self._snapshots = {start: self._reg.snapshot(start, self.adapter)}
        self._committed = start - 1
        self._current_step = start - 1
        self._needs_state = False
        return start

    def _begin_step(self, step: Step) -> None:
        index = step.index
        self._current_step = index
        self._step_t0 = time.monotonic()
        snaps = self._snapshots
        if len(snaps) == 2 and index in snaps and index - 1 in snaps:
            del snaps[index - 1]  # the usual case: the previous step's, kept until this one began
        elif len(snaps) > 1 or index not in snaps:
            self._snapshots = snaps = {k: v for k, v in snaps.items() if k >= index}
        # Usually taken when the previous step committed: that snapshot already is the state a
        # committed recovery resumes from (so it is complete), and re-taking it costs per step.
        if index not in snaps:
            snaps[index] = self._reg.snapshot(index, self.adapter)
        self._phase = "step"

    def _enter_phase(self, step: Step, name: str, check: bool = True) -> None:
        if check and self._stop.newer_than(self.generation):
            raise StopRequested(self._stop.target, f"start of {name}")
        self._set_phase(name)
        self._injector.maybe_fire(self.generation, step.index, name)

    def _set_phase(self, name: str) -> None:
        """The rank's phase. The agent channel's writer reads it (`_progress_now`) at its next
        poll: a phase edge of a step costs an attribute store, no call into the channel; the
        runtime's own phases outside steps (recovering, resumed, checkpoint, done) wake it."""
        self._phase = name
        if name in _PROMPT_PHASES and self._channel is not None:
            self._channel.wake()

    def _progress_now(self) -> tuple[int, str, int, float | None]:
        """(step, phase, committed step, last step time) for the channel's heartbeats."""
        return self._current_step, self._phase, self._committed, self._last_step_s

    def _check_stop(self, where: str) -> None:
        if self._stop.newer_than(self.generation):
            raise StopRequested(self._stop.target, where)

    def _commit(self, index: int) -> None:
        self._committed = index
        self._snapshots[index + 1] = self._reg.snapshot(index + 1, self.adapter)
        if not self._state_told and self._channel is not None:
            # once, when the optimizer state exists: the agent's spares fault in that much heap
            self._state_told = True
            self._channel.update(state_bytes=self._reg.state_bytes())
        # the agent's hang watch learns step times from this, however the heartbeats of a fast
        # loop are coalesced (it may never see two steps' starts apart)
        if self._step_t0 is not None:
            self._last_step_s = time.monotonic() - self._step_t0
        self._phase = "committed"

    def _end_step(self, step: Step, exc: BaseException | None) -> bool:
        if exc is None:
            return False
        if isinstance(exc, StopRequested):
            return self._stopped(step, exc)
        if not isinstance(exc, Exception) or not self.env.managed:
            return False
        if isinstance(exc, CollectiveError):
            return False  # the agent never answered: let it propagate
        if self._sockets.enabled and isinstance(exc, RuntimeError):
            stop = self._left_cpp_wait(exc)
            if stop is not None:
                return self._stopped(step, stop)
            if is_backend_failure(exc):
                return False  # the agent never answered: let it propagate
        found = self.adapter.classify_exception(exc)
        kind = found.kind if found else EXCEPTION
        injected = isinstance(exc, InjectedFault)
        lost_state = kind in (UCE_HIGH, UNSAFE_DATA) or self._in_update
        self.report_fault(
            kind,
            f"{type(exc).__name__}: {exc}",
            injected=injected,
            fatal=bool(found and found.fatal),
        )
        if found and found.fatal:
            self.log("fault is process-fatal; exiting so the agent restarts this rank")
            self._hard_exit(1)
        self._dirty = self._dirty or lost_state
        self._in_update = False
        self._pending_exc = exc
        step.interrupted = True
        return True

    def _stopped(self, step: Step, exc: StopRequested) -> bool:
        step.interrupted = True
        self._dirty = self._dirty or self._in_update
        self.log(
            f"stopped in step {step.index} phase {self._phase} "
            f"({'inside the optimizer update' if self._in_update else 'state clean'}): {exc}"
        )
        self._in_update = False
        return True

    def _left_cpp_wait(self, exc: RuntimeError) -> StopRequested | None:
        """A collective torch waited for in C++ (rt.ddp's reducer) failed: because a stop broke
        it (a stop is pending) or a peer is gone (then wait for the agent's stop, as a failed
        runtime collective does). The stop to handle, or None: not a collective failure, or
        the agent never answered."""
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        if self._stop.newer_than(self.generation):
            return StopRequested(self._stop.target, f"left DDP's collective in C++: {first}")
        if not is_backend_failure(exc):
            return None
        try:
            self._on_collective_error(exc, "DDP collective")
        except StopRequested as stop:
            return stop
        return None

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
        label = "INJECTED " if injected else ""
        self.log(
            f"{label}fault kind={kind} in step {self._current_step} phase {self._phase}: {message}"
        )
        if self._channel is not None:
            self._channel.send(
                FaultReport(
                    self.rank,
                    kind,
                    message[:2000],
                    self._current_step,
                    self._phase,
                    injected=injected,
                    fatal=fatal,
                    generation=self.generation,
                    collective=collective,
                )
            )

    def _timings(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in self.last_recovery.items()}

    def _on_collective_error(self, exc: BaseException, what: str) -> None:
        if not self.env.managed:
            return
        gen = self.generation
        self.log(
            f"{what} failed ({str(exc).splitlines()[0][:200]}); waiting {self.options.network_grace:.0f} s "
            "for the agent's stop"
        )
        if self._stop.wait_newer(gen, self.options.network_grace):
            raise StopRequested(self._stop.target, f"after {what} error")
        self.report_fault(NETWORK, f"{what}: {exc}", collective=what)
        if self._stop.wait_newer(gen, self.env.store_timeout):
            raise StopRequested(self._stop.target, f"after {what} error")

    # ================================================================ recovery
    def _status(self, generation: int) -> P.RankStatus:
        return P.RankStatus(
            rank=self.rank,
            generation=generation,
            replacement=self._needs_state,
            committed_step=-1 if self._needs_state else self._committed,
            step=self._current_step,
            dirty=self._dirty,
            shard=self._shard_for_status(),
            pid=os.getpid(),
            host=socket.gethostname(),
        )

    def _shard_for_status(self) -> str:
        if not self._registered and self.env.managed:
            raw = self._store_try_get(P.replica_key(self.rank))  # our predecessor's layout
            if raw is not None:
                return raw.decode()
        return self._layout.shard_of(self.rank)

    def _store_try_get(self, key: str) -> bytes | None:
        return self._store.get(key) if self._store.check([key]) else None

    def _join_round(self, generation: int) -> P.RepairPlan:
        """Post this rank's status for `generation` and wait for the controller's plan."""
        self.generation = generation
        if self._channel is not None:  # heartbeats from now on answer the stop of this round
            self._channel.update(generation=generation, stuck=False)
        self._set_phase("recovering")
        self._mark("status")
        status = self._status(generation)
        self._store.set(P.status_key(generation, self.rank), status.to_json())
        self.log(
            f"posted status: committed_step={status.committed_step} step={status.step} "
            f"dirty={status.dirty} replacement={status.replacement} shard={status.shard!r}"
        )
        # the round's critical path: every rank of the round waits for this key, the slowest
        # reader holds up the group rebuild, so poll it finely (a round lasts ~0.1 s)
        raw = self._wait_key(
            P.repair_key(generation),
            "the controller's repair plan",
            max_delay=self.options.plan_poll_interval,
        )
        plan = P.RepairPlan.from_json(raw)
        self._mark("plan")
        self.log(
            f"repair plan: resume_step={plan.resume_step} action={plan.action} pairs={plan.pairs} "
            f"fallback={plan.fallback} ({plan.reason})"
        )
        if plan.fallback:
            self._fallback(plan)
        return plan

    def _wait_key(self, key: str, what: str, max_delay: float | None = None) -> bytes:
        gen = self.generation
        deadline = time.monotonic() + self.env.store_timeout
        cap = self.options.poll_interval if max_delay is None else max_delay
        delay = min(0.002, cap)
        while True:
            if self._store.check([key]):
                return self._store.get(key)
            if self._stop.newer_than(gen):
                raise StopRequested(self._stop.target, f"while waiting for {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{what} ({key}) did not appear within {self.env.store_timeout:.0f} s"
                )
            self._stop.wait_newer(gen, delay)
            delay = min(delay * 2, cap)

    def _recover(self) -> int:
        """Run recovery rounds until one completes; returns the step to resume at."""
        t_stop = time.monotonic()
        self._mark("stopped")
        if not self._stop.newer_than(self.generation):
            self.log(
                f"waiting up to {self.env.store_timeout:.0f} s for the agent's stop after the fault"
            )
            if not self._stop.wait_newer(self.generation, self.env.store_timeout):
                exc = self._pending_exc or RuntimeError("recovery requested but no stop arrived")
                raise exc
        self._pending_exc = None
        while True:
            target = self._stop.target
            self.log(f"recovery round for generation {target} starts")
            self.adapter.stop_device()
            self._teardown_world()
            self.adapter.restart_device()
            try:
                t0 = time.monotonic()
                plan = self._join_round(target)
                t1 = time.monotonic()
                self._build_world(target, rebuild_groups=True)
                t2 = time.monotonic()
                resume = self._execute(plan)
                t3 = time.monotonic()
            except StopRequested as exc:
                self.log(f"recovery round interrupted: {exc}")
                continue
            except Exception as exc:  # noqa: BLE001 - a newer stop explains most failures
                if self._stop.wait_newer(target, self.options.network_grace):
                    self.log(f"recovery round failed ({exc}); a newer generation was requested")
                    continue
                raise
            self.last_recovery = {
                "stop_s": t0 - t_stop,
                "plan_wait_s": t1 - t0,
                "rebuild_s": t2 - t1,
                "repair_s": t3 - t2,
                "total_s": t3 - t_stop,
            }
            if self._channel is not None:
                self._channel.send(
                    Recovered(
                        self.rank,
                        target,
                        resume,
                        plan.action,
                        timings=self._timings(),
                        **self._take_marks(),
                    )
                )
            self.log(
                f"recovered into generation {target}: resume at step {resume} "
                f"(plan wait {t1 - t0:.3f} s, rebuild {t2 - t1:.3f} s, repair {t3 - t2:.3f} s)"
            )
            return resume

    def _execute(self, plan: P.RepairPlan) -> int:
        """Restore/transfer along the plan, post resumed, return the resume step."""
        resume = plan.resume_step
        self.last_plan = plan
        sources = [
            src for src, dst in plan.pairs if dst == self.rank
        ]  # >1: striped, in stripe order
        if len(set(sources)) != len(sources) or self.rank in sources:
            raise RuntimeError(
                f"repair plan names sources {sources} for rank {self.rank}: {plan.pairs}"
            )
        if sources and not self._registered:
            raise RuntimeError("a replacement must call rt.register(...) before rt.steps()")
        snap: Snapshot | None = None
        if not sources:
            if self._needs_state or self._dirty:
                raise RuntimeError(
                    f"rank {self.rank} holds no trusted state but the plan gives it no source"
                )
            snap = self._snapshots.get(resume)
            if snap is None:
                raise RuntimeError(
                    f"rank {self.rank} has no step-start state for step {resume} "
                    f"(has {sorted(self._snapshots)}); the plan does not match this rank"
                )
            self._reg.restore(snap, self.adapter)
        stripes: dict[int, list[int]] = {}
        for src, dst in plan.pairs:
            stripes.setdefault(dst, []).append(src)
        for dst, srcs in stripes.items():
            if self.rank in srcs:
                assert snap is not None
                stats = send_state(
                    self._coll,
                    self._reg.full_state(snap),
                    dst,
                    srcs.index(self.rank),
                    len(srcs),
                    midway=lambda: self._injector.maybe_fire(plan.generation, resume, "transfer"),
                )
                self._moved["transfer_s"] += stats.seconds
                part = f"stripe {srcs.index(self.rank)}/{len(srcs)} of " if len(srcs) > 1 else ""
                how = "read from this rank's memory" if stats.path == "memory" else "sent"
                self.log(
                    f"{how}: {part}state to rank {dst}, {stats.nbytes / 1e6:.1f} MB in {stats.tensors} "
                    f"tensors, {stats.seconds:.3f} s ({stats.gbps:.2f} GB/s)"
                )
            elif dst == self.rank:
                self._close_init_skip(self._reg.overwritten())
                state, stats = recv_state(self._coll, srcs, self._reg.live_tensors())
                self._moved = {
                    "transfer_bytes": stats.nbytes,
                    "transfer_s": stats.seconds,
                    "source": srcs[0],
                    "transfer_path": stats.path,
                }
                if state["step"] != resume:
                    raise RuntimeError(
                        f"ranks {srcs} sent the state of step {state['step']}, plan resumes at {resume}"
                    )
                self._reg.load_full_state(state, self.adapter)
                self._mark("received")
                if stats.fallback:
                    self.log(
                        f"reading the state from the sender's memory failed ({stats.fallback}); "
                        f"it came over the network"
                    )
                self.log(
                    f"received state from rank {','.join(map(str, srcs))} ({stats.path}): "
                    f"{stats.nbytes / 1e6:.1f} MB in {stats.tensors} tensors, {stats.seconds:.3f} s "
                    f"({stats.gbps:.2f} GB/s; {stats.phases})"
                )
                snap = self._reg.snapshot(resume, self.adapter)
                if self._reg.on_rollback is not None:
                    self._reg.on_rollback(resume)
        if plan.pairs:
            # every rank leaves the round together: ranks outside the transfers sleep in this
            # barrier instead of computing the resume step on the CPUs the transfer needs (their
            # step would block on the replacement's gradients anyway)
            self._coll.barrier(what="end of state transfer")
        assert snap is not None
        self._snapshots = {resume: snap}
        self._committed = resume - 1
        self._current_step = resume - 1
        self._dirty = False
        self._needs_state = False
        self._in_update = False
        self._store.set(P.resumed_key(plan.generation, self.rank), str(resume).encode())
        self._mark("repaired")
        self._set_phase("resumed")
        return resume

    def _close_init_skip(self, covered: Any) -> None:
        """End the skipped-init window before a received state is applied (see skip_init); exit
        (1) when the skip cannot be proven harmless, after marking the job so that the next
        replacement inits normally."""
        if self._init_skip is None:
            return
        res, self._init_skip = self._init_skip.close(covered), None
        if res.diverged is None:
            if res.skipped:
                self.log(
                    f"skipped {res.skipped} random parameter inits the received state overwrites"
                )
            return
        self._store.set(P.skip_init_off_key(), b"1")
        self.log(
            f"skipped random parameter inits cannot be proven harmless: {res.diverged}; exiting so "
            "that a new replacement inits normally (FTRUN_SKIP_INIT=0 turns the skip off)"
        )
        self._hard_exit(1)

    def _mark(self, edge: str) -> None:
        """Wall-clock time of one edge of a recovery round (inside a round only)."""
        if self._marks or edge in ("stopped", "status"):
            self._marks[edge] = round(time.time(), 4)

    def _take_marks(self) -> dict:
        """The round's edges and bytes moved, for the "recovered" message; resets both."""
        out = {"marks": self._marks, **self._moved}
        self._marks, self._moved = {}, {"transfer_bytes": 0, "transfer_s": 0.0}
        return out

    def _fallback(self, plan: P.RepairPlan) -> None:
        self.log(
            f"peer repair impossible, fallback={plan.fallback}: {plan.reason}; exiting so the "
            "agents restart the job from the last durable checkpoint"
        )
        if plan.fallback == P.DUMP:
            self._dying_gasp(plan)
        self._hard_exit(P.EXIT_FALLBACK)

    def _dying_gasp(self, plan: P.RepairPlan) -> None:
        """Save the resume state of every shard when each has a writer (the controller's
        `plan_dump` chose the step and the writers)."""
        if not self._ckpt_dir or self._needs_state or self._dirty:
            return
        if self._committed != plan.resume_step - 1:
            return
        writers = plan.writers
        if set(writers) != set(self._layout.names):
            self.log(
                f"no dying-gasp checkpoint: shards {sorted(set(self._layout.names) - set(writers))} "
                "have no healthy holder"
            )
            return
        snap = self._snapshots.get(plan.resume_step)
        if snap is None:
            return
        self._reg.restore(snap, self.adapter)
        self._save(
            plan.resume_step,
            snap,
            plan.generation,
            writers[self.shard] == self.rank,
            min(writers.values()) == self.rank,
        )

    # ================================================================ checkpoints
    def _maybe_checkpoint(self, iteration: int) -> None:
        if self._ckpt_every and iteration % self._ckpt_every == 0:
            self.save_checkpoint(iteration)

    def save_checkpoint(self, iteration: int) -> None:
        """Durable checkpoint of the state at the start of step `iteration` (call between steps)."""
        snap = self._snapshots.get(iteration)
        if snap is None or self._committed != iteration - 1:
            raise RuntimeError(
                f"checkpoint of iteration {iteration} requested, but the last completed "
                f"step is {self._committed}"
            )
        writer = self._layout.writer_of(self.rank) == self.rank
        self._set_phase("checkpoint")
        self._save(iteration, snap, self.generation, writer, self.rank == 0)

    def _save(
        self, iteration: int, snap: Snapshot, generation: int, writer: bool, committer: bool
    ) -> None:
        assert self._ckpt_dir is not None
        name = self._layout.checkpoint_name(self.rank)
        if writer:
            t0 = time.monotonic()
            ckpt.write_shard(self._ckpt_dir, iteration, name, self._reg.full_state(snap))
            self._store.set(P.ckpt_key(generation, iteration, name), b"1")
            self.log(
                f"checkpoint shard {name} of iteration {iteration} written in {time.monotonic() - t0:.3f} s"
            )
        if committer:
            for shard in self._layout.checkpoint_names:
                self._wait_key(
                    P.ckpt_key(generation, iteration, shard), f"checkpoint shard {shard}"
                )
            final = ckpt.commit(self._ckpt_dir, iteration, list(self._layout.checkpoint_names))
            self.log(f"checkpoint {final} committed")

    def load_checkpoint(self) -> int:
        """Load the latest durable checkpoint (if any) into the registered objects; returns the
        step to start at (0 without a checkpoint)."""
        if not self._ckpt_dir:
            return 0
        iteration = ckpt.latest(self._ckpt_dir)
        if iteration is None:
            return 0
        state = ckpt.read_shard(self._ckpt_dir, iteration, self._layout.checkpoint_name(self.rank))
        self._reg.load_full_state(state, self.adapter)
        self.log(f"loaded checkpoint iteration {iteration} from {self._ckpt_dir}")
        return iteration

    # ================================================================ the end
    @property
    def committed_step(self) -> int:
        return self._committed

    def finish(self) -> None:
        """Say goodbye to the agent and leave. When collectives of earlier generations were
        abandoned this exits the process (os._exit(0)) so their destructors cannot block:
        call it last."""
        if self._finished:
            return
        self._finished = True
        if self._stuck_alarm is not None:
            self._stuck_alarm.cancel()
        self._set_phase("done")
        abandoned = len(self._graveyard)
        if not abandoned and dist.is_initialized():
            dist.destroy_process_group()
        if self._channel is not None:
            self._channel.close(bye=True)
            self._channel = None
        self.log(
            "finished"
            + (f"; {abandoned} abandoned collectives/groups, exiting now" if abandoned else "")
        )
        if abandoned:
            self._hard_exit(0)

    def _hard_exit(self, code: int) -> None:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)

    def _atexit(self) -> None:
        if len(self._graveyard) and not self._finished:
            self.log(
                "interpreter exit without rt.finish() while abandoned collectives exist; exiting hard"
            )
            self._hard_exit(1)


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
    rt._start()
    return rt
