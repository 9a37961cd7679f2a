"""The key-value interface every ftrun component talks to.

Owns: the abstract `KVStore` contract (what agents, the controller, the proxy and the
membership code may ask of a store) and its error types. Implementations live beside it:
`rendezvous.store.memory.LocalKV` (in-process, the embedded server's own table),
`rendezvous.store.client.StoreClient` (TCPStore wire protocol, to an embedded server or a proxy) and
`rendezvous.store.etcd.EtcdKV` (etcd v3).

Keys are *logical* keys, exactly as a torch `TCPStore` user passes them (`"ftrun/plan/3"`).
On the wire a torch client sends them with a leading `/` (`"/ftrun/plan/3"`); every
implementation maps them with `rendezvous.store.protocol.wire_key`/`logical_key`, so a key set by a
torch client and a key set through this interface are the same key (the few keys torch sends
without the `/` appear under `"ftrun/wire/"`). Values are bytes. Counters (`add`) are stored
as decimal ASCII, as torch does.

Every call that can block takes a timeout in seconds (checked by `check_timeout`); nothing
waits forever.
"""

from __future__ import annotations

import abc
import threading
import time
from typing import Iterable


class StoreError(RuntimeError):
    """A store operation failed (connection lost, refused, protocol error)."""


class StoreAuthError(StoreError):
    """The store refused this client: missing or wrong job token / credentials."""


class StoreTimeout(StoreError, TimeoutError):
    """A blocking store operation did not complete within its timeout."""


def check_timeout(timeout: float) -> float:
    """A timeout argument as float seconds; ValueError naming it unless a number >= 0."""
    if not isinstance(timeout, (int, float)) or timeout != timeout or timeout < 0:
        raise ValueError(f"timeout={timeout!r}: must be a number of seconds >= 0")
    return float(timeout)


class KVStore(abc.ABC):
    """A thread-safe key-value store with torch TCPStore semantics plus listing and clearing."""

    # True when interrupt_waits() can end another thread's blocking wait: its waiters may then
    # wait long (one request per key change or per long timeout) instead of in short slices
    interruptible_waits = False

    @abc.abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Store `value` under `key`, waking every waiter on `key`."""

    @abc.abstractmethod
    def get(self, key: str, timeout: float) -> bytes:
        """Return the value of `key`, waiting up to `timeout` s for it; raises StoreTimeout."""

    @abc.abstractmethod
    def try_get(self, key: str) -> bytes | None:
        """Return the value of `key`, or None when it does not exist. Never waits."""

    @abc.abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add `amount` to the counter `key` (missing = 0); return the new value."""

    @abc.abstractmethod
    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """torch semantics: if key is missing and expected == b"", or its value == expected,
        set it to desired. Return the value the key holds afterwards (or `expected` when the
        key is missing and expected != b"")."""

    @abc.abstractmethod
    def wait(self, keys: Iterable[str], timeout: float) -> bool:
        """Block until every key exists; True when they do, False when `timeout` ran out."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Delete `key`; True when it existed."""

    @abc.abstractmethod
    def keys(self, prefix: str = "") -> list[str]:
        """All logical keys that start with `prefix`, sorted."""

    def check(self, keys: Iterable[str]) -> bool:
        """True when every key exists now; never waits. The TCP client asks in one request
        (CHECK of every key), so a reader of one key per rank costs O(1) requests, not O(N)."""
        return all(self.try_get(k) is not None for k in keys)

    def present(self, keys: list[str]) -> list[bytes | None]:
        """The values of `keys` in order, None for a key that does not exist now; never waits.
        The TCP client asks in one request (MULTI_GET, whose wire answer for a missing key is
        an empty value: there an empty value reads as None, so use it for keys whose values
        are never empty)."""
        return [self.try_get(k) for k in keys]

    def wait_values(self, keys: list[str], timeout: float) -> list[bytes] | None:
        """Wait up to `timeout` s for every key to exist, then their values in order (b"" for
        one deleted meanwhile); None when the time ran out. ftrun's TCP server answers it in
        one request (FT_WAIT_VALUES: the wake-up carries the values), etcd (`EtcdKV`) with one
        read and a watch whose events carry them; elsewhere a wait, then one read of the
        values."""
        if not self.wait(keys, timeout):
            return None
        return [b"" if v is None else v for v in self.present(list(keys))]

    def multi_get(self, keys: list[str], timeout: float) -> list[bytes]:
        """The values of `keys` in order, waiting up to `timeout` s for them all (StoreTimeout).
        The TCP client asks in two requests (WAIT, MULTI_GET) whatever the number of keys."""
        deadline = time.monotonic() + check_timeout(timeout)
        return [self.get(k, max(0.0, deadline - time.monotonic())) for k in keys]

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under `prefix`; return how many were deleted."""
        n = 0
        for k in self.keys(prefix):
            n += bool(self.delete(k))
        return n

    def clear_except(self, keep_prefix: str) -> int:
        """Delete every key that does not start with `keep_prefix` (used between restart-all
        generations so new workers never read a previous attempt's keys)."""
        n = 0
        for k in self.keys(""):
            if not k.startswith(keep_prefix):
                n += bool(self.delete(k))
        return n

    def close(self) -> None:  # pragma: no cover - default no-op
        """Release connections; idempotent."""

    def release_thread(self) -> None:
        """The calling thread ends: release what it holds (the TCP client's connection of this
        thread; its next call would open another). Default: nothing held per thread."""

    def interrupt_waits(self, thread: threading.Thread) -> None:
        """Make a blocking call of `thread` on this store end at once with StoreError (its
        owner is stopping it). Only meaningful when `interruptible_waits`; default: nothing."""

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
