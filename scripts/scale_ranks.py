"""Simulated ranks for scripts/bench_scale.py: TCPStore-wire clients on one asyncio loop.

Owns: `Wire` (one rank's connection to its node's store proxy, speaking the bytes torch's
TCPStore client sends: the VALIDATE/PING handshake, SET, CHECK, WAIT+GET), `SimRank` (what a
runtime-aware rank does on the store, as `launcher.runtime` does it: at start its replica key;
on a stop for generation g' its `RankStatus` under `plan.status_key`, the repair plan polled with
CHECK every `plan_poll_interval` like `RankLinks.wait_key`, then WAIT+GET of it, then
`plan.resumed_key`; a replacement first reads its predecessor's replica key) and `RankLoop`,
the thread that runs every rank's coroutine of this process. No torch and no training: the
process groups a real rank rebuilds on `plan.pg_prefix(g')` are gloo's data plane, not
simulated. Heartbeats and progress travel on the worker channel to the agent (never to the
store): a rank only stamps `beat` (read by its agent's progress record).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from launcher.protocol import plan as PL
from rendezvous.store import protocol as P
from rendezvous.store.protocol import wire_key

SHARD = "dp"  # pure data parallel: every rank holds the same state


@dataclass(frozen=True)
class RankTimings:
    """The runtime's timings (`launcher.runtime.rank_state.RuntimeOptions`' defaults, copied
    so the simulation does not import torch; tests/test_bench_scale.py checks they agree)."""

    heartbeat_interval: float = 1.0
    plan_poll_interval: float = 0.001


OPTIONS = RankTimings()


class Wire:
    """One rank's TCPStore connection (asyncio)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.buf = bytearray()

    @classmethod
    async def open(cls, host: str, port: int) -> "Wire":
        reader, writer = await asyncio.open_connection(host, port)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        wire = cls(reader, writer)
        nonce = os.getpid() & 0xFFFFFFFF
        writer.write(P.handshake_bytes(nonce))
        if await wire.reply(P.Reply.U32) != nonce:
            raise ConnectionError("the proxy answered the handshake wrongly")
        return wire

    async def call(self, op: int, keys: tuple = (), values: tuple = (), count: int = 0):
        self.writer.write(P.encode_request(P.Request(op, keys, values)))
        return await self.reply(P.REPLY_OF[op], count)

    async def reply(self, shape: int, count: int = 0):
        while True:
            if self.buf:
                r = P.parse_reply(self.buf, 0, shape, count)
                if r is not None:
                    del self.buf[: r[1]]
                    return r[0]
            elif shape == P.Reply.NONE:  # SET has no reply
                return None
            chunk = await self.reader.read(P.READ_SIZE)
            if not chunk:
                raise ConnectionError("the proxy closed the connection")
            self.buf += chunk

    async def get(self, key: str) -> bytes:
        """torch's TCPStore get: WAIT for the key, then GET it."""
        wk = wire_key(key)
        await self.call(P.Op.WAIT, (wk,))
        return await self.call(P.Op.GET, (wk,))

    async def set(self, key: str, value: bytes) -> None:
        await self.call(P.Op.SET, (wire_key(key),), (value,))

    async def check(self, key: str) -> bool:
        return await self.call(P.Op.CHECK, (wire_key(key),)) == P.READY

    def close(self) -> None:
        self.writer.close()


@dataclass
class RankRecord:
    """What the benchmark reads back about one rank (set on the loop thread)."""

    generation: int = 0
    started_at: float = 0.0  # wall time its world was ready (connected, replica key written)
    status_at: float = 0.0  # wall time its latest status was posted
    plan_at: float = 0.0  # wall time it read its latest repair plan
    resumed_at: float = 0.0  # wall time its latest resumed key was written
    repair: bytes = b""  # the latest repair plan it followed
    resumed_generation: int = -1  # the generation of `resumed_at`
    polls: int = 0  # CHECKs of the repair key (all rounds)
    beat: float = 0.0  # last heartbeat (monotonic), read by its agent
    error: str = ""


@dataclass(eq=False)
class SimRank:
    """One simulated runtime-aware rank of node `node`, connected to that node's proxy."""

    rank: int
    local_rank: int
    proxy: tuple[str, int]
    generation: int
    replacement: bool
    hello: Callable[[int], None]  # tells its agent it said hello (the agent writes aware_key)
    record: RankRecord = field(default_factory=RankRecord)
    committed: int = 9  # committed steps so far (the same on every healthy rank)
    stop_target: int = 0
    _stop: asyncio.Event | None = None
    _task: asyncio.Task | None = None
    _wire: Wire | None = None

    def request_stop(self, generation: int) -> None:
        """(loop thread) The agent's Stop(g') on the channel."""
        if generation > self.stop_target:
            self.stop_target = generation
            if self._stop is not None:
                self._stop.set()

    def kill(self) -> None:
        """(loop thread) SIGKILL: the coroutine ends, its connection drops."""
        if self._task is not None:
            self._task.cancel()
        if self._wire is not None:
            self._wire.close()

    async def run(self) -> None:
        self._stop = asyncio.Event()
        self.record.generation = self.generation
        try:
            self._wire = await Wire.open(*self.proxy)
            self.hello(self.rank)
            if self.replacement:
                await self._join_as_replacement()
            else:
                await self._wire.set(PL.replica_key(self.rank), SHARD.encode())
                self.record.started_at = time.time()
            while True:
                await self._stop.wait()
                self._stop.clear()
                await self._recover()
        except asyncio.CancelledError:
            raise
        except (ConnectionError, OSError, ValueError) as e:
            self.record.error = f"{type(e).__name__}: {e}"

    async def _join_as_replacement(self) -> None:
        wire = self._wire
        assert wire is not None
        if await wire.check(PL.replica_key(self.rank)):  # its predecessor's layout
            await wire.get(PL.replica_key(self.rank))
        self.record.started_at = time.time()
        await self._round(self.generation)

    async def _recover(self) -> None:
        while self.stop_target > self.generation:
            self.generation = self.stop_target
            self.record.generation = self.generation
            await self._round(self.generation)

    async def _round(self, g: int) -> None:
        """Status, the repair plan, resumed (a newer stop meanwhile: that round instead)."""
        wire = self._wire
        assert wire is not None
        status = PL.RankStatus(
            rank=self.rank,
            generation=g,
            replacement=self.replacement,
            committed_step=-1 if self.replacement else self.committed,
            step=self.committed + 1,
            shard=SHARD,
            pid=os.getpid(),
            host="sim",
        )
        await wire.set(PL.status_key(g, self.rank), status.to_json())
        self.record.status_at = time.time()
        if not await self._poll_repair(g):
            return  # superseded: _recover goes on with the newer generation
        raw = await wire.get(PL.repair_key(g))
        self.record.plan_at = time.time()
        repair = PL.RepairPlan.from_json(raw)
        self.record.repair = raw
        self.replacement = False
        self.committed = repair.resume_step - 1
        await wire.set(PL.resumed_key(g, self.rank), str(repair.resume_step).encode())
        self.record.resumed_at = time.time()
        self.record.resumed_generation = g

    async def _poll_repair(self, g: int) -> bool:
        """`RankLinks.wait_key` with the repair plan's poll interval; False when a newer stop
        came first."""
        wire, cap = self._wire, OPTIONS.plan_poll_interval
        assert wire is not None and self._stop is not None
        delay = min(0.002, cap)
        while True:
            self.record.polls += 1
            if await wire.check(PL.repair_key(g)):
                return True
            if self.stop_target > g:
                self.generation = g
                return False
            try:
                await asyncio.wait_for(self._stop.wait(), delay)
                self._stop.clear()
            except asyncio.TimeoutError:
                pass
            delay = min(delay * 2, cap)


class RankLoop:
    """The asyncio loop (one thread) every simulated rank of this process runs on. Owned by
    the benchmark: `start()`, `stop()`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="sim-ranks", daemon=True)
        self._beats: list[list[SimRank]] = []

    def start(self) -> "RankLoop":
        self._thread.start()
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.create_task(self._beat())
        self.loop.run_forever()

    async def _beat(self) -> None:
        """Every rank's channel heartbeat, once per `OPTIONS.heartbeat_interval`."""
        while True:
            now = time.monotonic()
            for ranks in list(self._beats):
                for r in ranks:
                    r.record.beat = now
            await asyncio.sleep(OPTIONS.heartbeat_interval)

    @property
    def thread_id(self) -> int | None:
        return self._thread.native_id

    def launch(self, ranks: list[SimRank]) -> None:
        """Start `ranks` (any thread)."""

        def go() -> None:
            self._beats.append(ranks)
            for r in ranks:
                r._task = self.loop.create_task(r.run())

        self.loop.call_soon_threadsafe(go)

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop thread (any thread)."""
        self.loop.call_soon_threadsafe(fn)

    def stop(self) -> None:
        def end() -> None:
            for t in asyncio.all_tasks(self.loop):
                t.cancel()
            self.loop.call_later(0.1, self.loop.stop)  # the cancelled tasks end first

        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(end)
            self._thread.join(10.0)
        if not self._thread.is_alive():
            self.loop.close()
