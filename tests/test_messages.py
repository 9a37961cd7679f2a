"""The worker channel's messages: one codec for both ends, strict about what it accepts."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from launcher.protocol.messages import (
    MESSAGES,
    Bye,
    FaultReport,
    Heartbeat,
    Hello,
    Imports,
    Inject,
    MessageError,
    Pause,
    Recovered,
    Stop,
    decode,
    encode,
    message,
)

SAMPLES = [
    Hello(rank=3, local_rank=1, pid=99, generation=2, replacement=True),
    Heartbeat(rank=3, step=7, phase="backward", committed_step=6, waiting=True, time=1.5),
    FaultReport(rank=3, kind="uce-low", message="boom", step=7, phase="forward", injected=True),
    Recovered(rank=3, generation=2, resume_step=8, action="rollback", timings={"stop_s": 0.1}),
    Imports(rank=3, modules=["torch._dynamo", "megatron.core"]),
    Imports(rank=3, modules=["megatron.core"], at="start"),
    Bye(rank=3),
    Stop(generation=2, strategy="retry", failed_ranks=[1]),
    Inject(kind="kill", step=None, phase=None),
    Pause(seq=3),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.op)
def test_every_message_round_trips_as_one_json_line(msg) -> None:
    line = encode(msg)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line)["op"] == msg.op
    assert decode(line.rstrip(b"\n")) == msg


def test_every_registered_op_has_a_sample() -> None:
    assert sorted(MESSAGES) == sorted({m.op for m in SAMPLES})


def test_defaults_fill_what_an_older_peer_leaves_out_and_extra_fields_are_ignored() -> None:
    assert decode(b'{"op":"heartbeat","rank":1}') == Heartbeat(rank=1)
    assert decode(b'{"op":"stop","generation":4,"new_field":1}') == Stop(generation=4)


@pytest.mark.parametrize(
    "line, error",
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"op":"teleport"}', "unknown op"),
        (b'{"rank":1}', "unknown op"),
        (b'{"op":"stop"}', "without 'generation'"),
        (b'{"op":"stop","generation":"2"}', "stop.generation='2' is not int"),
        (b'{"op":"stop","generation":true}', "is not int"),
        (b'{"op":"stop","generation":2,"failed_ranks":[1,"x"]}', "failed_ranks"),
        (b'{"op":"inject","kind":"kill","step":1.5}', "inject.step"),
        (
            b'{"op":"recovered","rank":1,"generation":2,"resume_step":3,"action":"x","timings":{"a":"b"}}',
            "timings",
        ),
    ],
)
def test_invalid_lines_raise_one_clear_error(line: bytes, error: str) -> None:
    with pytest.raises(MessageError, match=error):
        decode(line)


def test_floats_accept_integers_and_optionals_accept_null() -> None:
    assert decode(b'{"op":"heartbeat","rank":1,"time":3}').time == 3
    assert decode(b'{"op":"inject","kind":"hang","step":null}').step is None


def test_only_registered_messages_encode_and_ops_are_unique() -> None:
    @dataclass
    class Stray:
        rank: int

    with pytest.raises(TypeError, match="not a registered"):
        encode(Stray(1))
    with pytest.raises(ValueError, match="twice"):
        message("stop")(Stray)
