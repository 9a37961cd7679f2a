"""Same-host state transfer: the receiver copies a peer's tensors straight out of its memory.

Owns: whether two ranks run on one kernel in one pid namespace (`host_identity`), the offer a
sender publishes with its state's metadata (its pid and the address and length of every byte
range it would otherwise send), and the read itself: `process_vm_readv(2)` from the sender's
address space into the receiver's own tensors, one copy, no socket, split across threads.

Over loopback TCP a state crosses the kernel twice (send copy, receive copy) and waits on the
socket's flow control; here it is copied once at memory speed. The sender holds its state still
until the receiver answers (the recovery round stops training on every rank), so the read sees
a consistent state; while its offer is open it lets processes of its own user read it under
Yama's ptrace scope 1 (`ReadersAllowed`). Any failure (another host or pid namespace, a kernel
or seccomp profile without the call, Yama scope 2-3 or a non-dumpable sender refusing access,
the sender dying mid-read) makes `read` return the reason and the stripe goes over the wire as
before; nothing is lost but the attempt. `FTRUN_TRANSFER_LOCAL=0` turns the path off.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from dataclasses import dataclass

import torch

PR_SET_PTRACER = 0x59616D61  # Yama: who besides ancestors may ptrace (and so read) this process
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
IOV_MAX = 1024  # iovecs per process_vm_readv call (the kernel's UIO_MAXIOV)
SPLIT_BYTES = 8 << 20  # a read below this runs on one thread
MAX_THREADS = 4


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load_readv():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return fn


_READV = _load_readv()  # the libc entry point, resolved once (None: not available)


class ReadersAllowed:
    """While a sender's offer is open: under Yama's `ptrace_scope` 1 (Ubuntu's default) only a
    process's ancestors may read its memory, so the sender lets any process of its own user
    (the kernel's usual same-user check still applies) read it, and withdraws that on exit.
    Without Yama the call fails with EINVAL and nothing changes."""

    def __enter__(self) -> ReadersAllowed:
        self.set = _prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.set:
            _prctl(PR_SET_PTRACER, 0)


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return (
            libc.prctl(
                ctypes.c_int(option),
                ctypes.c_ulong(value),
                ctypes.c_ulong(0),
                ctypes.c_ulong(0),
                ctypes.c_ulong(0),
            )
            == 0
        )
    except (OSError, AttributeError):
        return False


def enabled() -> bool:
    """Whether this process offers and attempts same-host reads (`FTRUN_TRANSFER_LOCAL`)."""
    return _READV is not None and os.environ.get("FTRUN_TRANSFER_LOCAL", "1").strip() != "0"


def host_identity() -> str | None:
    """One kernel boot and one pid namespace: two ranks with the same identity can name each
    other's processes by pid. None when it cannot be told."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


@dataclass(frozen=True)
class Offer:
    """What a sender publishes: where the bytes it would send live in its address space."""

    host: str
    pid: int
    spans: tuple[tuple[int, int], ...]  # (address, bytes) in stream order

    @classmethod
    def of(cls, views: list[torch.Tensor]) -> Offer | None:
        host = host_identity()
        if host is None:
            return None
        return cls(
            host,
            os.getpid(),
            tuple((v.data_ptr(), v.numel() * v.element_size()) for v in views if v.numel()),
        )

    def as_dict(self) -> dict:
        return {"host": self.host, "pid": self.pid, "spans": [list(s) for s in self.spans]}

    @classmethod
    def from_dict(cls, d: dict | None) -> Offer | None:
        if not d:
            return None
        return cls(str(d["host"]), int(d["pid"]), tuple((int(a), int(n)) for a, n in d["spans"]))


def _pairs(offer: Offer, dests: list[torch.Tensor]) -> list[tuple[int, int, int]]:
    """(remote address, local address, bytes) pieces: the offer's spans laid over the
    destination views, both in stream order."""
    local = [(d.data_ptr(), d.numel() * d.element_size()) for d in dests if d.numel()]
    if sum(n for _, n in local) != sum(n for _, n in offer.spans):
        raise ValueError(
            f"offer covers {sum(n for _, n in offer.spans)} bytes, "
            f"receiver expects {sum(n for _, n in local)}"
        )
    out: list[tuple[int, int, int]] = []
    i = j = 0
    ri, li = 0, 0  # bytes already used of spans[i] / local[j]
    while i < len(offer.spans) and j < len(local):
        n = min(offer.spans[i][1] - ri, local[j][1] - li)
        out.append((offer.spans[i][0] + ri, local[j][0] + li, n))
        ri, li = ri + n, li + n
        if ri == offer.spans[i][1]:
            i, ri = i + 1, 0
        if li == local[j][1]:
            j, li = j + 1, 0
    return out


def _split(pieces: list[tuple[int, int, int]], parts: int) -> list[list[tuple[int, int, int]]]:
    """Cut the pieces into `parts` runs of near-equal bytes (a piece may be cut in two)."""
    total = sum(n for _, _, n in pieces)
    bounds = [total * (k + 1) // parts for k in range(parts)]
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(parts)]
    k, done = 0, 0
    for remote, local, n in pieces:
        while n:
            take = min(n, bounds[k] - done) if bounds[k] > done else 0
            if take == 0:
                k += 1
                continue
            out[k].append((remote, local, take))
            remote, local, n, done = remote + take, local + take, n - take, done + take
    return [run for run in out if run]


def _read_run(pid: int, run: list[tuple[int, int, int]]) -> str | None:
    """Copy one run of pieces from `pid`; None, or why it failed."""
    assert _READV is not None
    pos = 0
    while pos < len(run):
        batch = run[pos : pos + IOV_MAX]
        want = sum(n for _, _, n in batch)
        lv = (_IoVec * len(batch))(*[_IoVec(loc, n) for _, loc, n in batch])
        rv = (_IoVec * len(batch))(*[_IoVec(rem, n) for rem, _, n in batch])
        got = _READV(pid, lv, len(batch), rv, len(batch), 0)
        if got < 0:
            err = ctypes.get_errno()
            return f"process_vm_readv from pid {pid}: {os.strerror(err)} (errno {err})"
        if got < want:  # a short read stops at a piece boundary or mid-piece: go on from there
            used = 0
            for k, (rem, loc, n) in enumerate(batch):
                if used + n > got:
                    off = got - used
                    if got == 0 and k == 0:
                        return f"process_vm_readv from pid {pid}: read nothing at {rem:#x}"
                    run[pos + k] = (rem + off, loc + off, n - off)
                    pos += k
                    break
                used += n
            continue
        pos += len(batch)
    return None


def threads_for(nbytes: int) -> int:
    """Reader threads for `nbytes`: one per CPU this process may use, at most MAX_THREADS."""
    if nbytes < SPLIT_BYTES:
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus))


def read(offer: Offer, dests: list[torch.Tensor], threads: int | None = None) -> str | None:
    """Fill `dests` (contiguous CPU tensors, stream order) from the sender's memory. None on
    success, else the reason (nothing usable was read: the caller takes the wire instead)."""
    if not enabled():
        return "same-host reads are off"
    here = host_identity()
    if here is None or here != offer.host:
        return "the sender is on another host or pid namespace"
    if any(d.device.type != "cpu" or not d.is_contiguous() for d in dests):
        return "a destination is not a contiguous CPU tensor"
    try:
        pieces = _pairs(offer, dests)
    except ValueError as exc:
        return str(exc)
    total = sum(n for _, _, n in pieces)
    runs = _split(pieces, threads or threads_for(total)) if pieces else []
    if len(runs) <= 1:
        return _read_run(offer.pid, runs[0]) if runs else None
    errors: list[str | None] = [None] * len(runs)

    def work(k: int) -> None:
        errors[k] = _read_run(offer.pid, runs[k])

    workers = [
        threading.Thread(target=work, args=(k,), name=f"ftrun-local-read-{k}", daemon=True)
        for k in range(1, len(runs))
    ]
    for t in workers:
        t.start()
    work(0)
    for t in workers:
        t.join()  # each is one bounded copy of at most total/threads bytes of local memory
    return next((e for e in errors if e), None)
