"""Gradient all-reduce in buckets, overlapped with backward.

Owns: the bucket layout of a parameter list (reverse parameter order, split by dtype/device and a
byte cap, a small first bucket: deterministic, so every rank and every recovery builds the same
layout and adds the same numbers in the same order, which keeps recovered runs bit-identical),
`FlatBucket` (one bucket's gradients packed into one flat tensor), `GradComm` (what gradient
communication needs from the runtime), `OverlappedAllReduce` (post-accumulate-grad hooks launch a
bucket's async all_reduce on the runtime's current group as soon as all its gradients are
accumulated, always in bucket order so every rank issues the same sequence, and a pending stop
aborts backward at the next gradient; `finish()` waits for them through the runtime's
interruptible wait, so a stop still leaves within milliseconds, and copies the averaged
gradients back) and `GradientSyncs` (one
`OverlappedAllReduce` per parameter set, for `Runtime.allreduce_gradients`).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from launcher.runtime.collectives import Interruptible

FIRST_BUCKET_BYTES = 1 << 20  # a small first bucket: its all-reduce starts early in backward
BUCKET_BYTES = 25 << 20  # torch DDP's default cap
FUSED_DIV_NUMEL = 1 << 16  # from this size a gradient is averaged and copied back in one pass
_SUM = dist.AllreduceOptions()  # the (never modified) options of every gradient all_reduce
_SUM.reduceOp = dist.ReduceOp.SUM


@dataclass(frozen=True)
class GradComm:
    """What gradient communication needs from the runtime."""

    coll: Interruptible
    group: Callable[[], Any]  # the torch group of the current generation (None: the default group)
    size: int  # ranks in that group
    root: int  # global rank of the group's first member (the source of broadcasts)
    ranks: Sequence[int] = ()  # global ranks of the group's members, in group order
    divisor: int = 0  # the average's denominator (0: size; after a live shrink, more)
    # torch's global ranks of the members, in group order (after a live shrink torch numbers
    # the ranks by their place in the smaller world; empty: the ranks themselves)
    torch_ranks: Sequence[int] = ()

    @property
    def shrunk(self) -> bool:
        """A live shrink left fewer members than the average divides by."""
        return self.divisor > self.size

    def torch_rank(self, index: int) -> int:
        """torch's global rank of the group's `index`-th member (a broadcast's source)."""
        return self.torch_ranks[index] if self.torch_ranks else self.ranks[index]

    def all_reduce_async(self, flat: torch.Tensor) -> Any:
        """Start a SUM all_reduce of `flat` on the current group; returns its work. Called for
        every bucket of every step, so it goes to the process group directly: the same call
        `dist.all_reduce(flat, group=..., async_op=True)` ends in, without its ~10 us of
        Python-side checks (what DDP's C++ reducer does too)."""
        group = self.group()
        if group is None:
            group = dist.distributed_c10d._get_default_group()
        return group.allreduce([flat], _SUM)

    def broadcast(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        """Overwrite `tensors` with the root's values (flattened per dtype), interruptibly."""
        if self.size <= 1:
            return
        by_dtype: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault((t.dtype, t.device), []).append(t)
        with torch.no_grad():
            for group in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                self.coll.broadcast(flat, self.root, self.group(), what=what)
                off = 0
                for t in group:
                    t.copy_(flat[off : off + t.numel()].view_as(t))
                    off += t.numel()


def bucket_layout(
    params: Sequence[torch.Tensor],
    bucket_bytes: int = BUCKET_BYTES,
    first_bucket_bytes: int = FIRST_BUCKET_BYTES,
) -> list[list[int]]:
    """Indices into `params` per bucket, in launch order: reverse parameter order (the last
    layers' gradients are ready first); a bucket closes when it reaches its cap (the first one
    `first_bucket_bytes`, the others `bucket_bytes`) or the dtype/device changes."""
    buckets: list[list[int]] = []
    cur: list[int] = []
    size, cap, key = 0, first_bucket_bytes, None
    for i in reversed(range(len(params))):
        p = params[i]
        k = (p.dtype, p.device)
        if cur and (k != key or size >= cap):
            buckets.append(cur)
            cur, size, cap = [], 0, bucket_bytes
        cur.append(i)
        key = k
        size += p.numel() * p.element_size()
    if cur:
        buckets.append(cur)
    return buckets


class FlatBucket:
    """One bucket: the gradients of `shapes`-shaped tensors packed into one flat tensor."""

    def __init__(self, like: Sequence[torch.Tensor]) -> None:
        self.shapes = [t.shape for t in like]
        self.numels = [t.numel() for t in like]
        self.dtype = like[0].dtype
        self.device = like[0].device
        self.flat: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []  # shaped like the tensors
        self.work: Any = None  # the in-flight all_reduce

    def buffer(self) -> torch.Tensor:
        if self.flat is None:
            self.flat = torch.empty(sum(self.numels), dtype=self.dtype, device=self.device)
            self.views = [v.view(s) for v, s in zip(self.flat.split(self.numels), self.shapes)]
        return self.flat

    def pack(self, sources: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Copy `sources` into the flat tensor (None: zeros; a source that already is its view
        of the flat tensor is left in place)."""
        flat = self.buffer()
        dst, src = [], []
        for view, g in zip(self.views, sources):
            if g is None:
                view.zero_()
            elif g.data_ptr() != view.data_ptr() or g.shape != view.shape:
                dst.append(view)
                src.append(g)
        if dst:
            torch._foreach_copy_(dst, src)
        return flat

    def drop(self) -> tuple[Any, ...]:
        """Forget the buffer and the work (a collective this rank abandoned may still write into
        the buffer); returns them for the graveyard."""
        kept = (self.work, self.flat)
        self.flat, self.views, self.work = None, [], None
        return kept


class OverlappedAllReduce:
    """Bucketed all-reduce of `params`' gradients, launched from backward as buckets fill up.

    Every rank builds the same layout and launches buckets strictly in layout order: a bucket
    whose gradients are ready waits for the buckets before it. A parameter accumulated twice
    before `finish()` (gradient accumulation over several backward passes) makes `finish()`
    redo the whole sum from the final gradients (every rank runs the same passes, so every rank
    does the same).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        comm: GradComm,
        average: bool = True,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self._params = list(params)
        self._comm = comm
        self._average = average
        layout = bucket_layout(self._params, bucket_bytes, min(FIRST_BUCKET_BYTES, bucket_bytes))
        self._members = layout
        self._buckets = [FlatBucket([self._params[i] for i in idx]) for idx in layout]
        self._lock = threading.Lock()
        self._pending = [len(idx) for idx in layout]
        self._next = 0  # the next bucket to launch
        self._redo = False
        self._handles = []
        # After a live shrink the ranks compute unequal numbers of micro-batches: a bucket
        # launched during the first backward would be launched again (the redo) on the ranks
        # that accumulate more, and the collectives of the ranks would no longer pair up. So
        # there every bucket is launched once, by finish().
        if comm.size > 1 and not comm.divisor:
            for b, idx in enumerate(layout):
                for i in idx:
                    self._handles.append(
                        self._params[i].register_post_accumulate_grad_hook(
                            functools.partial(self._on_ready, b)
                        )
                    )

    @property
    def layout(self) -> list[list[int]]:
        return [list(idx) for idx in self._members]

    def _on_ready(self, b: int, _param: torch.Tensor) -> None:
        # a stop that arrives during backward ends it at the next gradient (the exception leaves
        # loss.backward()); computing the rest would only hold up the recovery round
        self._comm.coll.check_stop("backward (gradient hook)")
        with self._lock:
            if self._redo:
                return
            if self._buckets[b].work is not None or self._pending[b] == 0:
                self._redo = True  # accumulated again before finish(): redo the sum there
                return
            self._pending[b] -= 1
            while self._next < len(self._buckets) and self._pending[self._next] == 0:
                self._launch(self._next)
                self._next += 1

    def _launch(self, b: int) -> None:
        bucket = self._buckets[b]
        flat = bucket.pack([self._params[i].grad for i in self._members[b]])
        bucket.work = self._comm.all_reduce_async(flat)

    def finish(self) -> None:
        """Launch the buckets backward did not, wait for all (interruptibly) and copy the
        averaged sums into the parameters' .grad."""
        if self._comm.size <= 1:
            for p in self._params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                elif self._average and self._comm.divisor > 1:
                    p.grad.div_(self._comm.divisor)  # one rank left of a shrunk world
            return
        try:
            with self._lock:
                if self._redo:
                    self._wait(self._next)
                    self._next = 0
                while self._next < len(self._buckets):
                    self._launch(self._next)
                    self._next += 1
            self._wait(len(self._buckets))
            self._hand_back()
        except BaseException:
            self.abandon()
            raise
        finally:
            self._reset()

    def _wait(self, upto: int) -> None:
        for bucket in self._buckets[:upto]:
            if bucket.work is not None:
                self._comm.coll.wait(bucket.work, "gradient all_reduce", (bucket.flat,))
                bucket.work = None

    def _hand_back(self) -> None:
        """Copy the sums back (as torch DDP does by default: a .grad that aliased the bucket
        would see the in-place all-reduce when gradients accumulate over several passes)."""
        n = self._comm.divisor or self._comm.size
        dst, src = [], []
        for b, bucket in enumerate(self._buckets):
            for i, view in zip(self._members[b], bucket.views):
                p = self._params[i]
                if p.grad is None:
                    p.grad = view / n if self._average else view.clone()
                elif self._average and view.numel() >= FUSED_DIV_NUMEL:
                    torch.div(view, n, out=p.grad)  # the average and the copy in one pass
                else:
                    dst.append(p.grad)
                    src.append(view)
        if dst:
            torch._foreach_copy_(dst, src)
            if self._average:
                torch._foreach_div_(dst, n)

    def _reset(self) -> None:
        with self._lock:
            self._pending = [len(idx) for idx in self._members]
            self._next = 0
            self._redo = False

    def abandon(self) -> None:
        """Give up in-flight all-reduces (after a stop): keep them and their buffers referenced
        for the rest of the process and start the next backward with fresh buffers."""
        with self._lock:
            for bucket in self._buckets:
                if bucket.work is not None:
                    self._comm.coll.abandon(*bucket.drop())
        self._reset()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class GradientSyncs:
    """One OverlappedAllReduce per (parameter set, group, options), made on first use. The
    parameter set of a tuple of models (their parameters with requires_grad, each once) is read
    at its first use: a step then costs two dict lookups, not a walk of the module tree."""

    def __init__(self, on_new: Callable[[tuple, Any, bool, int], None] | None = None) -> None:
        self._syncs: dict[tuple, OverlappedAllReduce] = {}
        # ids of the models -> (the models, kept alive so their ids stay theirs; the sync's key)
        self._params_of: dict[tuple[int, ...], tuple[tuple[torch.nn.Module, ...], tuple]] = {}
        # called with (models, group key, average, bucket_bytes) when a sync is made
        self._on_new = on_new

    def sync(
        self,
        models: tuple[torch.nn.Module, ...],
        group_key: Any,
        comm: Callable[[], GradComm],
        average: bool,
        bucket_bytes: int,
    ) -> None:
        self.prepare(models, group_key, comm, average, bucket_bytes).finish()

    def prepare(
        self,
        models: tuple[torch.nn.Module, ...],
        group_key: Any,
        comm: Callable[[], GradComm],
        average: bool,
        bucket_bytes: int,
    ) -> OverlappedAllReduce:
        """The sync of `models` (made, with its backward hooks, on its first use): `sync` without
        the wait, so that a sync made ahead of a backward launches that backward's buckets."""
        ids = tuple(map(id, models))
        known = self._params_of.get(ids)
        if known is None:
            params = list(
                {id(p): p for m in models for p in m.parameters() if p.requires_grad}.values()
            )
            known = self._params_of[ids] = (models, (tuple(map(id, params)), params))
        param_ids, params = known[1]
        key = (param_ids, group_key, average, bucket_bytes)
        s = self._syncs.get(key)
        if s is None:
            s = self._syncs[key] = OverlappedAllReduce(params, comm(), average, bucket_bytes)
            if self._on_new is not None:
                self._on_new(models, group_key, average, bucket_bytes)
        return s

    def abandon_all(self) -> None:
        for s in self._syncs.values():
            s.abandon()

    def remove_all(self) -> None:
        """Give up every sync and remove its gradient hooks (the world changed size)."""
        for s in self._syncs.values():
            s.abandon()
            s.remove()
        self._syncs.clear()
