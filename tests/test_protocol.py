"""Wire codec: round trips, partial buffers, limits, and frames recorded from torch 2.13."""
from __future__ import annotations

import random

import pytest

from rendezvous import protocol as P
from rendezvous.protocol import Op, Request

SAMPLES = [
    Request(Op.VALIDATE, num=P.VALIDATION_MAGIC),
    Request(Op.SET, (b"/k",), (b"v",)),
    Request(Op.COMPARE_SET, (b"/k",), (b"old", b"new")),
    Request(Op.GET, (b"/k",)),
    Request(Op.ADD, (b"/n",), (), -3),
    Request(Op.CHECK, (b"/a", b"/b")),
    Request(Op.WAIT, (b"/a",)),
    Request(Op.GETNUMKEYS),
    Request(Op.DELETE_KEY, (b"/k",)),
    Request(Op.APPEND, (b"/k",), (b"x" * 300,)),
    Request(Op.MULTI_GET, (b"/a", b"/b", b"/c")),
    Request(Op.MULTI_SET, (b"/a", b"/b"), (b"1", b"")),
    Request(Op.CANCEL_WAIT),
    Request(Op.PING, num=4242),
    Request(Op.QUEUE_PUSH, (b"/q",), (b"item",)),
    Request(Op.QUEUE_POP, (b"/q",)),
    Request(Op.QUEUE_LEN, (b"/q",)),
    Request(Op.LIST_KEYS),
    Request(Op.BARRIER, (b"/bar",), (), 8),
    Request(Op.FT_MUX, num=P.MUX_MAGIC),
]

# Bytes the torch 2.13 C++ client sent, recorded between it and torch's libuv server.
RECORDED = {
    "0102000000000000002f6b010000000000000076": Request(Op.SET, (b"/k",), (b"v",)),
    "06010000000000000002000000000000002f6b": Request(Op.WAIT, (b"/k",)),
    "0402000000000000002f6e0500000000000000": Request(Op.ADD, (b"/n",), (), 5),
    "0202000000000000002f6b010000000000000076010000000000000077":
        Request(Op.COMPARE_SET, (b"/k",), (b"v", b"w")),
    "0c": Request(Op.CANCEL_WAIT),
    "07": Request(Op.GETNUMKEYS),
    "0b020000000000000002000000000000002f6101000000000000003102000000000000002f62010000000000000032":
        Request(Op.MULTI_SET, (b"/a", b"/b"), (b"1", b"2")),
    "1002000000000000002f71": Request(Op.QUEUE_LEN, (b"/q",)),
    "0f02000000000000002f71": Request(Op.QUEUE_POP, (b"/q",)),
    "11": Request(Op.LIST_KEYS),
    "1203000000000000002f626b0100000000000000": Request(Op.BARRIER, (b"/bk",), (), 1),
}


@pytest.mark.parametrize("req", SAMPLES, ids=lambda r: P.OP_NAMES[r.op])
def test_round_trip_and_every_prefix_is_incomplete(req: Request) -> None:
    raw = P.encode_request(req)
    assert P.parse_request(raw, 0) == (req, len(raw))
    for cut in range(len(raw)):
        assert P.parse_request(raw[:cut], 0) is None
    # trailing bytes of the next frame are left alone
    assert P.parse_request(raw + b"\x07", 0) == (req, len(raw))


def test_recorded_torch_frames_decode_and_reencode() -> None:
    for hexed, want in RECORDED.items():
        raw = bytes.fromhex(hexed)
        assert P.parse_request(raw, 0) == (want, len(raw))
        assert P.encode_request(want) == raw


def test_handshake_matches_torch_client() -> None:
    # torch 2.13 sent 00 cef7853c 0d <u32 pid>
    assert P.handshake_bytes(0x0EB9).hex() == "00cef7853c0db90e0000"


def test_concatenated_stream_parses_in_order() -> None:
    stream = b"".join(P.encode_request(r) for r in SAMPLES)
    pos, got = 0, []
    while pos < len(stream):
        r, pos = P.parse_request(stream, pos)
        got.append(r)
    assert got == SAMPLES


def test_absurd_lengths_rejected_before_the_bytes_arrive() -> None:
    lim = P.Limits(max_key_bytes=100, max_value_bytes=1000, max_keys_per_request=10)
    huge_key = bytes((Op.GET,)) + (2**63).to_bytes(8, "little")
    with pytest.raises(P.ProtocolError, match="key of 9223372036854775808 bytes"):
        P.parse_request(huge_key, 0, lim)
    big_val = P.encode_request(Request(Op.SET, (b"/k",), (b"x",)))[:11] + (1001).to_bytes(8, "little")
    with pytest.raises(P.ProtocolError, match="value of 1001 bytes: at most 1000"):
        P.parse_request(big_val, 0, lim)
    many = bytes((Op.WAIT,)) + (11).to_bytes(8, "little")
    with pytest.raises(P.ProtocolError, match="11 keys: at most 10"):
        P.parse_request(many, 0, lim)
    many_set = bytes((Op.MULTI_SET,)) + (2**40).to_bytes(8, "little")
    with pytest.raises(P.ProtocolError, match="MULTI_SET"):
        P.parse_request(many_set, 0, lim)


def test_unknown_op_rejected() -> None:
    with pytest.raises(P.ProtocolError, match="unknown query type 99"):
        P.parse_request(b"\x63abc", 0)


def test_limits_validated() -> None:
    with pytest.raises(ValueError, match="max_key_bytes=0"):
        P.Limits(max_key_bytes=0)


def test_mux_frames() -> None:
    raw = P.encode_mux_request(7, Request(Op.GET, (b"/k",)))
    assert P.parse_mux_request(raw, 0) == (7, Request(Op.GET, (b"/k",)), len(raw))
    cancel = P.encode_mux_request(9, Request(Op.CANCEL_WAIT, num=7))
    assert P.parse_mux_request(cancel, 0) == (9, Request(Op.CANCEL_WAIT, num=7), 9)
    for cut in range(len(cancel)):
        assert P.parse_mux_request(cancel[:cut], 0) is None


def test_reply_parsers() -> None:
    R = P.Reply
    cases = [
        (R.U8, b"\x01", 1, 0),
        (R.U32, P.enc_u32(77), 77, 0),
        (R.I64, P.enc_i64(-5), -5, 0),
        (R.BYTES, P.enc_bytes(b"abc"), b"abc", 0),
        (R.MULTI, P.enc_bytes_list([b"a", b"", b"ccc"]), [b"a", b"", b"ccc"], 3),
        (R.QUEUE_POP, P.enc_queue_pop(2, b"qq"), (2, b"qq"), 0),
        (R.QUEUE_POP, P.enc_queue_pop(0, None), (0, None), 0),
        (R.KEY_LIST, P.enc_key_list([b"/a", b"/bb"]), [b"/a", b"/bb"], 0),
    ]
    for shape, raw, want, count in cases:
        assert P.parse_reply(raw, 0, shape, count) == (want, len(raw))
        for cut in range(len(raw)):
            assert P.parse_reply(raw[:cut], 0, shape, count) is None
    assert P.parse_reply(b"", 0, R.NONE) == (None, 0)


def test_random_garbage_never_crashes_the_parser() -> None:
    rng = random.Random(1)
    lim = P.Limits(max_key_bytes=64, max_value_bytes=256, max_keys_per_request=8)
    for _ in range(20000):
        raw = bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 40)))
        try:
            r = P.parse_request(raw, 0, lim)
        except P.ProtocolError:
            continue
        assert r is None or (isinstance(r[0], Request) and r[1] <= len(raw))
