"""The fault taxonomy: one list of kinds, shared by the agent, the controller and the runtime."""

from __future__ import annotations

from launcher.protocol.faults import (
    IN_PLACE_KINDS,
    INJECTION_KINDS,
    RUNTIME_INJECTIONS,
    SIGNAL_INJECTIONS,
    WORKER_FAULT_KINDS,
    FaultKind,
)


def test_wire_kinds_parse_and_unknown_ones_do_not_crash() -> None:
    assert FaultKind.parse("uce-low") is FaultKind.UCE_LOW
    assert FaultKind.parse("no-such-kind") is FaultKind.UNKNOWN
    assert FaultKind.parse(None) is FaultKind.UNKNOWN


def test_worker_and_in_place_kinds_are_kinds_of_the_taxonomy() -> None:
    values = {k.value for k in FaultKind}
    assert set(WORKER_FAULT_KINDS) <= values
    assert {k.value for k in IN_PLACE_KINDS} < set(WORKER_FAULT_KINDS)  # exception restarts
    assert FaultKind.EXCEPTION.value in WORKER_FAULT_KINDS and "signal" not in WORKER_FAULT_KINDS


def test_the_runtime_and_ftctl_use_the_same_lists() -> None:
    from launcher.cli.inject import inject
    from launcher.runtime import devices, faultplan

    assert (
        devices.UCE_LOW,
        devices.UCE_HIGH,
        devices.NETWORK,
        devices.UNSAFE_DATA,
        devices.EXCEPTION,
    ) == WORKER_FAULT_KINDS
    assert faultplan.KINDS is INJECTION_KINDS
    kind_option = next(p for p in inject.params if p.name == "kind")
    assert tuple(kind_option.type.choices) == INJECTION_KINDS


def test_injections_split_into_agent_signals_and_runtime_kinds() -> None:
    assert set(SIGNAL_INJECTIONS) | RUNTIME_INJECTIONS == set(INJECTION_KINDS)
    assert not set(SIGNAL_INJECTIONS) & RUNTIME_INJECTIONS
    assert "exit" in RUNTIME_INJECTIONS and set(WORKER_FAULT_KINDS) <= RUNTIME_INJECTIONS


def test_collective_failures_of_peers_are_recognised_in_backend_text() -> None:
    from launcher.protocol.faults import collective_failure

    gloo = (
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
        "Timed out waiting 1800000ms for recv operation to complete"
    )
    assert collective_failure(gloo) == "gloo collective timeout"
    assert (
        collective_failure(
            "[Rank 1] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=5, OpType=ALLREDUCE)"
        )
        == "NCCL collective timeout"
    )
    assert (
        collective_failure("gloo: Connection closed by peer [127.0.0.1]:1234")
        == "peer connection closed"
    )
    assert collective_failure("ValueError: bad shape") == ""
