"""Stock torch DistributedDataParallel under the runtime: `model = rt.ddp(module, **ddp_kwargs)`.

Owns: `RuntimeDDP`, a real `DistributedDataParallel` that survives recoveries bit-identically:
which reducer runs (DDP's own, or one with the runtime's comm hook), the bucket layout each step
all-reduces, the check of DDP options (those whose collectives would bypass the runtime are
refused with one line naming the option), and `BucketComm`, the comm hook.

Steady state: DDP's own reducer (FTRUN_DDP_COMM=reducer, the default).
- DDP's C++ reducer runs on the runtime's group of the current generation, exactly as plain DDP
  runs on its group: bucketed all-reduces start while backward goes on, DDP averages and waits
  in C++, no Python per bucket; numerics are plain DDP's.
- Gradients: .grad are views into DDP's buckets (gradient_as_bucket_view=True) unless the caller
  passes the option, when the group's size N is a power of two. DDP's default copies each
  gradient into its bucket multiplied by 1/N and the result back into .grad; as views there is
  no copy back (one pass over the gradients less per step), and a .grad kept between steps
  (zero_grad(set_to_none=False), no_sync() accumulation) is divided by N in place. x / N and
  x * (1/N) are the same number when N is a power of two (1/N is exact), so the parameters are
  plain DDP's bit for bit; for other N (3 ranks: the last bit differs) the default stays DDP's.
  What the user sees with views: an in-place `p.grad.detach_()` raises (`zero_grad()` works
  either way), and a reference to an old .grad kept across steps is overwritten by the next
  step's result, as torch documents for the option.
- Leaving its waits: a stop makes the runtime shut down the sockets of the older generations'
  groups (launcher.runtime.group_sockets), so a C++ wait on a peer that will never answer fails
  at once; a peer's death fails it by itself. `loss.backward()` (or the forward, for DDP's
  bucket-rebuild broadcast) then raises; the step's exit turns that into the stop
  (StepPath.end). While it waits, the agent channel's writer reports the rank as waiting on
  its peers (launcher.runtime.wait_probe), so the hang watch blames the hung rank, not them.
- After every recovery round each rank forgets the old generation's comm state and builds
  nothing on the round's critical path (the layout a reducer is built with is noted as DDP
  builds it, not read back from a zero-filled copy of its buckets); the first forward of the
  resumed step settles the new reducer (`_ft_settle`): at step 0 DDP's first-iteration layout,
  which DDP rebuilds at step 1 from rank 0's gradient-ready order as plain DDP does; at a later
  step the layout DDP rebuilt, taken from the first rank that knows it (a survivor) and given to
  the new reducer, so the step adds the same numbers in the same order as without the fault.
  When no rank knows it (every rank started anew from a checkpoint) that one step runs through
  the comm hook below, which learns it, and the next forward hands
  the learnt layout to DDP's reducer.

The comm hook (FTRUN_DDP_COMM=hook for every step; otherwise only for such a learning step):
- DDP runs on a one-rank gloo group of its own; the hook scales each bucket by 1/N and starts
  its all_reduce on the runtime's group at once, asynchronously; a callback queued on the
  autograd engine waits for them through the runtime's interruptible wait before DDP copies the
  results into .grad. A stop raised there comes out of `loss.backward()` as StopRequested.
- .grad are bucket views by default here for any N (the hook's own x * (1/N) is then the only
  pass over them).
- The layout: step 0 uses DDP's initial one; later steps the one DDP rebuilds from the order
  gradients became ready (rank 0's order, broadcast through the runtime); DDP's buckets that
  differ from it are repacked into it. Whether DDP's bucket k holds the layout's bucket k is
  checked once per layout, not every step.

A live shrink (elastic-training, launcher.runtime.elastic): the rebuild after it re-makes the
gradient communication for the smaller world (the default group's members, or the surviving
members of a `process_group` handle). DDP's own reducer would divide by the smaller group, but
the global batch is kept by dividing by the original one, so while the world is shrunk every
step runs through the comm hook, which scales by 1/original, with the layout of steps >= 1 the
survivors agree on; the grow back's rebuild settles DDP's own reducer on the full group again.

Both: module buffers (`broadcast_buffers`) and the initial parameter sync (`init_sync`) are
broadcast from the group's first rank through the runtime; a replacement rank skips the initial
sync (its state comes from a replica). Buffers are broadcast right after each synced forward
instead of before the next: forwards compute exactly as under plain DDP and every rank holds the
same buffers between steps (plain DDP leaves rank-local values there, which could not be
recovered when rank 0 is lost). What each path costs per step against plain DDP in the same
process: scripts/bench_step_cost.py.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from launcher.runtime.buckets import FlatBucket, GradComm
from launcher.runtime.groups import GroupHandle


@dataclass(frozen=True)
class DDPHost:
    """What `RuntimeDDP` needs from the runtime that builds it (`Runtime.ddp`)."""

    rank: int
    log: Callable[[str], None]
    comm_mode: str  # FTRUN_DDP_COMM: "reducer" (DDP's own, once it may) or "hook"
    grad_comm: Callable[[GroupHandle | None], GradComm]  # the all-reduce of a group's grads
    current_step: Callable[[], int]
    enable_cpp_waits: Callable[[], None]  # collectives wait in C++ from now on (DDP's reducer)
    needs_state: bool  # a replacement: its state comes from a replica (no initial sync)
    on_rebuild: Callable[[Callable[[int], None]], None]  # adds a listener to group rebuilds


# DDP options whose collectives run on DDP's own group, outside the runtime: refused when set.
REFUSED = {
    "find_unused_parameters": (
        "its unused-parameter all-reduce runs inside DDP, outside the runtime"
    ),
    "static_graph": "its unused-parameter all-reduce runs inside DDP, outside the runtime",
    "delay_all_reduce_named_params": "its delayed all-reduce runs inside DDP, outside the runtime",
    "param_to_hook_all_reduce": "its delayed all-reduce runs inside DDP, outside the runtime",
    "skip_all_reduce_unused_params": "it needs find_unused_parameters",
    "mixed_precision": "its casts are not part of the runtime's bit-identical recovery",
    "device_mesh": "pass process_group=<GroupHandle from rt.new_group / rt.set_layout> instead",
}


def _refuse(option: str, value: Any, why: str) -> ValueError:
    return ValueError(f"rt.ddp: {option}={value!r} is not supported: {why}")


def check_options(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Raise ValueError (one line naming the option) for options that would bypass the runtime."""
    for option, why in REFUSED.items():
        value = kwargs.get(option)
        if value is not None and value is not False:
            raise _refuse(option, value, why)
    group = kwargs.get("process_group")
    if group is not None and not isinstance(group, GroupHandle):
        raise _refuse(
            "process_group",
            type(group).__name__,
            "pass a GroupHandle from rt.new_group / "
            "rt.set_layout (a torch group is not rebuilt after a recovery)",
        )
    for sub in module.modules():
        if isinstance(sub, torch.nn.SyncBatchNorm):
            raise _refuse(
                "module",
                "SyncBatchNorm",
                "its all_gather runs on its own group, outside the "
                "runtime; use BatchNorm (buffers are broadcast through the runtime)",
            )


def _comm_hook(state, bucket):  # noqa: ANN001, ANN202 - DDP checks the parameter name and annotations
    return state.on_bucket(bucket)


def _done(value: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


class BucketComm:
    """State of the comm hook of one RuntimeDDP (see the module docstring)."""

    def __init__(self, comm: GradComm, step: Callable[[], int], log: Callable[[str], None]) -> None:
        self._comm = comm
        self._step = step
        self._log = log
        self._told_repack = False
        self._params: list[torch.Tensor] = []  # the reducer's parameters, by reducer index
        self._index: dict[int, int] = {}  # id(param) -> reducer index
        self._caps: list[int] = []
        self._initial: list[list[int]] = []  # DDP's layout when built (step 0's layout)
        self._ready: list[list[int]] | None = None  # the ready-order layout, once learnt
        self._order: dict[int, None] = {}  # reducer indices in the order gradients became ready
        self._recorders: list[Any] = []
        self._scratch: dict[tuple[int, ...], FlatBucket] = {}
        self._scale = 1.0  # DDP's averaging factor (1.0 on a one-rank group: no pass)
        self.set_comm(comm)
        self.ddp_rebuilt: Callable[[], bool] = lambda: False  # set by RuntimeDDP.build
        # per DDP bucket index: does it hold exactly the target layout's bucket k? Checked once
        # per layout (the target's, DDP's own), not per step (bucket.parameters() builds a list)
        self._matches: dict[int, bool] = {}
        self._layout_key: tuple | None = None
        self._layouts_learnt = 0
        self._begin_backward()

    # ---- (re)build -------------------------------------------------------------------
    def set_comm(self, comm: GradComm) -> None:
        """The group of the current world (a live shrink or grow changes its size): the hook
        scales by 1/N, N the ranks the average divides by (after a shrink the original ones)."""
        self._comm = comm
        self._scale = 1.0 / (comm.divisor or comm.size)

    def adopt(self, layout: list[list[int]]) -> None:
        """The layout of steps >= 1, agreed by the ranks (the hook need not learn it)."""
        self._ready = [list(b) for b in layout]
        self._layouts_learnt += 1

    def built(self, params: list[torch.Tensor], initial: list[list[int]], caps: list[int]) -> None:
        """A fresh reducer: forget the learnt layout and record the next backward's order."""
        self.abandon()
        self._params = params
        self._index = {id(p): i for i, p in enumerate(params)}
        self._initial = initial
        self._caps = caps
        self._ready = None
        self._order = {}
        self._scratch = {}
        self._matches = {}
        self._layout_key = None
        self._told_repack = False
        self._remove_recorders()
        self._recorders = [
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self._order.setdefault(i))
            for i, p in enumerate(params)
        ]

    def _remove_recorders(self) -> None:
        for h in self._recorders:
            h.remove()
        self._recorders = []

    # ---- one backward ----------------------------------------------------------------
    def _begin_backward(self) -> None:
        self._target: list[list[int]] | None = None
        self._fast: list[tuple[Any, torch.Tensor]] = []  # (work, DDP bucket buffer)
        self._slow_from: int | None = None  # first layout bucket not all-reduced from a DDP bucket
        self._views: dict[int, torch.Tensor] = {}  # reducer index -> its view in a DDP bucket

    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        k = bucket.index()
        if k == 0:
            self._begin_backward()
            initial = self._step() <= 0
            self._target = self._initial if initial else self._ready
            key = (initial, self._layouts_learnt, self.ddp_rebuilt())
            if key != self._layout_key:  # another target layout or DDP rebuilt its buckets
                self._layout_key, self._matches = key, {}
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        buf = bucket.buffer()
        target = self._target
        if self._slow_from is None and target is not None:
            match = self._matches.get(k)
            if match is None:
                match = self._matches[k] = k < len(target) and target[k] == self._members(bucket)
            if match:
                if self._scale != 1.0:
                    buf.mul_(self._scale)
                self._fast.append((self._comm.all_reduce_async(buf), buf))
                return _done(buf)
        if self._slow_from is None:
            self._slow_from = k
        self._views.update(zip(self._members(bucket), bucket.gradients()))
        return _done(buf)

    def _members(self, bucket: dist.GradBucket) -> list[int]:
        return [self._index[id(p)] for p in bucket.parameters()]

    def finish(self) -> None:
        """Runs on the autograd engine after the last bucket, before DDP copies results."""
        try:
            if self._target is None:  # the first backward after a (re)build, past step 0
                self._target = self._ready = self._learn_layout()
                self._layouts_learnt += 1
            if self._slow_from is not None:
                self._repack(self._target[self._slow_from :])
                if not self._told_repack:
                    self._told_repack = True
                    self._log(
                        f"DDP's buckets differ from the layout of step {self._step()}: "
                        f"{len(self._target) - self._slow_from} buckets repacked into it"
                    )
            for work, buf in self._fast:
                self._comm.coll.wait(work, "DDP gradient all_reduce", (buf,))
            self._fast = []
            if self._ready is None:  # step 0: learn the layout of the steps after it
                self._ready = self._learn_layout()
                self._layouts_learnt += 1
        except BaseException:
            self.abandon()
            raise
        finally:
            self._begin_backward()

    def _repack(self, layout: list[list[int]]) -> None:
        launched = []
        for members in layout:
            flat_bucket = self._scratch.get(tuple(members))
            if flat_bucket is None:
                flat_bucket = self._scratch[tuple(members)] = FlatBucket(
                    [self._params[i] for i in members]
                )
            flat = flat_bucket.pack([self._views[i] for i in members])
            if self._scale != 1.0:
                flat.mul_(self._scale)
            flat_bucket.work = self._comm.all_reduce_async(flat)
            launched.append((flat_bucket, members))
        for flat_bucket, members in launched:
            self._comm.coll.wait(flat_bucket.work, "DDP gradient all_reduce", (flat_bucket.flat,))
            flat_bucket.work = None
            torch._foreach_copy_([self._views[i] for i in members], flat_bucket.views)

    def _learn_layout(self) -> list[list[int]]:
        """DDP's rebuilt layout from rank 0's gradient-ready order (broadcast through the
        runtime)."""
        n = len(self._params)
        order = list(self._order) + [i for i in reversed(range(n)) if i not in self._order]
        t = torch.tensor(order, dtype=torch.int64)
        self._comm.broadcast([t], "DDP bucket order")
        order = t.tolist()
        self._remove_recorders()
        self._order = {}
        layout, _ = dist._compute_bucket_assignment_by_size(
            [self._params[i] for i in order], self._caps, [False] * n, order
        )
        self._log(
            f"DDP bucket layout for steps >= 1: {len(layout)} buckets in rank {self._comm.root}'s "
            "gradient-ready order"
        )
        return [list(b) for b in layout]

    def abandon(self) -> None:
        """Give up in-flight all-reduces (after a stop): keep them for the rest of the process."""
        for work, buf in self._fast:
            self._comm.coll.abandon(work, buf)
        for flat_bucket in self._scratch.values():
            if flat_bucket.work is not None:
                self._comm.coll.abandon(*flat_bucket.drop())
        self._begin_backward()

    def broadcast(self, tensors: list[torch.Tensor], what: str) -> None:
        self._comm.broadcast(tensors, what)

    def learnt(self) -> list[list[int]] | None:
        """The layout of steps >= 1 the hook learnt (None before its first backward past step 0)."""
        return self._ready

    def release(self) -> None:
        """The reducer no longer calls this hook (rt.ddp moved to DDP's own reducer)."""
        self.abandon()
        self._remove_recorders()


class RuntimeDDP(DistributedDataParallel):
    """DistributedDataParallel whose collectives go through the runtime. Make it with
    `rt.ddp(module, **ddp_kwargs)`; it is used exactly like DDP."""

    @classmethod
    def build(cls, host: DDPHost, module: torch.nn.Module, **kwargs: Any) -> RuntimeDDP:
        check_options(module, kwargs)
        handle: GroupHandle | None = kwargs.pop("process_group", None)
        init_sync = bool(kwargs.pop("init_sync", True))
        comm = host.grad_comm(handle)
        # .grad as views into DDP's buckets unless the user chose, where that gives DDP's own
        # numbers (see "Gradients" in the module docstring): one pass over the gradients less
        kwargs.setdefault(
            "gradient_as_bucket_view", host.comm_mode == "hook" or _power_of_two(comm.size)
        )
        ft = BucketComm(comm, host.current_step, host.log)
        ddp = cls(module, process_group=_solo_group(host.rank), init_sync=False, **kwargs)
        ddp._ft_comm = ft
        ddp._ft_grad = comm
        ddp._ft_make_comm = lambda: host.grad_comm(handle)  # the group of the current world
        ddp._ft_rank = host.rank
        ddp._ft_log = host.log
        ddp._ft_reducer_ok = host.comm_mode == "reducer"
        ddp._ft_enable_cpp_waits = host.enable_cpp_waits
        ddp._ft_on_reducer = (
            False  # DDP's own reducer on the runtime's group (else the comm hook's)
        )
        ddp._ft_layout = None  # the bucket layout of steps >= 1, once this rank knows it
        ddp._ft_hooked_step = None  # the step that runs through the comm hook to learn that layout
        ddp._ft_pending = True  # the next forward settles which reducer runs (see _ft_settle)
        ref = weakref.ref(ddp)
        ft.ddp_rebuilt = lambda: bool(getattr(ref(), "_has_rebuilt_buckets", False))
        ddp._ft_install()
        if not host.needs_state:  # a replacement receives its state from a replica
            # plain DDP: params (and buffers) at init_sync, buffers again before the first forward
            buffers = ddp.forward_sync_buffers or (init_sync and "forward_sync_buffers" in kwargs)
            ddp._ft_initial_sync(init_sync, buffers)
        host.on_rebuild(_rebuilder(weakref.ref(ddp), host.rank))
        return ddp

    def _ft_initial_sync(self, params: bool, buffers: bool) -> None:
        """What DDP's init_sync does (rank 0's parameters and buffers to all), through the
        runtime."""
        ignore = self.parameters_to_ignore
        tensors = (
            [p for n, p in self.module.named_parameters() if n not in ignore] if params else []
        )
        if buffers:
            tensors += [b for n, b in self.module.named_buffers() if n not in ignore]
        self._ft_comm.broadcast(tensors, "DDP initial sync")

    def _ddp_init_helper(self, parameters: Any, *args: Any, **kwargs: Any) -> None:
        """DDP's reducer build, with the bucket layout `_ft_give` (reducer order; None: the one
        DDP computes), noting the layout it is built with, so reading it back needs no pass over
        the buckets (`_get_zeros_like_grad_buckets` allocates and zero-fills a copy of every
        bucket: 20-70 ms at 55 MB of gradients). DDP reverses what
        `_compute_bucket_assignment_by_size` returns, so a given layout is handed over reversed;
        the per-bucket limits only feed DDP's logging."""
        real = dist._compute_bucket_assignment_by_size
        give: list[list[int]] | None = getattr(self, "_ft_give", None)
        seen: list[list[list[int]]] = []

        def assign(*a: Any, **k: Any) -> tuple[list[list[int]], list[int]]:
            if give is not None:
                indices = [list(b) for b in reversed(give)]
                limits = [dist._DEFAULT_FIRST_BUCKET_BYTES] * len(give)
            else:
                indices, limits = real(*a, **k)
            seen.append([list(b) for b in reversed(indices)])
            return indices, limits

        dist._compute_bucket_assignment_by_size = assign
        try:
            super()._ddp_init_helper(parameters, *args, **kwargs)
        finally:
            dist._compute_bucket_assignment_by_size = real
        self._ft_built_layout = seen[-1] if seen else None

    def _ft_install(self) -> None:
        params, sparse = self._build_params_for_reducer()
        if any(sparse):
            raise _refuse(
                "module", "sparse Embedding", "sparse gradients are not bucketed by the runtime"
            )
        initial = getattr(self, "_ft_built_layout", None)
        if initial is None:  # not seen while DDP built it: read it back from the reducer
            initial = self._ft_reducer_layout()
        self._ft_comm.built(params, initial, _rebuild_caps(self))
        self._comm_hooks = []
        DistributedDataParallel.register_comm_hook(self, self._ft_comm, _comm_hook)
        self._ft_solo_due = False

    def _ft_rebuild(self, rank: int) -> None:
        """After a recovery round: forget the old generation's comm state; the next forward
        settles which reducer runs. Nothing is built here, on the round's critical path: the
        reducer on the runtime's group is built by that forward, and the hooked reducer on a
        one-rank group only when a step runs through the comm hook (`_ft_solo`)."""
        known = self._ft_known()
        if known is not None:
            self._ft_layout = known
        self._ft_comm.abandon()
        self._ft_grad = self._ft_make_comm()  # a live shrink or grow resized the world
        self._ft_comm.set_comm(self._ft_grad)
        self._ft_solo_due = True
        self._ft_on_reducer = False
        self._ft_hooked_step = None
        self._ft_pending = True

    def _ft_solo(self) -> None:
        """The comm hook's reducer: DDP's reducer on a one-rank group (no collective, no
        reference to an old generation's groups) with the hook installed, unless it is in place."""
        if self._ft_solo_due:
            self._ft_new_reducer(_solo_group(self._ft_rank))
            self._ft_install()

    def _ft_new_reducer(self, group: Any, layout: list[list[int]] | None = None) -> None:
        """DDP's reducer rebuilt on `group`, with `layout` as its buckets (None: DDP's own first
        layout), as DDP.__init__ builds it."""
        self.process_group = group
        params, sparse = self._build_params_for_reducer()
        if layout is not None and sorted(i for b in layout for i in b) != list(range(len(params))):
            raise RuntimeError(
                f"DDP bucket layout {layout} does not cover the reducer's {len(params)} parameters"
            )
        self._ft_give = layout
        try:
            self._ddp_init_helper(
                params, sparse, self._build_debug_param_to_name_mapping(params), False
            )
        finally:
            self._ft_give = None
        self._has_rebuilt_buckets = False
        self.require_forward_param_sync = True
        self._comm_hooks = []
        self._ft_solo_due = True  # this reducer has no comm hook (until `_ft_install`)

    # ---- which reducer runs: DDP's own (C++), or the comm hook's ------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._ft_pending:
            self._ft_settle()
        return super().forward(*inputs, **kwargs)

    def _ft_settle(self) -> None:
        """At a forward after a (re)build: put DDP's own reducer on the runtime's group, with the
        bucket layout of this step (DDP's first layout at step 0; at a later step the layout DDP
        rebuilt, from a rank that knows it). When no rank knows it (every rank restarted from a
        checkpoint) this step runs through the comm hook, which learns it, and the next forward
        settles again. On DDP's reducer: once DDP rebuilt its buckets (the forward of step 1, or
        the step after a given layout), read the layout it chose."""
        step = self._ft_comm._step()
        if self._ft_on_reducer:
            if self._has_rebuilt_buckets:
                self._ft_pending = False
                self._ft_adopt_rebuilt()
            return
        if not self._ft_reducer_ok:
            self._ft_solo()  # FTRUN_DDP_COMM=hook: the comm hook's reducer for good
            self._ft_pending = False
            return
        if self._ft_hooked_step == step:
            return  # this step runs through the hook
        if self._ft_grad.shrunk:
            self._ft_solo()
            self._ft_hook_while_shrunk(step)
            return
        layout = None
        if step > 0:
            layout, source = self._ft_agree_layout()
            if layout is None:
                self._ft_solo()
                self._ft_hooked_step = step
                self._ft_log(
                    f"no rank knows DDP's bucket layout of steps >= 1 (every rank started anew): "
                    f"step {step} all-reduces through the runtime's comm hook, which learns it"
                )
                return
        self._ft_comm.release()
        self._ft_new_reducer(self._ft_grad_group(), layout)
        self._ft_on_reducer = True
        self._ft_layout = layout
        self._ft_enable_cpp_waits()
        how = (
            "DDP's first-iteration layout"
            if layout is None
            else f"the bucket layout of steps >= 1 ({len(layout)} buckets, from rank {source})"
        )
        self._ft_log(
            f"DDP's reducer all-reduces on the runtime's group (in C++): step {step} with {how}"
        )

    def _ft_hook_while_shrunk(self, step: int) -> None:
        """After a live shrink DDP's reducer would divide by the smaller world; the global batch
        is kept by dividing by the original one (launcher.runtime.elastic). So until the world
        grows back every step all-reduces through the comm hook, which scales by 1/original,
        with the bucket layout of steps >= 1 agreed by the survivors (at step 0: DDP's first)."""
        layout, source = (None, -1) if step <= 0 else self._ft_agree_layout()
        if layout is not None:
            self._ft_comm.adopt(layout)
            self._ft_layout = layout
        self._ft_pending = False
        comm = self._ft_grad
        how = (
            "DDP's first layout"
            if step <= 0
            else (
                "a layout the hook learns in this step"
                if layout is None
                else f"the bucket layout of steps >= 1 ({len(layout)} buckets, from rank {source})"
            )
        )
        self._ft_log(
            f"shrunk world ({comm.size} of {comm.divisor} ranks): DDP's gradients all-reduce "
            f"through the runtime's comm hook, averaged over {comm.divisor}, from step {step} "
            f"with {how}"
        )

    def _ft_grad_group(self) -> Any:
        group = self._ft_grad.group()
        return dist.distributed_c10d._get_default_group() if group is None else group

    def _ft_known(self) -> list[list[int]] | None:
        """The bucket layout of steps >= 1, if this rank knows it."""
        if self._ft_on_reducer and self._has_rebuilt_buckets:
            # adopted at the forward after DDP rebuilt its buckets (DDP rebuilds them once)
            return self._ft_layout if not self._ft_pending else self._ft_reducer_layout()
        return self._ft_layout if self._ft_layout is not None else self._ft_comm.learnt()

    def _ft_reducer_layout(self) -> list[list[int]]:
        params, _ = self._build_params_for_reducer()
        index = {id(p): i for i, p in enumerate(params)}
        return [
            [index[id(p)] for p in b.parameters()]
            for b in self.reducer._get_zeros_like_grad_buckets()
        ]

    def _ft_adopt_rebuilt(self) -> None:
        rebuilt = self._ft_reducer_layout()
        if self._ft_layout is None:
            self._ft_log(
                f"DDP bucket layout for steps >= 1: {len(rebuilt)} buckets, rebuilt by DDP in "
                "gradient-ready order"
            )
        elif rebuilt != self._ft_layout:
            self._ft_log(
                f"DDP rebuilt its buckets into a layout other than the one it was given "
                f"({len(rebuilt)} buckets against {len(self._ft_layout)}); later recoveries "
                "use DDP's"
            )
        self._ft_layout = rebuilt

    def _ft_agree_layout(self) -> tuple[list[list[int]] | None, int]:
        """The layout of steps >= 1 from the first group member that knows it (None: nobody
        does), through the runtime's interruptible collectives; and that member's global rank."""
        known = self._ft_known()
        comm = self._ft_grad
        ranks = list(comm.ranks)
        n = len(self._build_params_for_reducer()[0])
        if len(ranks) <= 1:
            return known, self._ft_rank
        first = torch.tensor(
            [ranks.index(self._ft_rank) if known is not None else len(ranks)], dtype=torch.int64
        )
        comm.coll.all_reduce(
            first, op=dist.ReduceOp.MIN, group=comm.group(), what="DDP bucket layout"
        )
        src = int(first.item())
        if src >= len(ranks):
            return None, -1
        flat = torch.full((1 + 2 * n,), -1, dtype=torch.int64)
        if known is not None:
            flat[: 1 + len(known) + n] = torch.tensor(
                [len(known)] + [len(b) for b in known] + [i for b in known for i in b],
                dtype=torch.int64,
            )
        comm.coll.broadcast(flat, comm.torch_rank(src), comm.group(), what="DDP bucket layout")
        values = flat.tolist()
        sizes, members = values[1 : 1 + values[0]], values[1 + values[0] :]
        layout, off = [], 0
        for size in sizes:
            layout.append(members[off : off + size])
            off += size
        return layout, ranks[src]

    def _check_sync_bufs_pre_fwd(self) -> bool:
        return False  # moved after the forward: see _check_sync_bufs_post_fwd

    def _check_sync_bufs_post_fwd(self) -> bool:
        """broadcast_buffers: rank 0's buffers are broadcast right after each synced forward
        rather than before the next one. Every forward computes with the same values as under
        plain DDP (rank 0's, as left by the previous synced forward), and every rank holds the
        same buffers between steps, so a rank repaired from any replica holds them too (plain
        DDP's rank-local values between forwards could not be recovered for rank 0)."""
        return bool(
            self.forward_sync_buffers
            and self.modules_buffers
            and torch.is_grad_enabled()
            and self.require_backward_grad_sync
        )

    def _sync_buffers(self) -> None:
        """DDP's buffer broadcast (broadcast_buffers=True), through the runtime."""
        with torch.no_grad():
            self._assign_modules_buffers()
            with torch.autograd._unsafe_preserve_version_counter(tuple(self.modules_buffers)):
                self._ft_comm.broadcast(list(self.modules_buffers), "DDP buffer broadcast")

    # ---- DDP features whose collectives would bypass the runtime -----------------------
    def join(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse(
            "join", "...", "uneven inputs run collectives inside DDP, outside the runtime"
        )

    def join_hook(self, **kwargs: Any) -> Any:
        raise _refuse(
            "join_hook", "...", "uneven inputs run collectives inside DDP, outside the runtime"
        )

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        raise _refuse(
            "register_comm_hook", getattr(hook, "__name__", hook), "rt.ddp owns the comm hook"
        )

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        raise _refuse("_register_builtin_comm_hook", comm_hook_type, "rt.ddp owns the comm hook")

    def _set_static_graph(self) -> None:
        raise _refuse("static_graph", True, REFUSED["static_graph"])

    def _register_buffer_comm_hook(
        self, state: object, hook: Callable, comm_hook_location: Any = None
    ) -> None:
        raise _refuse(
            "_register_buffer_comm_hook",
            getattr(hook, "__name__", hook),
            "rt.ddp broadcasts buffers through the runtime",
        )


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _rebuilder(ref: "weakref.ReferenceType[RuntimeDDP]", rank: int) -> Callable[[int], None]:
    def rebuild(generation: int) -> None:
        ddp = ref()
        if ddp is not None:
            ddp._ft_rebuild(rank)

    return rebuild


def _rebuild_caps(ddp: DistributedDataParallel) -> list[int]:
    """The bucket size limits DDP's reducer uses when it rebuilds its buckets."""
    custom = list(getattr(ddp, "bucket_bytes_cap_list", []) or [])
    if custom:
        return custom
    config = getattr(ddp, "_bucket_config", None)
    first = getattr(config, "first_bucket_bytes_cap", dist._DEFAULT_FIRST_BUCKET_BYTES)
    return [int(first), int(ddp.bucket_bytes_cap)]


def _solo_group(rank: int) -> Any:
    """A gloo group of this rank alone (made locally, no other rank takes part)."""
    return dist.new_group([rank], backend="gloo", use_local_synchronization=True)
