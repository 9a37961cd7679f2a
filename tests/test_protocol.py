"""Wire codec: round trips, partial buffers, limits, and frames recorded from torch 2.13."""

from __future__ import annotations

import random

import pytest

from rendezvous.store import protocol as P
from rendezvous.store.protocol import Op, Request

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
    Request(Op.FT_WAIT_VALUES, (b"/a", b"/bb")),
]

# Bytes the torch 2.13 C++ client sent, recorded between it and torch's libuv server.
RECORDED = {
    "0102000000000000002f6b010000000000000076": Request(Op.SET, (b"/k",), (b"v",)),
    "06010000000000000002000000000000002f6b": Request(Op.WAIT, (b"/k",)),
    "0402000000000000002f6e0500000000000000": Request(Op.ADD, (b"/n",), (), 5),
    "0202000000000000002f6b010000000000000076010000000000000077": Request(
        Op.COMPARE_SET, (b"/k",), (b"v", b"w")
    ),
    "0c": Request(Op.CANCEL_WAIT),
    "07": Request(Op.GETNUMKEYS),
    "0b0200000000000000"  # MULTI_SET, 2 pairs
    "02000000000000002f61"  # key /a
    "010000000000000031"  # value 1
    "02000000000000002f62"  # key /b
    "010000000000000032": Request(  # value 2
        Op.MULTI_SET, (b"/a", b"/b"), (b"1", b"2")
    ),
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
    big_val = P.encode_request(Request(Op.SET, (b"/k",), (b"x",)))[:11] + (1001).to_bytes(
        8, "little"
    )
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


def test_samples_cover_every_query_type() -> None:
    assert {r.op for r in SAMPLES} == set(P.SPECS)
    assert P.OP_NAMES[Op.QUEUE_POP] == "QUEUE_POP" and P.KIND_OF[Op.WAIT] == P.Kind.BLOCKING
    assert P.NO_REPLY == {Op.SET, Op.MULTI_SET, Op.APPEND, Op.QUEUE_PUSH}


# A value of each reply shape, as `encode_reply` takes it and `parse_reply` returns it.
REPLY_VALUES = {
    P.Reply.NONE: None,
    P.Reply.U8: 1,
    P.Reply.U32: 0xDEADBEEF,
    P.Reply.I64: -(2**40),
    P.Reply.BYTES: b"\x00val",
    P.Reply.MULTI: [b"a", b"", b"ccc"],
    P.Reply.QUEUE_POP: (3, b"item"),
    P.Reply.KEY_LIST: [b"/a", b"init/"],
    P.Reply.WAIT_VALUES: [b"plan", b"", b"xyz"],
}


@pytest.mark.parametrize("op", sorted(P.SPECS), ids=lambda op: P.OP_NAMES[op])
def test_encode_reply_and_parse_reply_agree(op: int) -> None:
    shape = P.REPLY_OF[op]
    value = REPLY_VALUES[shape]
    raw = P.encode_reply(op, value)
    assert P.parse_reply(raw, 0, shape, 3) == (value, len(raw))
    for cut in range(len(raw) if shape != P.Reply.NONE else 0):
        assert P.parse_reply(raw[:cut], 0, shape, 3) is None
    if shape == P.Reply.QUEUE_POP:  # torch: i64 0 and no value when the queue was empty
        assert P.encode_reply(op, (0, None)) == P.enc_i64(0)
        assert P.parse_reply(P.enc_i64(0), 0, shape) == ((0, None), 8)


def test_wait_values_reply_starts_with_stop_waiting() -> None:
    raw = P.encode_reply(Op.FT_WAIT_VALUES, [b"v"])
    assert raw == P.STOP_WAITING_REPLY + P.pack_u64(1) + b"v"
    with pytest.raises(P.ProtocolError, match="not STOP_WAITING"):
        P.parse_reply(P.WAIT_CANCELED_REPLY + raw[1:], 0, P.Reply.WAIT_VALUES, 1)


def _random_frame(rng: random.Random, lim: P.Limits) -> bytes:
    """A frame that is valid, over a limit, truncated, or garbage; the common ops (GET, SET,
    ADD, WAIT/CHECK of one key) are most frequent, as in a rendezvous."""

    def key() -> bytes:  # now and then longer than max_key_bytes
        size = 70 if rng.random() < 0.02 else rng.choice((0, 3, 9))
        return b"/" + bytes(rng.choice(b"abk/") for _ in range(size))

    def val() -> bytes:
        return rng.randbytes(300 if rng.random() < 0.02 else rng.choice((0, 1, 30)))

    common = [
        Request(Op.GET, (key(),)),
        Request(Op.SET, (key(),), (val(),)),
        Request(Op.ADD, (key(),), (), rng.randint(-9, 9)),
        Request(
            rng.choice((Op.WAIT, Op.CHECK)),
            tuple(key() for _ in range(9 if rng.random() < 0.02 else rng.choice((1, 1, 0, 2)))),
        ),
    ]
    r = rng.random()
    if r < 0.75:
        return P.encode_request(rng.choice(common))
    if r < 0.94:
        s = rng.choice(SAMPLES)
        return P.encode_request(s._replace(keys=tuple(key() for _ in s.keys)))
    raw = P.encode_request(rng.choice(common))
    if r < 0.955:  # a length field that claims too much
        return raw[:1] + (2 ** rng.randrange(6, 64)).to_bytes(8, "little") + raw[9:]
    if r < 0.97:  # a WAIT/CHECK count field that claims too much
        return bytes((rng.choice((Op.WAIT, Op.CHECK)),)) + rng.randbytes(8)
    if r < 0.985:
        return raw[: rng.randrange(1, len(raw))]  # truncated: the next frame's bytes follow
    return rng.randbytes(rng.randrange(1, 20))


def _decode_stream(chunks: list[bytes], lim: P.Limits, common: bool):
    """Feed `chunks` to a buffer as a connection would and decode what is complete after
    each one, with `parse_common` tried first (the servers' path) or `parse_request` alone.
    Returns (requests, error message or None)."""
    buf = bytearray()
    got: list = []
    for chunk in chunks:
        buf += chunk
        pos = 0
        try:
            while True:
                r = (common and P.parse_common(buf, pos, lim)) or P.parse_request(buf, pos, lim)
                if r is None:
                    break
                got.append(r[0])
                pos = r[1]
        except P.ProtocolError as e:
            return got, str(e)
        del buf[:pos]
    return got, None


def test_common_decoder_agrees_with_the_full_parser() -> None:
    rng = random.Random(8)
    lim = P.Limits(max_key_bytes=64, max_value_bytes=256, max_keys_per_request=8)
    errors = decoded = 0
    for _ in range(3000):
        stream = b"".join(_random_frame(rng, lim) for _ in range(rng.randrange(1, 12)))
        cuts = sorted(rng.sample(range(1, len(stream)), min(len(stream) - 1, rng.randrange(0, 6))))
        chunks = [stream[a:b] for a, b in zip([0] + cuts, cuts + [len(stream)])]
        fast = _decode_stream(chunks, lim, common=True)
        assert fast == _decode_stream(chunks, lim, common=False), stream.hex()
        assert fast == _decode_stream([stream], lim, common=False), stream.hex()
        errors += fast[1] is not None
        decoded += len(fast[0])
    assert errors > 300 and decoded > 5000  # both outcomes were exercised


def test_common_decoder_returns_what_the_parser_returns() -> None:
    lim = P.Limits(max_key_bytes=8, max_value_bytes=8)
    for req in (
        Request(Op.GET, (b"/k",)),
        Request(Op.SET, (b"/k",), (b"v",)),
        Request(Op.ADD, (b"/n",), (), -3),
        Request(Op.WAIT, (b"/w",)),
        Request(Op.CHECK, (b"/c",)),
    ):
        raw = P.encode_request(req) + b"\x07"
        assert P.parse_common(raw, 0, lim) == P.parse_request(raw, 0, lim) == (req, len(raw) - 1)
        for cut in range(len(raw) - 1):
            assert P.parse_common(raw[:cut], 0, lim) is None
    # everything else, and anything over a limit, is left to the full parser
    for req in (
        Request(Op.WAIT, (b"/a", b"/b")),
        Request(Op.GET, (b"/" + b"k" * 8,)),
        Request(Op.SET, (b"/k",), (b"v" * 9,)),
        Request(Op.MULTI_GET, (b"/a",)),
    ):
        assert P.parse_common(P.encode_request(req), 0, lim) is None


def test_key_mapping_is_one_bijection_with_torch_init_key_under_ftrun_wire() -> None:
    # torch 2.13 sends user keys with "/" and its worker counter as b"init/" (recorded)
    assert P.wire_key("ftrun/plan/3") == b"/ftrun/plan/3"
    assert P.logical_key(b"/ftrun/plan/3") == "ftrun/plan/3"
    assert P.logical_key(b"init/") == "ftrun/wire/init/"
    assert P.wire_key("ftrun/wire/init/") == b"init/"
    for lk in ("", "a", "x/y", "ftrun/wire/", "ftrun/wire/raw", "ftrun/wirex", "\udcff"):
        assert P.logical_key(P.wire_key(lk)) == lk
    for wk in (b"", b"/", b"/a", b"init/", b"raw", b"\xff/x", b"/ftrun/wirex"):
        assert P.wire_key(P.logical_key(wk)) == wk
    assert P.logical_keys([b"/b", b"init/", b"/a/x", b"/c"], "a") == ["a/x"]
    assert P.logical_keys([b"/b", b"init/"]) == ["b", "ftrun/wire/init/"]
    with pytest.raises(TypeError, match="must be str"):
        P.wire_key(b"/bytes")


@pytest.mark.parametrize("kind", ["missing", "present", "mixed"])
def test_a_multi_get_of_thousands_of_keys_encodes_and_parses_as_one_by_one(kind: str) -> None:
    """CHECK/WAIT/MULTI_GET of 4096 keys (a round's per-rank reads): the request is the count
    then each key length-prefixed, the reply's values come back in order, missing keys as
    empty values, and any truncated reply reads as incomplete."""
    keys = tuple(f"/ftrun/finished/{r}".encode() for r in range(4096))
    raw = P.encode_request(Request(Op.MULTI_GET, keys))
    assert raw == bytes((Op.MULTI_GET,)) + P.pack_u64(4096) + b"".join(
        P.pack_u64(len(k)) + k for k in keys
    )
    assert P.parse_request(raw, 0) == (Request(Op.MULTI_GET, keys), len(raw))
    values = {
        "missing": [b""] * 4096,
        "present": [str(r).encode() for r in range(4096)],
        "mixed": [b"" if r % 3 else b"1" for r in range(4096)],
    }[kind]
    reply = P.enc_bytes_list(values)
    assert P.parse_reply(reply, 0, P.Reply.MULTI, 4096) == (values, len(reply))
    assert P.parse_reply(memoryview(reply), 0, P.Reply.MULTI, 4096) == (values, len(reply))
    for cut in (0, 7, 8, len(reply) // 2, len(reply) - 1):
        assert P.parse_reply(reply[:cut], 0, P.Reply.MULTI, 4096) is None
