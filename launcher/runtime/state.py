"""What makes up a rank's training state, and its step-start snapshots.

Owns: the registry of the script's stateful objects (models, optimizers, LR schedulers, a data
position getter/setter, extra global tensors, an optional rollback hook), RNG capture/restore
(python, numpy, torch CPU, device via the adapter), `Snapshot`s (RNG + data position + model
buffers + extra tensors at the start of a step) and the flattening of a state into a small
picklable skeleton plus an ordered list of tensors, used by peer transfer and checkpoints.

A snapshot is taken at every step's start (when the step before it commits), so it is kept
cheap: numpy's and python's global RNG states (~30 us and ~6 us to read through their APIs)
are read only when their raw generator bytes changed since the last read (`NumpyRng`,
`PythonRng`), and a model's buffers are found through the modules' buffer tables listed once,
not by walking the module tree.
"""

from __future__ import annotations

import ctypes
import random
import struct
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from launcher.runtime.devices import DeviceAdapter


@dataclass(frozen=True)
class TensorSlot:
    """Placeholder for the i-th tensor of a flattened state."""

    index: int


def flatten(obj: Any, out: list[torch.Tensor]) -> Any:
    """Copy of `obj` with every tensor replaced by a TensorSlot; tensors appended to `out`."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return TensorSlot(len(out) - 1)
    if isinstance(obj, dict):
        return {k: flatten(v, out) for k, v in obj.items()}
    if isinstance(obj, list):
        return [flatten(v, out) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(flatten(v, out) for v in obj)
    return obj


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, TensorSlot):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    if isinstance(skeleton, tuple) and not hasattr(skeleton, "_fields"):
        return tuple(unflatten(v, tensors) for v in skeleton)
    return skeleton


def tensor_paths(obj: Any, path: tuple = ()) -> dict[tuple, torch.Tensor]:
    """Every tensor inside nested dicts/lists/tuples, keyed by its access path."""
    out: dict[tuple, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[path] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(tensor_paths(v, path + (k,)))
    elif isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        for i, v in enumerate(obj):
            out.update(tensor_paths(v, path + (i,)))
    return out


def slot_paths(skeleton: Any, path: tuple = ()) -> dict[int, tuple]:
    """TensorSlot index -> access path, for a flattened skeleton."""
    out: dict[int, tuple] = {}
    if isinstance(skeleton, TensorSlot):
        out[skeleton.index] = path
    elif isinstance(skeleton, dict):
        for k, v in skeleton.items():
            out.update(slot_paths(v, path + (k,)))
    elif isinstance(skeleton, (list, tuple)) and not hasattr(skeleton, "_fields"):
        for i, v in enumerate(skeleton):
            out.update(slot_paths(v, path + (i,)))
    return out


MT19937_STATE_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624]; int pos
# An MT19937 state is compared by its position and its first FINGERPRINT_WORDS words, not all 624:
# a draw moves the position; the regeneration after 624 draws (the "twist") rewrites every word,
# each one equal to its old value with probability 2^-32, so an unchanged fingerprint after a
# change has probability 2^-128. Reading 20 bytes instead of 2.5 kB matters because a snapshot
# runs right after the step's computation has evicted them from the caches (~10 us per state).
FINGERPRINT_WORDS = 4


class NumpyRng:
    """numpy's legacy global RNG state (`np.random.get_state()`), re-read only when it may differ.

    Reading it through numpy's API costs ~30 us (a Python loop over 624 words); comparing the
    generator's raw position and first words (FINGERPRINT_WORDS) with those seen at the last
    read costs well under 1 us. The
    legacy state is (key, pos, has_gauss, gauss): every draw moves key/pos, except taking a
    cached gaussian (has_gauss 1 -> 0), so the last state is reused only when the raw bytes are
    unchanged and it held no cached gaussian. Snapshots share the reused tuple; nothing mutates it.
    """

    def __init__(self) -> None:
        self._mtrand = np.random.mtrand  # the module holding the global RandomState `_rand`
        self._gen: Any = None  # the bit generator whose raw state we read
        self._words: memoryview | None = None  # its first words and its position, in place
        self._pos: memoryview | None = None
        self._raw = b""
        self._state: Any = None

    def get(self) -> Any:
        gen = self._mtrand._rand._bit_generator
        if gen is not self._gen:
            self._gen, self._state, self._raw, self._words = gen, None, b"", None
            try:
                if type(gen).__name__ == "MT19937":
                    addr = int(gen.ctypes.state_address)
                    self._words = memoryview(
                        (ctypes.c_char * (4 * FINGERPRINT_WORDS)).from_address(addr)
                    )
                    self._pos = memoryview((ctypes.c_char * 4).from_address(addr + 624 * 4))
            except (AttributeError, TypeError, ValueError):
                self._words = None
        if self._words is None or self._pos is None:
            return np.random.get_state()
        raw = self._words.tobytes() + self._pos.tobytes()
        if self._state is None or raw != self._raw or self._state[3]:
            self._state = np.random.get_state()
            self._raw = raw
        return self._state


class PythonRng:
    """`random.getstate()`, re-read only when the generator's raw state or gauss_next changed.

    getstate() builds a tuple of 625 ints (~6 us). CPython's generator object holds, right after
    the object header, `int index; uint32_t state[624]` -- exactly getstate()'s numbers. Between
    full reads only the index and the first words are compared (FINGERPRINT_WORDS). The layout is
    checked against getstate() at every full read (the first one included); on any mismatch the
    raw comparison is dropped for good and every call reads getstate().
    """

    def __init__(self, inst: Any = None) -> None:
        self._inst = inst if inst is not None else random._inst  # type: ignore[attr-defined]
        offset = object.__basicsize__
        fits = type(self._inst).__basicsize__ >= offset + 4 + 624 * 4
        self._addr = id(self._inst) + offset if fits else 0
        # the index and the first words, read in place (a view made once: ctypes.string_at per
        # call costs several us right after a step's computation)
        self._head = (
            memoryview((ctypes.c_char * (4 + 4 * FINGERPRINT_WORDS)).from_address(self._addr))
            if self._addr
            else None
        )
        self._raw = b""
        self._gauss: Any = None
        self._state: Any = None

    def get(self) -> Any:
        if not self._addr or self._head is None:
            return self._inst.getstate()
        raw = self._head.tobytes()
        gauss = self._inst.gauss_next
        if self._state is not None and raw == self._raw and gauss is self._gauss:
            return self._state
        state = self._inst.getstate()
        words = state[1]
        full = ctypes.string_at(self._addr, 4 + 624 * 4)
        if len(words) != 625 or struct.unpack_from("i624I", full) != (words[624], *words[:624]):
            self._addr = 0  # not the layout we read: never trust the raw bytes again
            return state
        self._raw, self._gauss, self._state = full[: 4 + 4 * FINGERPRINT_WORDS], gauss, state
        return state


_NUMPY_RNG = NumpyRng()
_PYTHON_RNG = PythonRng()


def capture_rng(device: DeviceAdapter) -> dict:
    return {
        "python": _PYTHON_RNG.get(),
        "numpy": _NUMPY_RNG.get(),
        "torch": torch.get_rng_state(),
        "device": device.rng_state(),
    }


def restore_rng(state: dict, device: DeviceAdapter) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    device.set_rng_state(state.get("device"))


@dataclass
class Snapshot:
    """A rank's resumable non-parameter state at the start of step `step`."""

    step: int
    rng: dict
    data_pos: Any
    buffers: list[torch.Tensor]  # clones of every registered model's buffers, in order
    extras: dict[str, torch.Tensor]


@dataclass
class Registered:
    """The stateful objects a script registered; lists keep registration order."""

    models: list[torch.nn.Module] = field(default_factory=list)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    data: tuple[Callable[[], Any], Callable[[Any], None]] | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    on_rollback: Callable[[int], None] | None = None
    # per model, the buffer tables (`Module._buffers`) of its modules in `modules()` order, listed
    # at the first use: the module tree is the one registered (as for parameters)
    _buffer_tables: list[list[dict]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def buffers(self) -> list[torch.Tensor]:
        """`[b for m in models for b in m.buffers()]`, without walking the module tree."""
        if self._buffer_tables is None:
            self._buffer_tables = [[mod._buffers for mod in m.modules()] for m in self.models]
        out: list[torch.Tensor] = []
        for tables in self._buffer_tables:
            seen: set[int] = set()
            for table in tables:
                for b in table.values():
                    if b is not None and id(b) not in seen:
                        seen.add(id(b))
                        out.append(b)
        return out

    def params(self) -> list[torch.Tensor]:
        return [p for m in self.models for p in m.parameters()]

    def data_position(self) -> Any:
        return self.data[0]() if self.data else None

    def set_data_position(self, pos: Any) -> None:
        if self.data:
            self.data[1](pos)

    def zero_grads(self) -> None:
        for p in self.params():
            p.grad = None

    def snapshot(self, step: int, device: DeviceAdapter) -> Snapshot:
        """Taken at every step's start, right after the previous step's computation (cold
        caches: each Python call costs about a microsecond), so the usual case makes few."""
        buffers = self.buffers()
        return Snapshot(
            step,
            capture_rng(device),
            self.data[0]() if self.data else None,
            [b.detach().clone() for b in buffers] if buffers else [],
            {k: v.detach().clone() for k, v in self.extras.items()} if self.extras else {},
        )

    def restore(self, snap: Snapshot, device: DeviceAdapter) -> None:
        """Roll the rank back to the start of `snap.step` (parameters/optimizer untouched)."""
        restore_rng(snap.rng, device)
        self.set_data_position(snap.data_pos)
        with torch.no_grad():
            for b, saved in zip(self.buffers(), snap.buffers, strict=True):
                b.copy_(saved)
            for k, v in self.extras.items():
                v.copy_(snap.extras[k])
        self.zero_grads()
        if self.on_rollback is not None:
            self.on_rollback(snap.step)

    # ---- full state (peer transfer and durable checkpoints) --------------------------
    def live_tensors(self) -> dict[tuple, torch.Tensor]:
        """Tensors a received state may be written into in place, by full-state path."""
        return tensor_paths(
            {
                "models": [m.state_dict() for m in self.models],
                "optimizers": [o.state_dict() for o in self.optimizers],
                "extras": dict(self.extras),
            }
        )

    def overwritten(self) -> list[torch.Tensor]:
        """The live tensors a received full state always overwrites (`load_full_state` copies
        into each one): every model's `state_dict()` tensors and the extras."""
        out = [
            t for m in self.models for t in m.state_dict().values() if isinstance(t, torch.Tensor)
        ]
        return out + list(self.extras.values())

    def state_bytes(self) -> int:
        """The bytes of host-memory tensors a full state carries (model state, optimizer
        state, extras): what a replacement on this device allocates in its process's heap."""
        tensors = [t for m in self.models for t in m.state_dict().values()]
        for o in self.optimizers:
            tensors += [v for st in o.state.values() for v in st.values()]
        tensors += list(self.extras.values())
        seen, total = set(), 0
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.nelement() * t.element_size()
        return total

    def full_state(self, snap: Snapshot) -> dict:
        """Everything a replica needs to continue at `snap.step`; tensors alias live state."""
        return {
            "models": [m.state_dict() for m in self.models],
            "optimizers": [o.state_dict() for o in self.optimizers],
            "schedulers": [s.state_dict() for s in self.schedulers],
            "extras": dict(self.extras),
            "rng": snap.rng,
            "data_pos": snap.data_pos,
            "step": snap.step,
        }

    def load_full_state(self, state: dict, device: DeviceAdapter) -> None:
        """Apply a full state (model tensors already received in place are copied onto
        themselves)."""
        if (
            len(state["models"]) != len(self.models)
            or len(state["optimizers"]) != len(self.optimizers)
            or len(state["schedulers"]) != len(self.schedulers)
        ):
            raise RuntimeError(
                f"state holds {len(state['models'])} models/{len(state['optimizers'])} optimizers/"
                f"{len(state['schedulers'])} schedulers; this rank registered {len(self.models)}/"
                f"{len(self.optimizers)}/{len(self.schedulers)}"
            )
        with torch.no_grad():
            for i, (m, sd) in enumerate(zip(self.models, state["models"])):
                live = m.state_dict()
                if set(live) != set(sd):
                    raise RuntimeError(
                        f"model {i}: state keys differ from this rank's model: "
                        f"missing {sorted(set(live) - set(sd))[:5]}, "
                        f"unexpected {sorted(set(sd) - set(live))[:5]}"
                    )
                other = {
                    k: v
                    for k, v in sd.items()
                    if not isinstance(v, torch.Tensor) and not (v is None and live[k] is None)
                }  # e.g. megatron's _extra_state
                if other:
                    m.load_state_dict(other, strict=False)
                for k, v in sd.items():
                    if not isinstance(v, torch.Tensor):
                        continue
                    if live[k].shape != v.shape:
                        raise RuntimeError(
                            f"model {i} tensor {k!r}: shape {tuple(v.shape)} "
                            f"does not match this rank's {tuple(live[k].shape)}"
                        )
                    if live[k].data_ptr() != v.data_ptr():
                        live[k].copy_(v)
            if set(state["extras"]) != set(self.extras):
                raise RuntimeError(
                    f"extra tensors {sorted(state['extras'])} differ from this rank's "
                    f"{sorted(self.extras)}"
                )
            for k, v in state["extras"].items():
                if self.extras[k].data_ptr() != v.data_ptr():
                    self.extras[k].copy_(v)
        for o, sd in zip(self.optimizers, state["optimizers"]):
            o.load_state_dict(sd)
        for s, sd in zip(self.schedulers, state["schedulers"]):
            s.load_state_dict(sd)
        restore_rng(state["rng"], device)
        self.set_data_position(state["data_pos"])
        self.zero_grads()
