"""Codec for torch's TCPStore wire protocol (torch 2.13-2.15 clients) plus ftrun's extensions.

Owns: the query-type numbers and one table (`SPECS`) that gives each query type its name,
request layout, reply shape and kind; the size and connection `Limits`; an incremental request
parser that works on partial buffers and rejects absurd lengths (`parse_request`, plus
`parse_common`, a shortcut for the frames that dominate a rendezvous that must always agree
with it); request encoders (for our clients and tests); reply encoders (`encode_reply`) and
parsers (`parse_reply`), both driven by the reply shape; and the one mapping between wire keys
and logical keys (`wire_key`, `logical_key`). It does no I/O.

Wire format (native little-endian, as torch's C++ client writes it):

- A request is `u8 query type` followed by its arguments. A key or value is `u64 length` +
  bytes; a list is `u64 count` + items.
- Keys: torch clients prefix every user key with "/" (`TCPStore.set("a")` sends "/a"). The one
  key seen without it (torch 2.13, every op and a process-group init recorded) is the worker
  counter "init/" that a client given a world size increments on connect; torch's own
  LIST_KEYS hides such keys.
  Logical keys (what `KVStore` users pass) map to wire keys as "x" <-> "/x"; a wire key without
  the "/" maps to the logical key "ftrun/wire/<key>", so a KVStore upstream (etcd) can hold it
  and every view of one table (torch client, LocalKV, StoreClient, the proxy) names it alike.
  The logical namespace "ftrun/wire/" is therefore reserved.
- Replies carry no type; the reader knows what it asked for.

| code | op          | request args                 | reply                                  |
|------|-------------|------------------------------|----------------------------------------|
| 0    | VALIDATE    | u32 magic 0x3C85F7CE         | none (must be the first message)       |
| 1    | SET         | key, value                   | none                                   |
| 2    | COMPARE_SET | key, expected, desired       | value                                  |
| 3    | GET         | key                          | value (b"" when missing)               |
| 4    | ADD         | key, i64                     | i64 new value                          |
| 5    | CHECK       | n, keys                      | u8 0 READY / 1 NOT_READY               |
| 6    | WAIT        | n, keys                      | u8 0 STOP_WAITING (when all exist)     |
| 7    | GETNUMKEYS  | -                            | i64                                    |
| 8    | DELETE_KEY  | key                          | i64 number deleted                     |
| 9    | APPEND      | key, value                   | none                                   |
| 10   | MULTI_GET   | n, keys                      | n values                               |
| 11   | MULTI_SET   | n, (key, value)*             | none                                   |
| 12   | CANCEL_WAIT | -                            | u8 1 WAIT_CANCELED                     |
| 13   | PING        | u32 nonce                    | u32 nonce                              |
| 14   | QUEUE_PUSH  | key, value                   | none                                   |
| 15   | QUEUE_POP   | key                          | i64 length-before-pop [+ value if > 0] |
| 16   | QUEUE_LEN   | key                          | i64                                    |
| 17   | LIST_KEYS   | -                            | i64 n, n keys                          |
| 18   | BARRIER     | key, i64 world_size          | u8 0 when the counter >= world_size    |

Verified byte-for-byte against the torch 2.13 C++ client (a recording relay between it and
torch's own libuv server): the client sends VALIDATE and PING back to back on connect, sends
WAIT before every GET / MULTI_GET / blocking QUEUE_POP, and on a wait timeout sends
CANCEL_WAIT and reads one byte. BARRIER increments the counter `key` and answers once its
value reaches world_size (the counter is cumulative across calls).

ftrun extension (only ftrun's server answers it; torch never sends it):

| 0xF0 | FT_MUX | u32 magic 0x46544D58 ("FTMX") | u32 same magic |

After FT_MUX a connection is *multiplexed*: every request is `u32 tag` + request and every
reply is `u32 tag` + reply, in any order. Many WAITs may be pending at once, each under its
own tag; CANCEL_WAIT then carries `u32 target tag` and cancels only that wait. The proxy's and
the pipelined client's upstream links use it.

| 0xF1 | FT_WAIT_VALUES | n, keys | u8 0 STOP_WAITING + n values (when all exist) |

A WAIT whose wake-up carries the values (one round trip where torch's client needs WAIT then
GET): a plan fanned out to N waiting agents costs N replies, not 2N requests and replies. It
is withdrawn with CANCEL_WAIT like a WAIT (the client reads STOP_WAITING + values or
WAIT_CANCELED; a wait satisfied just before the cancel: STOP_WAITING + values, then
WAIT_CANCELED). A client learns that a server answers it from the handshake: a PING whose
nonce is `CAPS_NONCE` is answered by ftrun's server with `CAPS_NONCE ^ caps` (bit
`CAP_WAIT_VALUES`), by torch's server and by the node proxy (which does not offer it) with the
nonce itself. torch's clients ping with their process id (< 2**22), never this nonce.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple

VALIDATION_MAGIC = 0x3C85F7CE
MUX_MAGIC = 0x46544D58
CAPS_NONCE = 0x46544350  # "FTCP": a PING that asks the server for its extensions
CAP_WAIT_VALUES = 0x1  # the server answers FT_WAIT_VALUES


class Op:
    """Query type codes (torch's `QueryType` enum order, plus ftrun extensions)."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17
    BARRIER = 18
    FT_MUX = 0xF0
    FT_WAIT_VALUES = 0xF1


READ_SIZE = 64 * 1024  # bytes one recv() asks for (server, proxy, clients)

READY = 0
NOT_READY = 1
STOP_WAITING = 0
WAIT_CANCELED = 1
STOP_WAITING_REPLY = bytes((STOP_WAITING,))  # the one byte that releases a WAIT / BARRIER
WAIT_CANCELED_REPLY = bytes((WAIT_CANCELED,))

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_U32_unpack = _U32.unpack_from
# The frame's integers (little-endian), public for the server's in-place fast path:
unpack_u64 = _U64.unpack_from  # (buf, offset) -> (value,)
unpack_i64 = _I64.unpack_from
pack_u64 = _U64.pack
pack_i64 = _I64.pack


class ProtocolError(ValueError):
    """A peer sent bytes that are not a valid request/reply, or that exceed a limit."""


@dataclass(frozen=True)
class Limits:
    """What one peer may use. Sizes (`max_key_bytes`, `max_value_bytes`,
    `max_keys_per_request`) are checked by the parser: a larger frame is a ProtocolError. The
    rest are enforced by the server's event loop. Exceeding any closes that connection."""

    max_key_bytes: int = 32 * 1024
    max_value_bytes: int = 32 * 1024 * 1024
    max_keys_per_request: int = 128 * 1024
    max_connections: int = 16384
    max_pending_reply_bytes: int = 256 * 1024 * 1024
    handshake_timeout: float = 30.0
    stalled_frame_timeout: float = 60.0

    def __post_init__(self) -> None:
        for name in (
            "max_key_bytes",
            "max_value_bytes",
            "max_keys_per_request",
            "max_connections",
            "max_pending_reply_bytes",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Limits.{name}={v!r}: must be a positive integer")
        for name in ("handshake_timeout", "stalled_frame_timeout"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"Limits.{name}={v!r}: must be seconds > 0")


DEFAULT_LIMITS = Limits()


class Request(NamedTuple):
    """One decoded request. Field use per op: see the module table.

    keys: the key arguments; values: the value arguments (COMPARE_SET: expected, desired);
    num: VALIDATE/PING/FT_MUX magic or nonce, ADD delta, BARRIER world size, mux
    CANCEL_WAIT target tag."""

    op: int
    keys: tuple = ()
    values: tuple = ()
    num: int = 0


# ---------------------------------------------------------------- the query table


class Args:
    """Request argument layouts (after the op byte)."""

    NONE = 0
    U32 = 1  # u32 magic or nonce -> num
    KEY = 2
    KEY_VALUE = 3
    KEY_I64 = 4  # key, i64 -> num
    KEY_2VALUES = 5  # key, expected, desired
    KEYS = 6  # u64 n, n keys
    PAIRS = 7  # u64 n, n (key, value)


class Reply:
    """Reply shapes, and the Python value each stands for (`encode_reply`/`parse_reply`)."""

    NONE = 0  # no reply; None
    U8 = 1  # int 0-255
    U32 = 2  # int
    I64 = 3  # int
    BYTES = 4  # bytes
    MULTI = 5  # list of bytes (as many as keys were asked for)
    QUEUE_POP = 6  # (queue length before the pop, value), (0, None) when it was empty
    KEY_LIST = 7  # list of wire keys
    WAIT_VALUES = 8  # u8 STOP_WAITING + as many values as keys; a list of bytes


class Kind:
    """What an op is about; every component dispatches on it, so it is decided here once."""

    SESSION = "session"  # VALIDATE, PING, FT_MUX: answered by whoever holds the connection
    DATA = "data"  # reads/writes of the table (rendezvous.store.memory.apply runs them)
    BLOCKING = "blocking"  # WAIT, BARRIER: answered once a condition holds
    CANCEL = "cancel"  # CANCEL_WAIT: withdraws the connection's pending WAIT


class OpSpec(NamedTuple):
    op: int
    name: str
    args: int
    reply: int
    kind: str


SPECS: dict[int, OpSpec] = {
    s.op: s
    for s in (
        OpSpec(Op.VALIDATE, "VALIDATE", Args.U32, Reply.NONE, Kind.SESSION),
        OpSpec(Op.SET, "SET", Args.KEY_VALUE, Reply.NONE, Kind.DATA),
        OpSpec(Op.COMPARE_SET, "COMPARE_SET", Args.KEY_2VALUES, Reply.BYTES, Kind.DATA),
        OpSpec(Op.GET, "GET", Args.KEY, Reply.BYTES, Kind.DATA),
        OpSpec(Op.ADD, "ADD", Args.KEY_I64, Reply.I64, Kind.DATA),
        OpSpec(Op.CHECK, "CHECK", Args.KEYS, Reply.U8, Kind.DATA),
        OpSpec(Op.WAIT, "WAIT", Args.KEYS, Reply.U8, Kind.BLOCKING),
        OpSpec(Op.GETNUMKEYS, "GETNUMKEYS", Args.NONE, Reply.I64, Kind.DATA),
        OpSpec(Op.DELETE_KEY, "DELETE_KEY", Args.KEY, Reply.I64, Kind.DATA),
        OpSpec(Op.APPEND, "APPEND", Args.KEY_VALUE, Reply.NONE, Kind.DATA),
        OpSpec(Op.MULTI_GET, "MULTI_GET", Args.KEYS, Reply.MULTI, Kind.DATA),
        OpSpec(Op.MULTI_SET, "MULTI_SET", Args.PAIRS, Reply.NONE, Kind.DATA),
        OpSpec(Op.CANCEL_WAIT, "CANCEL_WAIT", Args.NONE, Reply.U8, Kind.CANCEL),
        OpSpec(Op.PING, "PING", Args.U32, Reply.U32, Kind.SESSION),
        OpSpec(Op.QUEUE_PUSH, "QUEUE_PUSH", Args.KEY_VALUE, Reply.NONE, Kind.DATA),
        OpSpec(Op.QUEUE_POP, "QUEUE_POP", Args.KEY, Reply.QUEUE_POP, Kind.DATA),
        OpSpec(Op.QUEUE_LEN, "QUEUE_LEN", Args.KEY, Reply.I64, Kind.DATA),
        OpSpec(Op.LIST_KEYS, "LIST_KEYS", Args.NONE, Reply.KEY_LIST, Kind.DATA),
        OpSpec(Op.BARRIER, "BARRIER", Args.KEY_I64, Reply.U8, Kind.BLOCKING),
        OpSpec(Op.FT_MUX, "FT_MUX", Args.U32, Reply.U32, Kind.SESSION),
        OpSpec(Op.FT_WAIT_VALUES, "FT_WAIT_VALUES", Args.KEYS, Reply.WAIT_VALUES, Kind.BLOCKING),
    )
}

OP_NAMES = {op: s.name for op, s in SPECS.items()}
REPLY_OF = {op: s.reply for op, s in SPECS.items()}
KIND_OF = {op: s.kind for op, s in SPECS.items()}
# Writes the caller gets no answer to (VALIDATE, the other no-reply op, is a handshake).
NO_REPLY = frozenset(op for op, s in SPECS.items() if s.reply == Reply.NONE and s.kind == Kind.DATA)


def op_name(op: int) -> str:
    return OP_NAMES.get(op, str(op))


# ---------------------------------------------------------------- incremental request parser


def parse_request(
    buf: bytes | bytearray | memoryview,
    pos: int,
    limits: Limits = DEFAULT_LIMITS,
    mux: bool = False,
) -> tuple[Request, int] | None:
    """Decode one request starting at `buf[pos]`.

    Returns (request, end offset), or None when the buffer holds only part of a request.
    Raises ProtocolError for an unknown op or a length over `limits` (checked as soon as the
    length field arrives, before waiting for the bytes). In mux mode the request is preceded
    by a u32 tag, returned as `num` for CANCEL_WAIT and otherwise dropped: use
    `parse_mux_request` to get it."""
    if mux:
        r = parse_mux_request(buf, pos, limits)
        return None if r is None else (r[1], r[2])
    return _parse(buf, pos, len(buf), limits)


def parse_mux_request(
    buf: bytes | bytearray | memoryview, pos: int, limits: Limits = DEFAULT_LIMITS
) -> tuple[int, Request, int] | None:
    """Decode `u32 tag` + request (+ `u32 target` for CANCEL_WAIT); (tag, request, end)."""
    n = len(buf)
    if pos + 5 > n:
        return None
    tag = _U32_unpack(buf, pos)[0]
    if buf[pos + 4] == Op.CANCEL_WAIT:
        if pos + 9 > n:
            return None
        return tag, Request(Op.CANCEL_WAIT, num=_U32_unpack(buf, pos + 5)[0]), pos + 9
    r = _parse(buf, pos + 4, n, limits)
    if r is None:
        return None
    return tag, r[0], r[1]


def parse_common(
    buf: bytes | bytearray | memoryview, pos: int, limits: Limits = DEFAULT_LIMITS
) -> tuple[Request, int] | None:
    """Shortcut decoder for the frames that dominate a rendezvous: GET, SET, ADD, and WAIT or
    CHECK of one key. For such a complete frame within `limits` it returns exactly what
    `parse_request` returns; for anything else (another op, an incomplete frame, a length over
    a limit) it returns None and `parse_request` decides (None or ProtocolError)."""
    n = len(buf)
    if pos + 9 > n:
        return None
    op = buf[pos]
    if op == Op.WAIT or op == Op.CHECK:
        if pos + 17 > n or unpack_u64(buf, pos + 1)[0] != 1:
            return None
        s = pos + 17
    elif op == Op.GET or op == Op.SET or op == Op.ADD:
        s = pos + 9
    else:
        return None
    kl = unpack_u64(buf, s - 8)[0]
    e = s + kl
    if kl > limits.max_key_bytes or e > n:
        return None
    key = (bytes(buf[s:e]),)
    if op == Op.SET:
        if e + 8 > n:
            return None
        vl = unpack_u64(buf, e)[0]
        ve = e + 8 + vl
        if vl > limits.max_value_bytes or ve > n:
            return None
        return Request(op, key, (bytes(buf[e + 8 : ve]),)), ve
    if op == Op.ADD:
        if e + 8 > n:
            return None
        return Request(op, key, (), unpack_i64(buf, e)[0]), e + 8
    return Request(op, key), e


def _parse(buf, pos: int, n: int, limits: Limits) -> tuple[Request, int] | None:
    if pos >= n:
        return None
    op = buf[pos]
    decode = _DECODERS[op]
    if decode is None:
        raise ProtocolError(
            f"unknown query type {op}: allowed 0-18 (torch TCPStore) and 240 (ftrun)"
        )
    return decode(buf, op, pos + 1, n, limits)


def _blob(buf, p: int, n: int, most: int, what: str):
    """A u64-length-prefixed byte string at p: (bytes, end), None when incomplete."""
    if p + 8 > n:
        return None
    ln = unpack_u64(buf, p)[0]
    if ln > most:
        raise ProtocolError(f"{what} of {ln} bytes: at most {most} allowed")
    p += 8
    e = p + ln
    if e > n:
        return None
    return bytes(buf[p:e]), e


def _key(buf, p: int, n: int, limits: Limits):
    return _blob(buf, p, n, limits.max_key_bytes, "key")


def _val(buf, p: int, n: int, limits: Limits):
    return _blob(buf, p, n, limits.max_value_bytes, "value")


def _count(buf, p: int, n: int, limits: Limits, what: str) -> int | None:
    if p + 8 > n:
        return None
    cnt = unpack_u64(buf, p)[0]
    if cnt > limits.max_keys_per_request:
        raise ProtocolError(
            f"{what} with {cnt} keys: at most {limits.max_keys_per_request} allowed"
        )
    return cnt


def _args_none(buf, op: int, p: int, n: int, limits: Limits):
    return Request(op), p


def _args_u32(buf, op: int, p: int, n: int, limits: Limits):
    if p + 4 > n:
        return None
    return Request(op, (), (), _U32_unpack(buf, p)[0]), p + 4


def _args_key(buf, op: int, p: int, n: int, limits: Limits):
    r = _key(buf, p, n, limits)
    return None if r is None else (Request(op, (r[0],)), r[1])


def _args_key_i64(buf, op: int, p: int, n: int, limits: Limits):
    r = _key(buf, p, n, limits)
    if r is None or r[1] + 8 > n:
        return None
    return Request(op, (r[0],), (), unpack_i64(buf, r[1])[0]), r[1] + 8


def _blobs(buf, p: int, n: int, arg, count: int, read: Callable):
    """`count` items read by `read(buf, p, n, arg)` one after another: (list, end) or None."""
    out = []
    for _ in range(count):
        r = read(buf, p, n, arg)
        if r is None:
            return None
        out.append(r[0])
        p = r[1]
    return out, p


def _args_key_values(buf, op: int, p: int, n: int, limits: Limits, count: int):
    r = _key(buf, p, n, limits)
    if r is None:
        return None
    vals = _blobs(buf, r[1], n, limits, count, _val)
    return None if vals is None else (Request(op, (r[0],), tuple(vals[0])), vals[1])


def _args_keys(buf, op: int, p: int, n: int, limits: Limits):
    cnt = _count(buf, p, n, limits, "request")
    if cnt is None:
        return None
    keys = _blobs(buf, p + 8, n, limits, cnt, _key)
    return None if keys is None else (Request(op, tuple(keys[0])), keys[1])


def _args_pairs(buf, op: int, p: int, n: int, limits: Limits):
    cnt = _count(buf, p, n, limits, OP_NAMES[op])
    if cnt is None:
        return None
    p += 8
    keys = []
    vals = []
    for _ in range(cnt):
        r = _args_key_values(buf, op, p, n, limits, 1)
        if r is None:
            return None
        keys.append(r[0].keys[0])
        vals.append(r[0].values[0])
        p = r[1]
    return Request(op, tuple(keys), tuple(vals)), p


_ARG_DECODERS: dict[int, Callable] = {
    Args.NONE: _args_none,
    Args.U32: _args_u32,
    Args.KEY: _args_key,
    Args.KEY_VALUE: lambda buf, op, p, n, lim: _args_key_values(buf, op, p, n, lim, 1),
    Args.KEY_I64: _args_key_i64,
    Args.KEY_2VALUES: lambda buf, op, p, n, lim: _args_key_values(buf, op, p, n, lim, 2),
    Args.KEYS: _args_keys,
    Args.PAIRS: _args_pairs,
}
_DECODERS: list = [None] * 256
for _s in SPECS.values():
    _DECODERS[_s.op] = _ARG_DECODERS[_s.args]
del _s


# ---------------------------------------------------------------- request encoders


def _b(x: bytes) -> bytes:
    return pack_u64(len(x)) + x


def _enc_keys(keys: tuple[bytes, ...]) -> bytes:
    """A count, then each key length-prefixed (CHECK, WAIT, MULTI_GET of thousands of keys:
    one struct call for every length)."""
    lengths = struct.pack(f"<{len(keys) + 1}Q", len(keys), *map(len, keys))
    parts = [lengths[:8]]
    for i, k in enumerate(keys, 1):
        parts.append(lengths[8 * i : 8 * i + 8])
        parts.append(k)
    return b"".join(parts)


def _enc_pairs(req: Request) -> bytes:
    if len(req.keys) != len(req.values):
        raise ValueError(f"MULTI_SET with {len(req.keys)} keys and {len(req.values)} values")
    return pack_u64(len(req.keys)) + b"".join(_b(k) + _b(v) for k, v in zip(req.keys, req.values))


_ARG_ENCODERS: dict[int, Callable[[Request], bytes]] = {
    Args.NONE: lambda r: b"",
    Args.U32: lambda r: _U32.pack(r.num & 0xFFFFFFFF),
    Args.KEY: lambda r: _b(r.keys[0]),
    Args.KEY_VALUE: lambda r: _b(r.keys[0]) + _b(r.values[0]),
    Args.KEY_I64: lambda r: _b(r.keys[0]) + pack_i64(r.num),
    Args.KEY_2VALUES: lambda r: _b(r.keys[0]) + _b(r.values[0]) + _b(r.values[1]),
    Args.KEYS: lambda r: _enc_keys(r.keys),
    Args.PAIRS: _enc_pairs,
}


def encode_request(req: Request) -> bytes:
    """Encode a request exactly as torch's C++ client would (for our clients and tests)."""
    spec = SPECS.get(req.op)
    if spec is None:
        raise ValueError(f"cannot encode query type {req.op!r}")
    return bytes((req.op,)) + _ARG_ENCODERS[spec.args](req)


def encode_mux_request(tag: int, req: Request) -> bytes:
    """`u32 tag` + request; a mux CANCEL_WAIT carries its target tag in `req.num`."""
    if req.op == Op.CANCEL_WAIT:
        return _U32.pack(tag) + bytes((Op.CANCEL_WAIT,)) + _U32.pack(req.num)
    return _U32.pack(tag) + encode_request(req)


def handshake_bytes(nonce: int) -> bytes:
    """What torch's client sends on connect: VALIDATE then PING(nonce)."""
    return encode_request(Request(Op.VALIDATE, num=VALIDATION_MAGIC)) + encode_request(
        Request(Op.PING, num=nonce)
    )


# ---------------------------------------------------------------- reply encoders (server side)


def enc_u8(v: int) -> bytes:
    return bytes((v,))


def enc_u32(v: int) -> bytes:
    return _U32.pack(v & 0xFFFFFFFF)


def enc_i64(v: int) -> bytes:
    return pack_i64(v)


def enc_bytes(v: bytes) -> bytes:
    return pack_u64(len(v)) + v


def enc_bytes_list(vals: Iterable[bytes]) -> bytes:
    return b"".join(pack_u64(len(v)) + v for v in vals)


def enc_key_list(keys: list[bytes]) -> bytes:
    return pack_i64(len(keys)) + enc_bytes_list(keys)


def enc_queue_pop(size_before: int, value: bytes | None) -> bytes:
    if value is None:
        return pack_i64(0)
    return pack_i64(size_before) + enc_bytes(value)


def enc_wait_values(values: list[bytes]) -> bytes:
    """FT_WAIT_VALUES's answer: STOP_WAITING, then the values (b"" for a missing key)."""
    return STOP_WAITING_REPLY + enc_bytes_list(values)


def enc_tag(tag: int) -> bytes:
    return _U32.pack(tag)


_REPLY_ENCODERS: dict[int, Callable] = {
    Reply.NONE: lambda v: b"",
    Reply.U8: enc_u8,
    Reply.U32: enc_u32,
    Reply.I64: enc_i64,
    Reply.BYTES: enc_bytes,
    Reply.MULTI: enc_bytes_list,
    Reply.QUEUE_POP: lambda v: enc_queue_pop(v[0], v[1]),
    Reply.KEY_LIST: enc_key_list,
    Reply.WAIT_VALUES: enc_wait_values,
}
_ENCODER_OF = {op: _REPLY_ENCODERS[s.reply] for op, s in SPECS.items()}


def encode_reply(op: int, value) -> bytes:
    """The reply to a request of `op` that stands for `value` (see `Reply` for the types)."""
    return _ENCODER_OF[op](value)


# ---------------------------------------------------------------- reply parsers (client side)

_MAX_REPLY_VALUE = 1 << 32
_MAX_REPLY_ITEMS = 1 << 24


def parse_reply(buf: bytes | bytearray | memoryview, pos: int, shape: int, count: int = 0):
    """Decode one reply of `shape` at `buf[pos]`; (value, end) or None when incomplete.

    MULTI needs `count` (the number of keys asked for); the values are those of `Reply`."""
    parse = _REPLY_PARSERS.get(shape)
    if parse is None:
        raise ValueError(f"unknown reply shape {shape!r}")
    return parse(buf, pos, len(buf), count)


def _fixed(unpack, size: int):
    def parse(buf, pos: int, n: int, count: int):
        return (unpack(buf, pos)[0], pos + size) if pos + size <= n else None

    return parse


def _reply_bytes(buf, pos: int, n: int, count: int = 0):
    if pos + 8 > n:
        return None
    ln = unpack_u64(buf, pos)[0]
    if ln > _MAX_REPLY_VALUE:
        raise ProtocolError(f"reply claims a value of {ln} bytes")
    s = pos + 8
    e = s + ln
    if e > n:
        return None
    return bytes(buf[s:e]), e


def _reply_list(buf, pos: int, n: int, count: int):
    """`count` length-prefixed values (MULTI_GET: one per key, thousands at a time), read in
    one loop: (list, end) or None when the buffer ends first."""
    empty = count * 8  # a run of empty values (missing keys) is `count` zero lengths
    if pos + empty <= n and buf[pos : pos + empty] == bytes(empty):
        return [b""] * count, pos + empty
    out: list[bytes] = []
    append, unpack = out.append, unpack_u64
    for _ in range(count):
        if pos + 8 > n:
            return None
        ln = unpack(buf, pos)[0]
        if ln > _MAX_REPLY_VALUE:
            raise ProtocolError(f"reply claims a value of {ln} bytes")
        start, pos = pos + 8, pos + 8 + ln
        if pos > n:
            return None
        append(bytes(buf[start:pos]))
    return out, pos


def _reply_queue_pop(buf, pos: int, n: int, count: int):
    if pos + 8 > n:
        return None
    size = unpack_i64(buf, pos)[0]
    if size <= 0:
        return (0, None), pos + 8  # the queue was empty
    r = _reply_bytes(buf, pos + 8, n)
    return None if r is None else ((size, r[0]), r[1])


def _reply_key_list(buf, pos: int, n: int, count: int):
    if pos + 8 > n:
        return None
    cnt = unpack_i64(buf, pos)[0]
    if cnt < 0 or cnt > _MAX_REPLY_ITEMS:
        raise ProtocolError(f"LIST_KEYS reply claims {cnt} keys")
    return _reply_list(buf, pos + 8, n, cnt)


def _reply_wait_values(buf, pos: int, n: int, count: int):
    """STOP_WAITING + `count` values; ProtocolError for any other first byte."""
    if pos >= n:
        return None
    if buf[pos] != STOP_WAITING:
        raise ProtocolError(f"FT_WAIT_VALUES reply starts with {buf[pos]}, not STOP_WAITING")
    return _reply_list(buf, pos + 1, n, count)


_REPLY_PARSERS: dict[int, Callable] = {
    Reply.NONE: lambda buf, pos, n, count: (None, pos),
    Reply.U8: lambda buf, pos, n, count: (buf[pos], pos + 1) if pos < n else None,
    Reply.U32: _fixed(_U32_unpack, 4),
    Reply.I64: _fixed(unpack_i64, 8),
    Reply.BYTES: _reply_bytes,
    Reply.MULTI: _reply_list,
    Reply.QUEUE_POP: _reply_queue_pop,
    Reply.KEY_LIST: _reply_key_list,
    Reply.WAIT_VALUES: _reply_wait_values,
}


# ---------------------------------------------------------------- wire <-> logical keys

RAW_KEY_PREFIX = "ftrun/wire/"


def wire_key(key: str) -> bytes:
    """Logical key -> wire key: "x" -> b"/x"; "ftrun/wire/x" -> b"x" (see the module doc)."""
    if not isinstance(key, str):
        raise TypeError(f"store key {key!r}: must be str")
    if key.startswith(RAW_KEY_PREFIX):
        return key[len(RAW_KEY_PREFIX) :].encode("utf-8", "surrogateescape")
    return b"/" + key.encode("utf-8", "surrogateescape")


def logical_key(wire: bytes) -> str:
    """Wire key -> logical key: b"/x" -> "x"; b"x" (no "/", e.g. torch's b"init/") ->
    "ftrun/wire/x". `wire_key(logical_key(w)) == w` for every w outside b"/ftrun/wire/"."""
    if wire[:1] == b"/":
        return wire[1:].decode("utf-8", "surrogateescape")
    return RAW_KEY_PREFIX + wire.decode("utf-8", "surrogateescape")


def logical_keys(wire_keys: Iterable[bytes], prefix: str = "") -> list[str]:
    """The logical names of `wire_keys` that start with `prefix`, sorted (`KVStore.keys`)."""
    return sorted(k for k in map(logical_key, wire_keys) if k.startswith(prefix))
