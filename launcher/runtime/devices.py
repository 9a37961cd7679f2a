"""Device adapters: everything the runtime asks of an accelerator goes through one of these.

Owns: the `DeviceAdapter` interface (name, torch device, abort of communicator groups, exception
-> fault-kind classification, device RNG state, UCE memory check, device stop/restart) and its
three implementations: `cpu` (gloo; nothing to abort, recognises injected faults), `cuda` (NCCL
abort, sticky CUDA errors are process-fatal) and `npu` (torch_npu, imported only when present;
HCCL abort, check_uce_in_memory, stop_device/restart_device). Tests mock only at this boundary.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from launcher.protocol.faults import FaultKind

# The kinds a worker reports itself, as the strings the adapters classify into (taxonomy:
# launcher.protocol.faults).
UCE_LOW = FaultKind.UCE_LOW.value
UCE_HIGH = FaultKind.UCE_HIGH.value
NETWORK = FaultKind.NETWORK.value
UNSAFE_DATA = FaultKind.UNSAFE_DATA.value
EXCEPTION = FaultKind.EXCEPTION.value

_NETWORK_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Connection refused",
    "Broken pipe",
    "pair closure",
    "Timed out waiting",
    "Socket Timeout",
    "gloo",
)
_UNSAFE_MARKER = "There is unsafe data in the input tensor"


class InjectedFault(RuntimeError):
    """A fault raised on purpose by the fault plan or the cpu adapter; carries its kind."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Classified:
    kind: str
    fatal: bool = False  # the process cannot continue (must be restarted by the agent)


class DeviceAdapter:
    """cpu behaviour; subclasses override what their device does differently."""

    name = "cpu"

    def device(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def abort_groups(self, groups: list[Any]) -> None:
        """gloo ops cannot be aborted; the runtime abandons them instead (see collectives)."""

    def classify_exception(self, exc: BaseException) -> Classified | None:
        if isinstance(exc, InjectedFault):
            return Classified(exc.kind)
        text = str(exc)
        if _UNSAFE_MARKER in text:
            return Classified(UNSAFE_DATA)
        if isinstance(exc, (RuntimeError, ConnectionError, TimeoutError)) and any(
            m in text for m in _NETWORK_MARKERS
        ):
            return Classified(NETWORK)
        return None

    def rng_state(self) -> Any:
        return None

    def set_rng_state(self, state: Any) -> None:
        if state is not None:
            raise ValueError(f"the {self.name} adapter has no device RNG state to restore")

    def check_memory(self) -> str | None:
        """After a UCE: UCE_LOW (memory reusable) or UCE_HIGH (state must be rebuilt)."""
        return None

    def stop_device(self) -> None:
        """Pause device work before cleaning (npu)."""

    def restart_device(self) -> None:
        """Resume the device after cleaning (npu)."""


class CudaAdapter(DeviceAdapter):
    name = "cuda"
    _STICKY = (
        "illegal memory access",
        "uncorrectable ECC error",
        "device-side assert",
        "unspecified launch failure",
        "misaligned address",
    )

    def device(self, local_rank: int) -> torch.device:
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))

    def abort_groups(self, groups: list[Any]) -> None:
        from torch.distributed import distributed_c10d as c10d

        for g in groups:
            try:
                g._get_backend(torch.device("cuda")).abort()
            except Exception:  # noqa: BLE001 - a group without a cuda backend has nothing to abort
                try:
                    c10d._abort_process_group(g)
                except Exception:  # noqa: BLE001
                    pass

    def classify_exception(self, exc: BaseException) -> Classified | None:
        text = str(exc)
        if any(m in text for m in self._STICKY):
            return Classified(EXCEPTION, fatal=True)  # sticky: the CUDA context is unusable
        if "NCCL" in text or "nccl" in text:
            return Classified(NETWORK)
        return super().classify_exception(exc)

    def rng_state(self) -> Any:
        return torch.cuda.get_rng_state_all()

    def set_rng_state(self, state: Any) -> None:
        if state is not None:
            torch.cuda.set_rng_state_all(state)


class NpuAdapter(DeviceAdapter):
    """Ascend NPU through torch_npu; every device call is looked up, never assumed."""

    name = "npu"
    _UCE_MARKERS = ("UCE ERROR", "0x80E01801", "uce error")

    def __init__(self, torch_npu: Any) -> None:
        self._tnpu = torch_npu
        self._npu = getattr(torch_npu, "npu", None) or getattr(torch, "npu")
        self._index = 0

    def bind(self, local_rank: int) -> int:
        """Pick this rank's NPU index (local_rank modulo the device count)."""
        count = self._npu.device_count() if hasattr(self._npu, "device_count") else 1
        self._index = local_rank % max(1, count)
        return self._index

    def device(self, local_rank: int) -> torch.device:
        return torch.device("npu", self.bind(local_rank))  # "npu" exists once torch_npu is imported

    def abort_groups(self, groups: list[Any]) -> None:
        for g in groups:
            try:
                g._get_backend(torch.device("npu")).abort()
            except Exception:  # noqa: BLE001 - older torch_npu: fall back to the HCCL comm abort
                backend = getattr(g, "_get_backend", None)
                abort = getattr(backend, "abort_hccl_comm", None) if backend else None
                if callable(abort):
                    abort("stop")

    def classify_exception(self, exc: BaseException) -> Classified | None:
        text = str(exc)
        if any(m in text for m in self._UCE_MARKERS):
            return Classified(self.check_memory() or UCE_HIGH)
        if "HCCL" in text or "hccl" in text:
            return Classified(NETWORK)
        return super().classify_exception(exc)

    def check_memory(self) -> str | None:
        check = getattr(self._npu, "check_uce_in_memory", None)
        if not callable(check):
            return UCE_HIGH  # cannot tell: assume the state is gone
        level = check(self._index)
        low = getattr(self._npu, "UCE_LOW_LEVEL", 2)
        high = getattr(self._npu, "UCE_HIGH_LEVEL", 3)
        if level == low:
            return UCE_LOW
        if level == high:
            return UCE_HIGH
        return None  # not a UCE the runtime can repair: the process must restart

    def stop_device(self) -> None:
        fn = getattr(self._npu, "stop_device", None)
        if callable(fn):
            fn(self._index)

    def restart_device(self) -> None:
        fn = getattr(self._npu, "restart_device", None)
        if callable(fn):
            fn(self._index)

    def rng_state(self) -> Any:
        fn = getattr(self._npu, "get_rng_state_all", None)
        return fn() if callable(fn) else None

    def set_rng_state(self, state: Any) -> None:
        fn = getattr(self._npu, "set_rng_state_all", None)
        if state is not None and callable(fn):
            fn(state)


def _import_torch_npu() -> Any | None:
    try:
        return importlib.import_module("torch_npu")
    except ImportError:
        return None


def select_adapter(backend: str, device: str | None = None) -> DeviceAdapter:
    """Pick the adapter for `device` ("cpu"/"cuda"/"npu") or, when None, from the backend."""
    wanted = device or {"nccl": "cuda", "hccl": "npu"}.get(backend, "cpu")
    if wanted == "cpu":
        return DeviceAdapter()
    if wanted == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"backend {backend!r} needs CUDA, but torch.cuda.is_available() is False"
            )
        return CudaAdapter()
    if wanted == "npu":
        mod = _import_torch_npu()
        if mod is None:
            raise RuntimeError(f"backend {backend!r} needs torch_npu, which is not installed")
        return NpuAdapter(mod)
    raise ValueError(f"device={wanted!r}; allowed: cpu, cuda, npu")
