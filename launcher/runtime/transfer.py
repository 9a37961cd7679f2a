"""Peer-to-peer state transfer between replicas.

Owns: the wire format one rank uses to hand its full state to another over the default process
group: a 3 x int64 header (metadata bytes, tensor count, packed bytes), the metadata (the state's
skeleton with tensors replaced by slots, plus each tensor's dtype and shape) as torch.save bytes,
then every large tensor sent directly as raw bytes into a same-shaped tensor on the receiver
(its live tensor when one exists at the same path, so parameters are overwritten in place), then
one packed blob of all small tensors. Metadata is loaded with weights_only=False; it only ever
comes from a peer of the same job. Every send/recv is interruptible (see collectives).
"""
from __future__ import annotations

import io
import time
from dataclasses import dataclass

import torch

from launcher.runtime.collectives import Interruptible
from launcher.runtime.state import flatten, slot_paths, unflatten

SMALL_BYTES = 1 << 16  # tensors below this travel together in one packed blob
_DTYPES = {str(d): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


@dataclass
class TransferStats:
    nbytes: int
    tensors: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9) / 1e9


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (shares memory)."""
    return t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def send_state(coll: Interruptible, state: dict, dst: int) -> TransferStats:
    t0 = time.perf_counter()
    tensors: list[torch.Tensor] = []
    skeleton = flatten(state, tensors)
    tensors = [t.detach().cpu().contiguous() if t.device.type == "cpu" else t.detach().contiguous()
               for t in tensors]
    specs = [(str(t.dtype), tuple(t.shape)) for t in tensors]
    buf = io.BytesIO()
    torch.save({"skeleton": skeleton, "specs": specs}, buf)
    meta = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    small = [t for t in tensors if 0 < t.numel() and t.numel() * t.element_size() < SMALL_BYTES]
    packed_n = sum(t.numel() * t.element_size() for t in small)
    header = torch.tensor([meta.numel(), len(tensors), packed_n], dtype=torch.int64)
    coll.send([header, meta], dst, "state header")
    payload = [_as_bytes(t) for t in tensors if t.numel() * t.element_size() >= SMALL_BYTES]
    if packed_n:
        payload.append(torch.cat([_as_bytes(t) for t in small]))
    coll.send(payload, dst, "state tensors")
    total = meta.numel() + sum(p.numel() for p in payload)
    return TransferStats(total, len(tensors), time.perf_counter() - t0)


def recv_state(coll: Interruptible, src: int, live: dict[tuple, torch.Tensor]) -> tuple[dict, TransferStats]:
    """Receive a state from `src`; tensors land in `live` (path -> tensor) where they fit."""
    t0 = time.perf_counter()
    header = coll.recv([torch.zeros(3, dtype=torch.int64)], src, "state header")[0]
    meta_n, count, packed_n = (int(x) for x in header.tolist())
    meta = coll.recv([torch.empty(meta_n, dtype=torch.uint8)], src, "state metadata")[0]
    info = torch.load(io.BytesIO(meta.numpy().tobytes()), weights_only=False)  # in-job peer only
    skeleton, specs = info["skeleton"], info["specs"]
    if len(specs) != count:
        raise RuntimeError(f"state metadata lists {len(specs)} tensors, header said {count}")
    paths = slot_paths(skeleton)
    tensors: list[torch.Tensor] = []
    for i, (dtype_name, shape) in enumerate(specs):
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            raise RuntimeError(f"peer sent tensor dtype {dtype_name!r}; supported: {sorted(_DTYPES)}")
        target = live.get(paths.get(i, ()))
        if target is None or target.dtype != dtype or tuple(target.shape) != tuple(shape) \
                or not target.is_contiguous() or target.device.type != "cpu":
            target = torch.empty(shape, dtype=dtype)
        tensors.append(target)
    small = [t for t in tensors if 0 < t.numel() * t.element_size() < SMALL_BYTES]
    if sum(t.numel() * t.element_size() for t in small) != packed_n:
        raise RuntimeError(f"packed size mismatch: peer sends {packed_n} bytes of small tensors")
    payload = [_as_bytes(t) for t in tensors if t.numel() * t.element_size() >= SMALL_BYTES]
    blob = torch.empty(packed_n, dtype=torch.uint8)
    with torch.no_grad():
        coll.recv(payload + ([blob] if packed_n else []), src, "state tensors")
        total = meta_n + sum(p.numel() for p in payload) + packed_n
        if packed_n:
            off = 0
            for t in small:
                n = t.numel() * t.element_size()
                _as_bytes(t).copy_(blob[off:off + n])
                off += n
    return unflatten(skeleton, tensors), TransferStats(total, count, time.perf_counter() - t0)
