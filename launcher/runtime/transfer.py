"""Peer-to-peer state transfer between replicas, optionally striped across several senders.

Owns: the wire format one rank uses to hand its full state to another over the default process
group, and how that stream is cut into stripes when several replicas send one state together.

Each sender posts a 5 x int64 header (metadata bytes, tensor count, packed bytes, stripe index,
stripe count), the metadata (the state's skeleton with tensors replaced by slots, plus each
tensor's dtype and shape) as pickle bytes, then its stripe of the payload stream. The stream is
every large tensor's raw bytes in order, then one packed blob of all small tensors; stripe i of
k covers bytes [i*n/k, (i+1)*n/k) of it, sent as views of the tensors (no copy). The receiver
lands every large tensor directly in a same-shaped tensor (its live tensor when one exists at
the same path, so parameters and existing optimizer state are overwritten in place), posts
all stripes' receives at once so the senders stream in parallel, and checks every sender
announced the same tensor specs. Metadata is unpickled; it only ever comes from a peer of the
same job.

On one host the payload need not cross a socket: the metadata carries an offer (`local_copy`:
this process's pid and where each byte range lives), the receiver copies the stripe straight out
of the sender's memory and answers "read" (1) or "send it" (0, e.g. another host, or the kernel
refused); only then does the sender stream the stripe.

Every send/recv is interruptible (see collectives): a sender that dies mid-stripe (or mid-read)
fails the round, and the controller's next round plans the repair from the remaining replicas.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from launcher.runtime import local_copy
from launcher.runtime.collectives import Interruptible
from launcher.runtime.state import flatten, slot_paths, unflatten

SMALL_BYTES = 1 << 16  # tensors below this travel together in one packed blob
HEADER_LEN = 5
READ_DONE, SEND_IT = 1, 0  # a receiver's answer to a same-host offer
_DTYPES = {
    str(d): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}


@dataclass
class TransferStats:
    nbytes: int
    tensors: int
    seconds: float
    stripes: int = 1
    phases: dict[str, float] = field(default_factory=dict)  # meta / alloc / payload seconds
    path: str = "wire"  # "memory": read from the sender's memory on the same host (local_copy)
    fallback: str = ""  # why an offered same-host read was not used (the stripe came by wire)

    @property
    def gbps(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9) / 1e9


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (shares memory)."""
    return t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def stripe_bounds(total: int, stripes: int) -> list[tuple[int, int]]:
    """Byte ranges [lo, hi) of `stripes` near-equal contiguous stripes covering [0, total)."""
    if stripes < 1:
        raise ValueError(f"stripes={stripes} must be >= 1")
    return [(total * i // stripes, total * (i + 1) // stripes) for i in range(stripes)]


def stripe_segments(sizes: list[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """The pieces of the stream (pieces of `sizes` bytes laid end to end) inside [lo, hi), as
    (piece index, start, end) with offsets local to the piece; empty segments are omitted."""
    out, base = [], 0
    for i, n in enumerate(sizes):
        a, b = max(lo, base), min(hi, base + n)
        if a < b:
            out.append((i, a - base, b - base))
        base += n
        if base >= hi:
            break
    return out


def _pieces(tensors: list[torch.Tensor], packed: torch.Tensor | None) -> list[torch.Tensor]:
    """The payload stream: large tensors' bytes in order, then the packed blob of small ones."""
    out = [_as_bytes(t) for t in tensors if _nbytes(t) >= SMALL_BYTES]
    if packed is not None:
        out.append(packed)
    return out


def _stripe_views(
    pieces: list[torch.Tensor], stripe: int, stripes: int, half: int | None = None
) -> list[torch.Tensor]:
    """Views of the stripe's bytes; `half` 0/1: only the first/second half of them."""
    lo, hi = stripe_bounds(sum(p.numel() for p in pieces), stripes)[stripe]
    if half is not None:
        lo, hi = ((lo, (lo + hi) // 2), ((lo + hi) // 2, hi))[half]
    return [pieces[i][a:b] for i, a, b in stripe_segments([p.numel() for p in pieces], lo, hi)]


@dataclass
class _Outgoing:
    """A stripe of a state as it goes out: header, metadata, and the stripe's bytes in two
    halves (on the wire a stripe is always its two halves: the receiver posts the same
    messages; fault injection fires between them), with the memory offer to a local reader."""

    count: int  # tensors in the state
    header: torch.Tensor
    meta: torch.Tensor
    first: list[torch.Tensor]
    second: list[torch.Tensor]
    offer: local_copy.Offer | None


def _outgoing(state: dict, stripe: int, stripes: int) -> _Outgoing:
    tensors: list[torch.Tensor] = []
    skeleton = flatten(state, tensors)
    tensors = [t.detach().contiguous() for t in tensors]
    specs = [(str(t.dtype), tuple(t.shape)) for t in tensors]
    small = [t for t in tensors if 0 < _nbytes(t) < SMALL_BYTES]
    packed = torch.cat([_as_bytes(t) for t in small]) if small else None
    packed_n = packed.numel() if packed is not None else 0
    first, second = (_stripe_views(_pieces(tensors, packed), stripe, stripes, h) for h in (0, 1))
    offer = local_copy.Offer.of(first + second) if local_copy.enabled() else None
    info = {"skeleton": skeleton, "specs": specs, "local": offer.as_dict() if offer else None}
    meta = torch.frombuffer(bytearray(pickle.dumps(info, protocol=5)), dtype=torch.uint8)
    header = torch.tensor(
        [meta.numel(), len(tensors), packed_n, stripe, stripes], dtype=torch.int64
    )
    return _Outgoing(len(tensors), header, meta, first, second, offer)


def send_state(
    coll: Interruptible,
    state: dict,
    dst: int,
    stripe: int = 0,
    stripes: int = 1,
    midway: Callable[[], None] | None = None,
) -> TransferStats:
    """Send stripe `stripe` of `stripes` of `state` to `dst` (the whole state when stripes=1).
    `midway` (fault injection) runs once the first half of the stripe's bytes is sent, or, when
    the receiver may read them from this process's memory, while it reads."""
    if not 0 <= stripe < stripes:
        raise ValueError(f"stripe {stripe} outside 0..{stripes - 1}")
    t0 = time.perf_counter()
    out = _outgoing(state, stripe, stripes)
    views = out.first + out.second
    what = "state stripe" if stripes > 1 else "state"
    total = out.meta.numel() + sum(v.numel() for v in views)
    if out.offer is not None:
        if _offered_read(coll, out, dst, what, midway):
            return TransferStats(total, out.count, time.perf_counter() - t0, stripes, path="memory")
        coll.send(views, dst, what)
    elif midway is None:
        coll.send([out.header, out.meta] + views, dst, what)
    else:
        coll.send([out.header, out.meta] + out.first, dst, what)
        midway()
        coll.send(out.second, dst, what)
    return TransferStats(total, out.count, time.perf_counter() - t0, stripes)


def _offered_read(
    coll: Interruptible, out: _Outgoing, dst: int, what: str, midway: Callable[[], None] | None
) -> bool:
    """Offer this process's memory: the receiver reads the bytes from it if it can (same host)
    and answers (the stripe's views stay unchanged until then; fault injection fires while it
    reads). True when it read them all."""
    answer = torch.zeros(1, dtype=torch.int64)
    with local_copy.ReadersAllowed():
        coll.send([out.header, out.meta], dst, what)
        if midway is not None:
            midway()
        coll.recv([answer], dst, "state read answer")
    return int(answer[0]) == READ_DONE


def _targets(
    specs: list, skeleton: object, live: dict[tuple, torch.Tensor]
) -> tuple[list[torch.Tensor], int]:
    """One receive tensor per spec (the live one when it fits); the count freshly allocated."""
    paths = slot_paths(skeleton)
    tensors, fresh = [], 0
    for i, (dtype_name, shape) in enumerate(specs):
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            raise RuntimeError(
                f"peer sent tensor dtype {dtype_name!r}; supported: {sorted(_DTYPES)}"
            )
        target = live.get(paths.get(i, ()))
        if (
            target is None
            or target.dtype != dtype
            or tuple(target.shape) != tuple(shape)
            or not target.is_contiguous()
            or target.device.type != "cpu"
        ):
            target = torch.empty(shape, dtype=dtype)
            fresh += 1
        tensors.append(target)
    return tensors, fresh


def recv_state(
    coll: Interruptible, src: int | list[int], live: dict[tuple, torch.Tensor]
) -> tuple[dict, TransferStats]:
    """Receive a state from `src` (one rank, or the senders of its stripes in stripe order);
    tensors land in `live` (path -> tensor) where they fit."""
    srcs = [src] if isinstance(src, int) else list(src)
    if not srcs or len(set(srcs)) != len(srcs):
        raise ValueError(f"state sources {srcs} must be distinct and non-empty")
    k = len(srcs)
    t0 = time.perf_counter()
    count, packed_n, metas = _recv_headers(coll, srcs)
    infos = [pickle.loads(m.numpy().tobytes()) for m in metas]  # in-job peers only
    skeleton, specs = infos[0]["skeleton"], infos[0]["specs"]
    for s, info in zip(srcs[1:], infos[1:]):
        if info["specs"] != specs:
            raise RuntimeError(f"rank {s} sends tensors of other dtypes/shapes than rank {srcs[0]}")
    if len(specs) != count:
        raise RuntimeError(f"state metadata lists {len(specs)} tensors, header said {count}")
    t1 = time.perf_counter()
    tensors, fresh = _targets(specs, skeleton, live)
    small = [t for t in tensors if 0 < _nbytes(t) < SMALL_BYTES]
    if sum(_nbytes(t) for t in small) != packed_n:
        raise RuntimeError(f"packed size mismatch: peer sends {packed_n} bytes of small tensors")
    blob = torch.empty(packed_n, dtype=torch.uint8) if packed_n else None
    pieces = _pieces(tensors, blob)
    t2 = time.perf_counter()
    with torch.no_grad():
        wire, fallback = _recv_payload(coll, srcs, infos, pieces)
        t3 = time.perf_counter()
        if blob is not None:
            _unpack(blob, small)
    total = sum(m.numel() for m in metas) + sum(p.numel() for p in pieces)
    t4 = time.perf_counter()
    phases = {
        "meta_s": round(t1 - t0, 5),
        "alloc_s": round(t2 - t1, 5),
        "payload_s": round(t3 - t2, 5),
        "unpack_s": round(t4 - t3, 5),
        "fresh_tensors": fresh,
    }
    path = "wire" if len(wire) == k else "memory" if not wire else "memory+wire"
    return unflatten(skeleton, tensors), TransferStats(
        total, count, t4 - t0, k, phases, path, fallback
    )


def _recv_headers(coll: Interruptible, srcs: list[int]) -> tuple[int, int, list[torch.Tensor]]:
    """Every sender's header (checked: stripes in order, replicas announcing the same state)
    and metadata: (tensor count, packed bytes, the metadata blobs)."""
    k = len(srcs)
    headers = [torch.zeros(HEADER_LEN, dtype=torch.int64) for _ in srcs]
    coll.wait_blocking(
        [dist.irecv(h, s) for h, s in zip(headers, srcs)], "state header", tuple(headers)
    )
    vals = [[int(x) for x in h.tolist()] for h in headers]
    for i, (s, (_, count, packed_n, stripe, stripes)) in enumerate(zip(srcs, vals)):
        if (stripe, stripes) != (i, k):
            raise RuntimeError(f"rank {s} sent stripe {stripe}/{stripes}, expected {i}/{k}")
        if (count, packed_n) != tuple(vals[0][1:3]):
            raise RuntimeError(
                f"rank {s} announces {count} tensors/{packed_n} packed bytes, "
                f"rank {srcs[0]} {vals[0][1]}/{vals[0][2]}: replicas differ"
            )
    metas = [torch.empty(v[0], dtype=torch.uint8) for v in vals]
    coll.wait_blocking(
        [dist.irecv(m, s) for m, s in zip(metas, srcs)], "state metadata", tuple(metas)
    )
    return vals[0][1], vals[0][2], metas


def _recv_payload(
    coll: Interruptible, srcs: list[int], infos: list[dict], pieces: list[torch.Tensor]
) -> tuple[list[int], str]:
    """The stripes' bytes into `pieces`: read from the senders' memory where offered, the
    rest over the wire; the stripes that came over the wire, and why a read failed."""
    k = len(srcs)
    stripe_views = [
        _stripe_views(pieces, i, k, 0) + _stripe_views(pieces, i, k, 1) for i in range(k)
    ]
    wire, fallback = _read_local(coll, srcs, infos, stripe_views)
    works, keep = [], []
    for i in wire:
        works += [dist.irecv(v, srcs[i]) for v in stripe_views[i]]
        keep += stripe_views[i]
    if works:
        coll.wait_blocking(works, "state stripes" if k > 1 else "state tensors", tuple(keep))
    return wire, fallback


def _unpack(blob: torch.Tensor, small: list[torch.Tensor]) -> None:
    """The packed small tensors' bytes back into them, in order."""
    off = 0
    for t in small:
        n = _nbytes(t)
        _as_bytes(t).copy_(blob[off : off + n])
        off += n


def _read_local(
    coll: Interruptible, srcs: list[int], infos: list[dict], stripe_views: list[list[torch.Tensor]]
) -> tuple[list[int], str]:
    """Read every stripe whose sender offered its memory (same host) straight from it and
    answer each such sender; the indices of the stripes that must come over the wire, and why
    an offered read failed ("" when none did)."""
    wire, answers, reasons = [], [], []
    for i, (src, info) in enumerate(zip(srcs, infos)):
        offer = local_copy.Offer.from_dict(info.get("local"))
        if offer is None:
            wire.append(i)
            continue
        why = local_copy.read(offer, stripe_views[i]) if local_copy.enabled() else "off here"
        if why is not None:
            wire.append(i)
            if local_copy.enabled():  # turned off here on purpose is no failure
                reasons.append(f"rank {src}: {why}")
        answers.append((src, torch.tensor([SEND_IT if why else READ_DONE], dtype=torch.int64)))
    if answers:
        coll.wait_blocking(
            [dist.isend(a, s) for s, a in answers],
            "state read answer",
            tuple(a for _, a in answers),
        )
    return wire, "; ".join(reasons)
