"""Codec for torch's TCPStore wire protocol (torch 2.13-2.15 clients) plus ftrun's extensions.

Owns: the query-type numbers, the request/reply layouts, an incremental request parser that
works on partial buffers and rejects absurd lengths, request encoders (for our clients) and
reply encoders/parsers. It does no I/O.

Wire format (native little-endian, as torch's C++ client writes it):

- A request is `u8 query type` followed by its arguments. A key or value is `u64 length` +
  bytes; a list is `u64 count` + items. Torch clients prefix every key with "/".
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
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

VALIDATION_MAGIC = 0x3C85F7CE
MUX_MAGIC = 0x46544D58


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


OP_NAMES = {v: k for k, v in vars(Op).items() if not k.startswith("_")}

READY = 0
NOT_READY = 1
STOP_WAITING = 0
WAIT_CANCELED = 1

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_U32_unpack = _U32.unpack_from
_U64_unpack = _U64.unpack_from
_I64_unpack = _I64.unpack_from
_U64_pack = _U64.pack


class ProtocolError(ValueError):
    """A peer sent bytes that are not a valid request/reply, or that exceed a limit."""


@dataclass(frozen=True)
class Limits:
    """Largest accepted sizes; anything larger is a ProtocolError (the connection closes)."""

    max_key_bytes: int = 32 * 1024
    max_value_bytes: int = 32 * 1024 * 1024
    max_keys_per_request: int = 128 * 1024

    def __post_init__(self) -> None:
        for name in ("max_key_bytes", "max_value_bytes", "max_keys_per_request"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Limits.{name}={v!r}: must be a positive integer")


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


# ---------------------------------------------------------------- incremental request parser


def parse_request(
    buf: bytes | bytearray | memoryview, pos: int, limits: Limits = DEFAULT_LIMITS,
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


def _parse(buf, pos: int, n: int, limits: Limits) -> tuple[Request, int] | None:
    if pos >= n:
        return None
    op = buf[pos]
    p = pos + 1
    if op == Op.SET or op == Op.APPEND or op == Op.QUEUE_PUSH:
        r = _key(buf, p, n, limits)
        if r is None:
            return None
        k, p = r
        r = _val(buf, p, n, limits)
        if r is None:
            return None
        return Request(op, (k,), (r[0],)), r[1]
    if op == Op.GET or op == Op.DELETE_KEY or op == Op.QUEUE_POP or op == Op.QUEUE_LEN:
        r = _key(buf, p, n, limits)
        if r is None:
            return None
        return Request(op, (r[0],)), r[1]
    if op == Op.WAIT or op == Op.CHECK or op == Op.MULTI_GET:
        r = _keylist(buf, p, n, limits)
        if r is None:
            return None
        return Request(op, r[0]), r[1]
    if op == Op.ADD or op == Op.BARRIER:
        r = _key(buf, p, n, limits)
        if r is None:
            return None
        k, p = r
        if p + 8 > n:
            return None
        return Request(op, (k,), (), _I64_unpack(buf, p)[0]), p + 8
    if op == Op.COMPARE_SET:
        r = _key(buf, p, n, limits)
        if r is None:
            return None
        k, p = r
        r = _val(buf, p, n, limits)
        if r is None:
            return None
        exp, p = r
        r = _val(buf, p, n, limits)
        if r is None:
            return None
        return Request(op, (k,), (exp, r[0])), r[1]
    if op == Op.MULTI_SET:
        if p + 8 > n:
            return None
        cnt = _U64_unpack(buf, p)[0]
        if cnt > limits.max_keys_per_request:
            raise ProtocolError(
                f"MULTI_SET with {cnt} keys: at most {limits.max_keys_per_request} allowed")
        p += 8
        keys = []
        vals = []
        for _ in range(cnt):
            r = _key(buf, p, n, limits)
            if r is None:
                return None
            keys.append(r[0])
            r = _val(buf, r[1], n, limits)
            if r is None:
                return None
            vals.append(r[0])
            p = r[1]
        return Request(op, tuple(keys), tuple(vals)), p
    if op == Op.VALIDATE or op == Op.PING or op == Op.FT_MUX:
        if p + 4 > n:
            return None
        return Request(op, (), (), _U32_unpack(buf, p)[0]), p + 4
    if op == Op.GETNUMKEYS or op == Op.CANCEL_WAIT or op == Op.LIST_KEYS:
        return Request(op), p
    raise ProtocolError(f"unknown query type {op}: allowed 0-18 (torch TCPStore) and 240 (ftrun)")


def _blob(buf, p: int, n: int, most: int, what: str):
    """A u64-length-prefixed byte string at p: (bytes, end), None when incomplete."""
    if p + 8 > n:
        return None
    ln = _U64_unpack(buf, p)[0]
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


def _keylist(buf, p: int, n: int, limits: Limits):
    if p + 8 > n:
        return None
    cnt = _U64_unpack(buf, p)[0]
    if cnt > limits.max_keys_per_request:
        raise ProtocolError(
            f"request with {cnt} keys: at most {limits.max_keys_per_request} allowed")
    p += 8
    keys = []
    for _ in range(cnt):
        r = _key(buf, p, n, limits)
        if r is None:
            return None
        keys.append(r[0])
        p = r[1]
    return tuple(keys), p


# ---------------------------------------------------------------- request encoders


def _b(x: bytes) -> bytes:
    return _U64_pack(len(x)) + x


def encode_request(req: Request) -> bytes:
    """Encode a request exactly as torch's C++ client would (for our clients and tests)."""
    op = req.op
    head = bytes((op,))
    if op in (Op.SET, Op.APPEND, Op.QUEUE_PUSH):
        return head + _b(req.keys[0]) + _b(req.values[0])
    if op in (Op.GET, Op.DELETE_KEY, Op.QUEUE_POP, Op.QUEUE_LEN):
        return head + _b(req.keys[0])
    if op in (Op.WAIT, Op.CHECK, Op.MULTI_GET):
        return head + _U64_pack(len(req.keys)) + b"".join(_b(k) for k in req.keys)
    if op in (Op.ADD, Op.BARRIER):
        return head + _b(req.keys[0]) + _I64.pack(req.num)
    if op == Op.COMPARE_SET:
        return head + _b(req.keys[0]) + _b(req.values[0]) + _b(req.values[1])
    if op == Op.MULTI_SET:
        if len(req.keys) != len(req.values):
            raise ValueError(f"MULTI_SET with {len(req.keys)} keys and {len(req.values)} values")
        return head + _U64_pack(len(req.keys)) + b"".join(
            _b(k) + _b(v) for k, v in zip(req.keys, req.values))
    if op in (Op.VALIDATE, Op.PING, Op.FT_MUX):
        return head + _U32.pack(req.num & 0xFFFFFFFF)
    if op in (Op.GETNUMKEYS, Op.CANCEL_WAIT, Op.LIST_KEYS):
        return head
    raise ValueError(f"cannot encode query type {op!r}")


def encode_mux_request(tag: int, req: Request) -> bytes:
    """`u32 tag` + request; a mux CANCEL_WAIT carries its target tag in `req.num`."""
    if req.op == Op.CANCEL_WAIT:
        return _U32.pack(tag) + bytes((Op.CANCEL_WAIT,)) + _U32.pack(req.num)
    return _U32.pack(tag) + encode_request(req)


def handshake_bytes(nonce: int) -> bytes:
    """What torch's client sends on connect: VALIDATE then PING(nonce)."""
    return (bytes((Op.VALIDATE,)) + _U32.pack(VALIDATION_MAGIC)
            + bytes((Op.PING,)) + _U32.pack(nonce & 0xFFFFFFFF))


# ---------------------------------------------------------------- reply encoders (server side)


def enc_u8(v: int) -> bytes:
    return bytes((v,))


def enc_u32(v: int) -> bytes:
    return _U32.pack(v & 0xFFFFFFFF)


def enc_i64(v: int) -> bytes:
    return _I64.pack(v)


def enc_bytes(v: bytes) -> bytes:
    return _U64_pack(len(v)) + v


def enc_bytes_list(vals) -> bytes:
    return b"".join(_U64_pack(len(v)) + v for v in vals)


def enc_key_list(keys) -> bytes:
    return _I64.pack(len(keys)) + enc_bytes_list(keys)


def enc_queue_pop(size_before: int, value: bytes | None) -> bytes:
    if value is None:
        return _I64.pack(0)
    return _I64.pack(size_before) + enc_bytes(value)


def enc_tag(tag: int) -> bytes:
    return _U32.pack(tag)


# ---------------------------------------------------------------- reply parsers (client side)


class Reply:
    """Reply shapes, keyed by what the request's op expects."""

    NONE = 0
    U8 = 1
    U32 = 2
    I64 = 3
    BYTES = 4
    MULTI = 5
    QUEUE_POP = 6
    KEY_LIST = 7


REPLY_OF = {
    Op.VALIDATE: Reply.NONE, Op.SET: Reply.NONE, Op.APPEND: Reply.NONE,
    Op.MULTI_SET: Reply.NONE, Op.QUEUE_PUSH: Reply.NONE,
    Op.COMPARE_SET: Reply.BYTES, Op.GET: Reply.BYTES,
    Op.ADD: Reply.I64, Op.GETNUMKEYS: Reply.I64, Op.DELETE_KEY: Reply.I64,
    Op.QUEUE_LEN: Reply.I64,
    Op.CHECK: Reply.U8, Op.WAIT: Reply.U8, Op.CANCEL_WAIT: Reply.U8, Op.BARRIER: Reply.U8,
    Op.PING: Reply.U32, Op.FT_MUX: Reply.U32,
    Op.MULTI_GET: Reply.MULTI, Op.QUEUE_POP: Reply.QUEUE_POP, Op.LIST_KEYS: Reply.KEY_LIST,
}

_MAX_REPLY_VALUE = 1 << 32
_MAX_REPLY_ITEMS = 1 << 24


def parse_reply(buf: bytes | bytearray | memoryview, pos: int, shape: int, count: int = 0):
    """Decode one reply of `shape` at `buf[pos]`; (value, end) or None when incomplete.

    MULTI needs `count` (the number of keys asked for) and returns a list of bytes;
    QUEUE_POP returns bytes or None (queue empty); KEY_LIST returns a list of bytes."""
    n = len(buf)
    if shape == Reply.NONE:
        return None, pos
    if shape == Reply.U8:
        return (buf[pos], pos + 1) if pos < n else None
    if shape == Reply.U32:
        return (_U32_unpack(buf, pos)[0], pos + 4) if pos + 4 <= n else None
    if shape == Reply.I64:
        return (_I64_unpack(buf, pos)[0], pos + 8) if pos + 8 <= n else None
    if shape == Reply.BYTES:
        return _reply_bytes(buf, pos, n)
    if shape == Reply.MULTI:
        out = []
        for _ in range(count):
            r = _reply_bytes(buf, pos, n)
            if r is None:
                return None
            out.append(r[0])
            pos = r[1]
        return out, pos
    if shape == Reply.QUEUE_POP:
        if pos + 8 > n:
            return None
        size = _I64_unpack(buf, pos)[0]
        if size <= 0:
            return (None, pos + 8)  # the queue was empty
        r = _reply_bytes(buf, pos + 8, n)
        return r
    if shape == Reply.KEY_LIST:
        if pos + 8 > n:
            return None
        cnt = _I64_unpack(buf, pos)[0]
        if cnt < 0 or cnt > _MAX_REPLY_ITEMS:
            raise ProtocolError(f"LIST_KEYS reply claims {cnt} keys")
        pos += 8
        out = []
        for _ in range(cnt):
            r = _reply_bytes(buf, pos, n)
            if r is None:
                return None
            out.append(r[0])
            pos = r[1]
        return out, pos
    raise ValueError(f"unknown reply shape {shape!r}")


def _reply_bytes(buf, pos: int, n: int):
    if pos + 8 > n:
        return None
    ln = _U64_unpack(buf, pos)[0]
    if ln > _MAX_REPLY_VALUE:
        raise ProtocolError(f"reply claims a value of {ln} bytes")
    s = pos + 8
    e = s + ln
    if e > n:
        return None
    return bytes(buf[s:e]), e
