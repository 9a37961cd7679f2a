"""Device adapters: classification, RNG, and the torch_npu calls (mocked at the device boundary)."""

from __future__ import annotations

import types

import pytest
import torch

from launcher.runtime import devices as D


def test_cpu_adapter_classifies():
    cpu = D.select_adapter("gloo")
    assert cpu.name == "cpu" and cpu.device(3) == torch.device("cpu")
    assert cpu.classify_exception(D.InjectedFault("uce-low", "x")).kind == "uce-low"
    gloo = RuntimeError(
        "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"
    )
    assert cpu.classify_exception(gloo).kind == "network"
    assert (
        cpu.classify_exception(RuntimeError("There is unsafe data in the input tensor")).kind
        == "unsafe-data"
    )
    assert cpu.classify_exception(ValueError("shape mismatch")) is None
    assert cpu.rng_state() is None
    with pytest.raises(ValueError, match="cpu adapter"):
        cpu.set_rng_state(b"x")


def test_selection_errors_are_clear(monkeypatch):
    with pytest.raises(ValueError, match="device='tpu'"):
        D.select_adapter("gloo", "tpu")
    monkeypatch.setattr(D, "_import_torch_npu", lambda: None)
    with pytest.raises(RuntimeError, match="torch_npu"):
        D.select_adapter("hccl")


def test_cuda_sticky_errors_are_process_fatal(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = D.select_adapter("nccl")
    c = cuda.classify_exception(
        RuntimeError("CUDA error: an illegal memory access was encountered")
    )
    assert c.kind == "exception" and c.fatal
    assert (
        cuda.classify_exception(RuntimeError("NCCL error: remote process exited")).kind == "network"
    )


class FakeNpu:
    """Stands in for torch_npu.npu: records the device calls the adapter makes."""

    UCE_LOW_LEVEL, UCE_HIGH_LEVEL = 2, 3

    def __init__(self, level: int) -> None:
        self.level = level
        self.calls: list[tuple] = []

    def device_count(self) -> int:
        return 8

    def check_uce_in_memory(self, index: int) -> int:
        self.calls.append(("check_uce_in_memory", index))
        return self.level

    def stop_device(self, index: int) -> None:
        self.calls.append(("stop_device", index))

    def restart_device(self, index: int) -> None:
        self.calls.append(("restart_device", index))


@pytest.mark.parametrize("level,kind", [(2, "uce-low"), (3, "uce-high")])
def test_npu_uce_level_comes_from_check_uce_in_memory(monkeypatch, level, kind):
    fake = FakeNpu(level)
    monkeypatch.setattr(D, "_import_torch_npu", lambda: types.SimpleNamespace(npu=fake))
    npu = D.select_adapter("hccl")
    assert npu.name == "npu" and npu.bind(10) == 2
    assert npu.classify_exception(RuntimeError("UCE ERROR happened")).kind == kind
    npu.stop_device()
    npu.restart_device()
    assert fake.calls == [("check_uce_in_memory", 2), ("stop_device", 2), ("restart_device", 2)]
    assert npu.classify_exception(RuntimeError("HCCL timeout")).kind == "network"
