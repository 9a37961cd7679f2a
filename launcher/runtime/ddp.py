"""Stock torch DistributedDataParallel under the runtime: `model = rt.ddp(module, **ddp_kwargs)`.

Owns: `RuntimeDDP`, a real `DistributedDataParallel` whose every collective goes through the
runtime (on the current generation's group, interruptible by a stop), the check of DDP options
(those whose collectives would bypass the runtime are refused with one line naming the option),
and `BucketComm`, the communication hook.

How it works:
- DDP itself runs on a one-rank gloo group of its own, so nothing inside DDP talks to other
  ranks: its post-construction bucket rebuild (a broadcast in the second forward) stays local.
- The comm hook scales each bucket by 1/N (as DDP does) and starts its all_reduce on the
  runtime's group at once, asynchronously, while backward goes on; a callback queued on the
  autograd engine waits for them through the runtime's interruptible wait before DDP copies the
  results into .grad. A stop raised there comes out of `loss.backward()` as StopRequested.
- Module buffers (`broadcast_buffers`) and the initial parameter sync (`init_sync`) are
  broadcast from the group's first rank through the runtime; a replacement rank skips the
  initial sync (its state comes from a replica). Buffers are broadcast right after each synced
  forward instead of before the next: forwards compute exactly as under plain DDP and every
  rank holds the same buffers between steps (plain DDP leaves rank-local values there, which
  could not be recovered when rank 0 is lost).
- Gradients are bucket views: unless the caller passes `gradient_as_bucket_view`, rt.ddp builds
  DDP with gradient_as_bucket_view=True. With a comm hook DDP copies each gradient into its
  bucket without scaling it and, by default, copies the result back into .grad: with the hook's
  own scaling that is three passes over the gradients where plain DDP (no hook) makes two (one
  fused scale-and-copy in, one copy out). With .grad a view of its bucket there is no copy back
  (and no copy in when .grad is kept between steps, zero_grad(set_to_none=False)): the values
  are the same as plain DDP's (x * (1/N) in both). What the user sees: each .grad is a view into
  a bucket (an in-place `p.grad.detach_()` raises; `zero_grad()` works either way; a reference
  to an old .grad kept across steps is overwritten by the next step's result, as torch
  documents for this option). `gradient_as_bucket_view=False` gives DDP's default copies back.
- After every recovery round each rank rebuilds DDP's reducer on the new generation (no
  collective) and re-registers the hook: survivors and replacements hold the same fresh state.
- Bit-identity: the bucket layout that is all-reduced in a step depends on the step alone. Step 0
  uses DDP's initial layout (one bucket, as plain DDP's first iteration); later steps use the
  layout DDP rebuilds from the order gradients became ready (rank 0's order, broadcast through
  the runtime once after each (re)build; same bucket caps as DDP). When DDP's own buckets differ
  from that layout (the first step after a recovery, before DDP rebuilt) they are repacked into
  it. So a run gives the same numbers as plain DDP under torchrun, with or without recoveries.
  Whether DDP's bucket k holds the layout's bucket k is checked once per layout (a new target
  layout, or DDP's own rebuild), not every step; on a one-rank group the 1/N scaling (x * 1.0) is
  skipped. What the hook costs per step against plain DDP in the same process:
  scripts/bench_step_cost.py.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from launcher.runtime.buckets import FlatBucket, GradComm
from launcher.runtime.groups import GroupHandle

if TYPE_CHECKING:
    from launcher.runtime.runtime import Runtime

# DDP options whose collectives run on DDP's own group, outside the runtime: refused when set.
REFUSED = {
    "find_unused_parameters": "its unused-parameter all-reduce runs inside DDP, outside the runtime",
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
        raise _refuse("process_group", type(group).__name__, "pass a GroupHandle from rt.new_group / "
                      "rt.set_layout (a torch group is not rebuilt after a recovery)")
    for sub in module.modules():
        if isinstance(sub, torch.nn.SyncBatchNorm):
            raise _refuse("module", "SyncBatchNorm", "its all_gather runs on its own group, outside the "
                          "runtime; use BatchNorm (buffers are broadcast through the runtime)")


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
        self._scale = 1.0 / comm.size  # DDP's averaging factor (1.0 on a one-rank group: no pass)
        self.ddp_rebuilt: Callable[[], bool] = lambda: False  # set by RuntimeDDP.build
        # per DDP bucket index: does it hold exactly the target layout's bucket k? Checked once
        # per layout (the target's, DDP's own), not per step (bucket.parameters() builds a list)
        self._matches: dict[int, bool] = {}
        self._layout_key: tuple | None = None
        self._layouts_learnt = 0
        self._begin_backward()

    # ---- (re)build -------------------------------------------------------------------
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
        self._recorders = [p.register_post_accumulate_grad_hook(lambda _p, i=i: self._order.setdefault(i))
                           for i, p in enumerate(params)]

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
                match = self._matches[k] = (k < len(target) and target[k] == self._members(bucket))
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
                self._repack(self._target[self._slow_from:])
                if not self._told_repack:
                    self._told_repack = True
                    self._log(f"DDP's buckets differ from the layout of step {self._step()}: "
                              f"{len(self._target) - self._slow_from} buckets repacked into it")
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
                flat_bucket = self._scratch[tuple(members)] = FlatBucket([self._params[i] for i in members])
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
        """DDP's rebuilt layout from rank 0's gradient-ready order (broadcast through the runtime)."""
        n = len(self._params)
        order = list(self._order) + [i for i in reversed(range(n)) if i not in self._order]
        t = torch.tensor(order, dtype=torch.int64)
        self._comm.broadcast([t], "DDP bucket order")
        order = t.tolist()
        self._remove_recorders()
        self._order = {}
        layout, _ = dist._compute_bucket_assignment_by_size(
            [self._params[i] for i in order], self._caps, [False] * n, order)
        self._log(f"DDP bucket layout for steps >= 1: {len(layout)} buckets in rank {self._comm.root}'s "
                  "gradient-ready order")
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


class RuntimeDDP(DistributedDataParallel):
    """DistributedDataParallel whose collectives go through the runtime. Make it with
    `rt.ddp(module, **ddp_kwargs)`; it is used exactly like DDP."""

    @classmethod
    def build(cls, rt: "Runtime", module: torch.nn.Module, **kwargs: Any) -> "RuntimeDDP":
        check_options(module, kwargs)
        handle: GroupHandle | None = kwargs.pop("process_group", None)
        init_sync = bool(kwargs.pop("init_sync", True))
        comm = rt._grad_comm(handle)
        # .grad as views into DDP's buckets unless the user chose: the hook's scaling is then the
        # only pass over the gradients (see "Gradients are bucket views" in the module docstring)
        kwargs.setdefault("gradient_as_bucket_view", True)
        ft = BucketComm(comm, lambda: rt._current_step, rt.log)
        ddp = cls(module, process_group=_solo_group(rt.rank), init_sync=False, **kwargs)
        ddp._ft_comm = ft
        ref = weakref.ref(ddp)
        ft.ddp_rebuilt = lambda: bool(getattr(ref(), "_has_rebuilt_buckets", False))
        ddp._ft_install()
        if not rt._needs_state:  # a replacement receives its state from a replica
            # plain DDP: params (and buffers) at init_sync, buffers again before the first forward
            buffers = ddp.forward_sync_buffers or (init_sync and "forward_sync_buffers" in kwargs)
            ddp._ft_initial_sync(init_sync, buffers)
        rt._rebuild_listeners.append(_rebuilder(weakref.ref(ddp), rt.rank))
        return ddp

    def _ft_initial_sync(self, params: bool, buffers: bool) -> None:
        """What DDP's init_sync does (rank 0's parameters and buffers to all), through the runtime."""
        ignore = self.parameters_to_ignore
        tensors = [p for n, p in self.module.named_parameters() if n not in ignore] if params else []
        if buffers:
            tensors += [b for n, b in self.module.named_buffers() if n not in ignore]
        self._ft_comm.broadcast(tensors, "DDP initial sync")

    def _ft_install(self) -> None:
        params, sparse = self._build_params_for_reducer()
        if any(sparse):
            raise _refuse("module", "sparse Embedding", "sparse gradients are not bucketed by the runtime")
        index = {id(p): i for i, p in enumerate(params)}
        initial = [[index[id(p)] for p in b.parameters()] for b in self.reducer._get_zeros_like_grad_buckets()]
        self._ft_comm.built(params, initial, _rebuild_caps(self))
        self._comm_hooks = []
        DistributedDataParallel.register_comm_hook(self, self._ft_comm, _comm_hook)

    def _ft_rebuild(self, rank: int) -> None:
        """After a recovery round: a fresh reducer on the new generation (no collective)."""
        self._ft_comm.abandon()
        self.process_group = _solo_group(rank)
        params, sparse = self._build_params_for_reducer()
        self._ddp_init_helper(params, sparse, self._build_debug_param_to_name_mapping(params), False)
        self._has_rebuilt_buckets = False
        self.require_forward_param_sync = True
        self._ft_install()

    def _check_sync_bufs_pre_fwd(self) -> bool:
        return False  # moved after the forward: see _check_sync_bufs_post_fwd

    def _check_sync_bufs_post_fwd(self) -> bool:
        """broadcast_buffers: rank 0's buffers are broadcast right after each synced forward
        rather than before the next one. Every forward computes with the same values as under
        plain DDP (rank 0's, as left by the previous synced forward), and every rank holds the
        same buffers between steps, so a rank repaired from any replica holds them too (plain
        DDP's rank-local values between forwards could not be recovered for rank 0)."""
        return bool(self.forward_sync_buffers and self.modules_buffers and torch.is_grad_enabled()
                    and self.require_backward_grad_sync)

    def _sync_buffers(self) -> None:
        """DDP's buffer broadcast (broadcast_buffers=True), through the runtime."""
        with torch.no_grad():
            self._assign_modules_buffers()
            with torch.autograd._unsafe_preserve_version_counter(tuple(self.modules_buffers)):
                self._ft_comm.broadcast(list(self.modules_buffers), "DDP buffer broadcast")

    # ---- DDP features whose collectives would bypass the runtime -----------------------
    def join(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("join", "...", "uneven inputs run collectives inside DDP, outside the runtime")

    def join_hook(self, **kwargs: Any) -> Any:
        raise _refuse("join_hook", "...", "uneven inputs run collectives inside DDP, outside the runtime")

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        raise _refuse("register_comm_hook", getattr(hook, "__name__", hook), "rt.ddp owns the comm hook")

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        raise _refuse("_register_builtin_comm_hook", comm_hook_type, "rt.ddp owns the comm hook")

    def _set_static_graph(self) -> None:
        raise _refuse("static_graph", True, REFUSED["static_graph"])

    def _register_buffer_comm_hook(self, state: object, hook: Callable, comm_hook_location: Any = None) -> None:
        raise _refuse("_register_buffer_comm_hook", getattr(hook, "__name__", hook),
                      "rt.ddp broadcasts buffers through the runtime")


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
