"""The in-memory store table: data, counters, queues and the waiter registry.

Owns: `MemoryStore`, the table the embedded server serves (keyed by *wire* keys, as bytes,
exactly as torch clients send them, e.g. b"/ftrun/plan/3"), with torch TCPStore semantics for
every op; `apply`, what each data query type (`protocol.Kind.DATA`) does to a table — this
one, or any object with the same methods (the proxy's view of a `KVStore`) — and the value its
reply stands for; and `LocalKV`, the `KVStore` facade over the same table for in-process users
(the leader agent), mapping keys with `protocol.wire_key`/`logical_key`.

Waiting: `wait()` either reports the keys present or registers a `Waiter` whose `fire`
callback runs once, outside the lock, when the last missing key appears. Waiters are indexed
by key, so a SET that releases thousands of waiters costs one dict pop plus one callback each.
All methods are thread-safe (one lock; callbacks never run under it).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Iterable

from rendezvous.kv import KVStore, StoreError, StoreTimeout, check_timeout
from rendezvous.store import protocol as P


class Waiter:
    """A pending WAIT (or BARRIER): `fire()` runs once when satisfied, unless cancelled."""

    __slots__ = ("remaining", "fire", "done", "keys", "world_size")

    def __init__(self, keys: tuple, fire: Callable[[], None], world_size: int = 0) -> None:
        self.keys = keys
        self.remaining = len(keys)
        self.fire = fire
        self.done = False
        self.world_size = world_size


def _count_down(w: Waiter, fired: list) -> bool:
    """One of w's missing keys appeared; True (and w queued in `fired`) when it was the last."""
    if w.done:
        return False
    w.remaining -= 1
    if w.remaining > 0:
        return False
    w.done = True
    fired.append(w)
    return True


def _to_int(key: bytes, raw: bytes) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"counter {key!r} holds {raw[:40]!r}, which is not a decimal integer"
        ) from None


class MemoryStore:
    """Thread-safe table with TCPStore semantics, keyed by wire keys (bytes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[bytes, bytes] = {}
        self._queues: dict[bytes, deque] = {}
        self._waiters: dict[bytes, dict[Waiter, None]] = {}
        self._barriers: dict[bytes, dict[Waiter, None]] = {}

    # -- internal helpers (call with the lock held) --------------------------------------

    def _changed(self, key: bytes, fired: list) -> None:
        ws = self._waiters.pop(key, None)
        if ws:
            for w in ws:  # _count_down, inlined: a SET may release thousands
                if not w.done:
                    w.remaining -= 1
                    if w.remaining <= 0:
                        w.done = True
                        fired.append(w)
        bs = self._barriers.get(key)
        if bs:
            try:
                count = int(self._data[key])
            except (KeyError, ValueError):
                return
            for w in [w for w in bs if w.world_size <= count]:
                del bs[w]
                if not w.done:
                    w.done = True
                    fired.append(w)
            if not bs:
                del self._barriers[key]

    @staticmethod
    def _fire(fired: list) -> None:
        for w in fired:
            w.fire()

    def _present(self, key: bytes) -> bool:
        if key in self._data:
            return True
        q = self._queues.get(key)
        return bool(q)

    # -- torch ops -----------------------------------------------------------------------

    def set(self, key: bytes, value: bytes) -> None:
        with self._lock:
            self._data[key] = value
            if key not in self._waiters and key not in self._barriers:
                return
            fired: list = []
            self._changed(key, fired)
        if fired:
            self._fire(fired)

    def multi_set(self, keys: Iterable[bytes], values: Iterable[bytes]) -> None:
        fired: list = []
        with self._lock:
            data = self._data
            for k, v in zip(keys, values):
                data[k] = v
                if k in self._waiters or k in self._barriers:
                    self._changed(k, fired)
        if fired:
            self._fire(fired)

    def get(self, key: bytes) -> bytes | None:
        return self._data.get(key)

    def multi_get(self, keys: Iterable[bytes]) -> list[bytes | None]:
        data = self._data
        with self._lock:
            return [data.get(k) for k in keys]

    def add(self, key: bytes, amount: int) -> int:
        with self._lock:
            old = self._data.get(key)
            new = amount if old is None else _to_int(key, old) + amount
            self._data[key] = str(new).encode()
            if key not in self._waiters and key not in self._barriers:
                return new
            fired: list = []
            self._changed(key, fired)
        if fired:
            self._fire(fired)
        return new

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        fired: list = []
        with self._lock:
            cur = self._data.get(key)
            if cur is None:
                if expected:
                    return expected
                self._data[key] = desired
                result = desired
            elif cur == expected:
                self._data[key] = desired
                result = desired
            else:
                return cur
            if key in self._waiters or key in self._barriers:
                self._changed(key, fired)
        if fired:
            self._fire(fired)
        return result

    def append(self, key: bytes, value: bytes) -> None:
        fired: list = []
        with self._lock:
            old = self._data.get(key)
            self._data[key] = value if old is None else old + value
            if key in self._waiters or key in self._barriers:
                self._changed(key, fired)
        if fired:
            self._fire(fired)

    def check(self, keys: Iterable[bytes]) -> bool:
        with self._lock:
            return all(self._present(k) for k in keys)

    def wait(self, keys: Iterable[bytes], fire: Callable[[], None]) -> Waiter | None:
        """None when every key is present now; else a registered Waiter (fires later)."""
        with self._lock:
            if type(keys) is tuple and len(keys) == 1:  # the usual WAIT: one key
                missing = keys if not self._present(keys[0]) else ()
            else:
                missing = tuple(k for k in dict.fromkeys(keys) if not self._present(k))
            if not missing:
                return None
            w = Waiter(missing, fire)
            for k in missing:
                d = self._waiters.get(k)
                if d is None:
                    self._waiters[k] = {w: None}
                else:
                    d[w] = None
            return w

    def barrier(self, key: bytes, world_size: int, fire: Callable[[], None]) -> Waiter | None:
        """torch BARRIER: add 1 to counter `key`; None when it reached `world_size`, else a
        Waiter that fires once it does. Raises ValueError if `key` is not a counter."""
        fired: list = []
        with self._lock:
            old = self._data.get(key)
            count = 1 if old is None else _to_int(key, old) + 1
            self._data[key] = str(count).encode()
            if key in self._waiters or key in self._barriers:
                self._changed(key, fired)
            w = None
            if count < world_size:
                w = Waiter((key,), fire, world_size)
                self._barriers.setdefault(key, {})[w] = None
        if fired:
            self._fire(fired)
        return w

    def cancel(self, w: Waiter) -> bool:
        """Forget a pending waiter; False when it had already fired (or been cancelled)."""
        with self._lock:
            if w.done:
                return False
            w.done = True
            reg = self._barriers if w.world_size else self._waiters
            for k in w.keys:
                d = reg.get(k)
                if d is not None:
                    d.pop(w, None)
                    if not d:
                        del reg[k]
            return True

    def delete(self, key: bytes) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self._data)

    def list_keys(self) -> list[bytes]:
        with self._lock:
            return list(self._data)

    def queue_push(self, key: bytes, value: bytes) -> None:
        fired: list = []
        with self._lock:
            q = self._queues.get(key)
            if q is None:
                q = self._queues[key] = deque()
            q.append(value)
            ws = self._waiters.get(key)
            while ws:  # an item wakes one waiter, the oldest
                w = next(iter(ws))
                del ws[w]
                if _count_down(w, fired):
                    break
            if ws is not None and not ws:
                del self._waiters[key]
        if fired:
            self._fire(fired)

    def queue_pop(self, key: bytes) -> tuple[int, bytes | None]:
        """(queue length before the pop, popped value or None when empty)."""
        with self._lock:
            q = self._queues.get(key)
            if not q:
                return 0, None
            n = len(q)
            v = q.popleft()
            if not q:
                del self._queues[key]
            return n, v

    def queue_len(self, key: bytes) -> int:
        q = self._queues.get(key)
        return len(q) if q else 0

    def pending_waiters(self) -> int:
        """Number of registered, unfired waiters (for tests and status)."""
        with self._lock:
            seen = set()
            for reg in (self._waiters, self._barriers):
                for d in reg.values():
                    seen.update(w for w in d if not w.done)
            return len(seen)


def _or_empty(v: bytes | None) -> bytes:
    return b"" if v is None else v


_APPLY: dict[int, Callable[[Any, P.Request], Any]] = {
    P.Op.SET: lambda t, r: t.set(r.keys[0], r.values[0]),
    P.Op.MULTI_SET: lambda t, r: t.multi_set(r.keys, r.values),
    P.Op.GET: lambda t, r: _or_empty(t.get(r.keys[0])),
    P.Op.MULTI_GET: lambda t, r: [_or_empty(v) for v in t.multi_get(r.keys)],
    P.Op.ADD: lambda t, r: t.add(r.keys[0], r.num),
    P.Op.COMPARE_SET: lambda t, r: t.compare_set(r.keys[0], r.values[0], r.values[1]),
    P.Op.CHECK: lambda t, r: P.READY if t.check(r.keys) else P.NOT_READY,
    P.Op.DELETE_KEY: lambda t, r: 1 if t.delete(r.keys[0]) else 0,
    P.Op.GETNUMKEYS: lambda t, r: t.num_keys(),
    P.Op.LIST_KEYS: lambda t, r: t.list_keys(),
    P.Op.APPEND: lambda t, r: t.append(r.keys[0], r.values[0]),
    P.Op.QUEUE_PUSH: lambda t, r: t.queue_push(r.keys[0], r.values[0]),
    P.Op.QUEUE_POP: lambda t, r: t.queue_pop(r.keys[0]),
    P.Op.QUEUE_LEN: lambda t, r: t.queue_len(r.keys[0]),
}


def apply(table: Any, req: P.Request) -> Any:
    """Run the data request `req` on `table` (a MemoryStore or an object with its methods,
    keyed by wire keys); return the value its reply stands for (`protocol.encode_reply`).
    Errors of the table (ValueError for a non-integer counter, StoreError) propagate."""
    return _APPLY[req.op](table, req)


class LocalKV(KVStore):
    """`KVStore` over a `MemoryStore`, for code in the process that hosts the table."""

    def __init__(self, table: MemoryStore | None = None) -> None:
        self.table = table if table is not None else MemoryStore()

    def set(self, key: str, value: bytes) -> None:
        self.table.set(P.wire_key(key), bytes(value))

    def _wait_wire(self, wks: tuple, timeout: float) -> bool:
        ev = threading.Event()
        w = self.table.wait(wks, ev.set)
        if w is None:
            return True
        if ev.wait(timeout):
            return True
        return not self.table.cancel(w)

    def get(self, key: str, timeout: float) -> bytes:
        timeout = check_timeout(timeout)
        wk = P.wire_key(key)
        if not self._wait_wire((wk,), timeout):
            raise StoreTimeout(f"key {key!r} did not appear within {timeout:g} s")
        v = self.table.get(wk)
        if v is None:
            raise StoreTimeout(f"key {key!r} was deleted while it was being read")
        return v

    def try_get(self, key: str) -> bytes | None:
        return self.table.get(P.wire_key(key))

    def add(self, key: str, amount: int) -> int:
        try:
            return self.table.add(P.wire_key(key), int(amount))
        except ValueError as e:
            raise StoreError(str(e)) from None

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self.table.compare_set(P.wire_key(key), bytes(expected), bytes(desired))

    def wait(self, keys: Iterable[str], timeout: float) -> bool:
        timeout = check_timeout(timeout)
        return self._wait_wire(tuple(P.wire_key(k) for k in keys), timeout)

    def delete(self, key: str) -> bool:
        return self.table.delete(P.wire_key(key))

    def keys(self, prefix: str = "") -> list[str]:
        return P.logical_keys(self.table.list_keys(), prefix)
