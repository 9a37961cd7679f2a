"""A warm spare's heap, faulted in before it becomes a replacement.

Owns: `in_use_bytes()` (the heap a rank needs), `prepare(nbytes)`, run by an idle forked spare
(`launcher.workers.spare_server`), and `settle()`, run by the runtime of a replacement once its
repair is done. A replacement builds its model and optimizer state in fresh memory and the state it
receives lands there: every page is first zero-filled by the kernel on its first touch, inside the
transfer (with huge pages: 2 MB at a time, sometimes behind a compaction). `prepare` moves that
work to the spare's idle time: allocations below glibc's largest mmap threshold (32 MB) are taken
from the main heap instead of fresh mappings, the heap is grown by `nbytes` (the most a rank of
this node grew its heap by from its start through its first step (its phase edges, so the forward's
activations count, and its commit), `in_use_bytes`, `Heartbeat.heap_bytes`; at least its state,
`state_bytes`), every page of it is touched (huge pages where the kernel has them) and given back
to the heap, which is told not to trim it. The replacement's tensors are then carved from memory
that is already there: 171.6 MB arrived in 28-29 ms instead of 38-42 ms here. `settle` restores a
trim threshold of 64 MB (what glibc's own dynamic rule reaches in a long-running process), so the
replacement then frees memory like its peers. Only glibc; anything else: a no-op.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's upper bound for M_MMAP_THRESHOLD on 64-bit (HEAP_MAX_SIZE / 2)
SETTLED_TRIM = 2 * MMAP_THRESHOLD  # what glibc's dynamic threshold rule sets beside it
MADV_HUGEPAGE = 14
HUGE = 2 << 20
MEMORY_SHARE = 4  # a spare takes at most 1/4 of the available memory for its heap
ENV = "FTRUN_SPARE_HEAP"  # set in a replacement's environment by its spare: bytes prepared


@functools.lru_cache(maxsize=1)
def libc():
    """glibc with the prototypes of the calls used here and by
    `launcher.workers.spare_server.own_pages` (malloc, free, mallopt, madvise); None when this is
    not glibc on Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.malloc.restype = ctypes.c_void_p
        lib.malloc.argtypes = [ctypes.c_size_t]
        lib.free.argtypes = [ctypes.c_void_p]
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return lib
    except (OSError, AttributeError):  # not glibc
        return None


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (2.33 and later)."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
        )
    ]


def in_use_bytes() -> int:
    """The bytes this process's allocator hands out now: glibc's in-use heap blocks and mmapped
    chunks (`mallinfo2`); 0 where that is unknown (not glibc, or glibc before 2.33). A rank
    reports how much this grew from its start through its first step (its model, optimizer state,
    gradient buckets, a framework's buffers): a replacement allocates as much before it trains,
    so that is the heap a spare prepares for it."""
    lib = libc()
    info = getattr(lib, "mallinfo2", None) if lib is not None else None
    if info is None:
        return 0
    info.restype = _MallInfo2
    info.argtypes = []
    m = info()
    return int(m.uordblks + m.hblkhd)


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo (0 when unknown)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def prepare(nbytes: int) -> int:
    """Grow and fault in this process's heap by `nbytes` (at most a quarter of the memory the
    kernel has available) for the allocations to come; the bytes prepared (0 when nothing was
    done: not glibc, or nothing asked)."""
    lib = libc()
    nbytes = min(nbytes, available_bytes() // MEMORY_SHARE)
    if lib is None or nbytes <= 0:
        return 0
    if (
        lib.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1
        or lib.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) != 1
    ):
        return 0
    # below the threshold: from the heap (sbrk), in one piece
    block = MMAP_THRESHOLD - 4096
    ptrs = []
    try:
        for _ in range((nbytes + block - 1) // block):
            p = lib.malloc(block)
            if not p:
                break
            ptrs.append(p)
        if ptrs:
            lo, hi = min(ptrs), max(ptrs) + block
            start = (lo + HUGE - 1) & ~(HUGE - 1)
            if hi - start >= HUGE:  # huge pages where the kernel has them (torch asks the same)
                lib.madvise(start, (hi - start) & ~(HUGE - 1), MADV_HUGEPAGE)
            for p in ptrs:
                ctypes.memset(p, 0, block)
    finally:
        for p in reversed(ptrs):  # back to the heap's top, kept (trim threshold above)
            lib.free(p)
    return len(ptrs) * block


def settle() -> None:
    """After the repair: let the heap shrink again like any process's (trim above 64 MB)."""
    lib = libc()
    if lib is not None and os.environ.get(ENV):
        lib.mallopt(M_TRIM_THRESHOLD, SETTLED_TRIM)
