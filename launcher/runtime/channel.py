"""The worker side of the worker <-> agent channel.

Owns: the unix stream socket to the local agent (`FTRUN_AGENT_SOCKET`) and the two daemon threads
that serve it: a reader that turns the agent's `Stop` into a `StopSignal` request (so a rank
blocked in a collective still hears it) and hands `Inject` (from `ftctl inject`) to the fault
injector and `Pause` (from `ftctl pause`) to the pause gate (launcher.runtime.pause: a few
store calls on this thread), and a writer that sends a `Heartbeat` on every progress change
and at least every `heartbeat_interval` seconds. The training thread never touches the
socket: it only updates the heartbeat's fields and queues messages. The messages and their
encoding are `launcher.protocol.messages`'s.
Heartbeats are at most MIN_HEARTBEAT_GAP apart while progress changes (the latest progress is
sent, nothing is lost but intermediate phases): a fast training loop changes phase several
times per step and must not pay a message (and the agent a parse) for each. Other messages
(fault, recovered, bye) go out at once. With a progress source set (`set_progress_source`: the
runtime), the training thread does not even call the channel at a phase edge: the writer reads
(step, phase, committed step, step time) from the source every MIN_HEARTBEAT_GAP and sends a
heartbeat when they changed; the runtime only `wake()`s it for phases worth telling at once.
With a wait probe set (`set_wait_probe`: rt.ddp's native reducer, whose waits run in C++), the
writer also asks it every PERIOD_S whether the training
thread sits in such a wait, and reports it as `waiting` as the runtime's own waits do.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from typing import Any, Callable

from launcher.protocol.messages import (
    Bye,
    Heartbeat,
    Hello,
    Inject,
    Message,
    MessageError,
    Pause,
    Stop,
    decode,
    encode,
)
from launcher.runtime.signals import StopSignal
from launcher.runtime.wait_probe import PERIOD_S

# seconds: progress heartbeats are coalesced within this gap. Their readers work in seconds (hang
# watch, blame, status); at 0.05 s two ranks of a fast loop cost the agent ~1 % of a core on a
# 2-core box, which the workers paid for (scripts/bench_overhead.py); 0.2 s is a quarter of that.
MIN_HEARTBEAT_GAP = 0.2


class AgentChannel:
    """Connection to the local agent; start() it, close() it."""

    def __init__(
        self,
        path: str,
        rank: int,
        stop: StopSignal,
        log: Callable[[str], None],
        heartbeat_interval: float = 1.0,
        connect_timeout: float = 30.0,
        on_inject: Callable[[Inject], None] | None = None,
        on_pause: Callable[[], None] | None = None,
    ) -> None:
        self._path = path
        self._on_inject = on_inject
        self._on_pause = on_pause
        self._rank = rank
        self._stop = stop
        self._log = log
        self._interval = heartbeat_interval
        self._connect_timeout = connect_timeout
        self._sock: socket.socket | None = None
        self._cond = threading.Condition(threading.Lock())
        self._outbox: list[Message] = []
        self._progress = Heartbeat(rank=rank)
        self._dirty = False
        self._closing = False
        self._coalescing = False  # the writer holds back a heartbeat: updates need not wake it
        self._threads: list[threading.Thread] = []
        self._probe: Callable[[], bool] | None = None
        self._probed = False  # the probe's last answer
        self._source: Callable[[], tuple[int, str, int, float | None]] | None = None

    # ---- lifecycle -------------------------------------------------------------------
    def start(self, hello: Hello) -> None:
        deadline = time.monotonic() + self._connect_timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self._path)
                break
            except OSError as exc:
                sock.close()
                if time.monotonic() > deadline:
                    raise ConnectionError(
                        f"cannot connect to the ftrun agent at {self._path}: {exc}"
                    ) from exc
                time.sleep(0.05)
        self._sock = sock
        self._send_now(hello)
        for target, name in (
            (self._read_loop, "ftrun-agent-reader"),
            (self._write_loop, "ftrun-agent-writer"),
        ):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def close(self, bye: bool = True) -> None:
        """Flush queued messages (+ bye), then shut the socket and join the threads."""
        if self._sock is None:
            return
        with self._cond:
            if bye:
                self._outbox.append(Bye(rank=self._rank))
            self._closing = True
            self._cond.notify_all()
        for t in self._threads:
            if t.name == "ftrun-agent-writer":
                t.join(timeout=2.0)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for t in self._threads:
            t.join(timeout=2.0)
        self._sock = None

    # ---- used by the training thread -------------------------------------------------
    def update(self, **fields: Any) -> None:
        """Change heartbeat fields (step, phase, committed_step, waiting); wakes the writer unless
        it already waits to send a coalesced heartbeat."""
        with self._cond:
            for k, v in fields.items():
                setattr(self._progress, k, v)
            self._dirty = True
            if not self._coalescing:
                self._cond.notify_all()

    def set_progress_source(self, source: Callable[[], tuple[int, str, int, float | None]]) -> None:
        """`source()` -> (step, phase, committed_step, step_s): read by the writer every
        MIN_HEARTBEAT_GAP (and when woken) instead of being told at every phase edge; what it
        returns replaces what `update()` set for those fields."""
        with self._cond:
            self._source = source
            self._dirty = True  # the writer may sit in a long wait: make it loop and poll
            self._cond.notify_all()

    def wake(self) -> None:
        """Progress worth sending now (a recovery starts, the job is done): the writer reads the
        source at once instead of at its next poll."""
        with self._cond:
            self._dirty = True
            if not self._coalescing:
                self._cond.notify_all()

    def _pull(self) -> None:
        """(writer, under the lock) Fold the source's and the probe's answers into the heartbeat."""
        if self._source is not None:
            step, phase, committed, step_s = self._source()
            p = self._progress
            if (p.step, p.phase, p.committed_step) != (step, phase, committed) or (
                step_s is not None and step_s != p.step_s
            ):
                p.step, p.phase, p.committed_step = step, phase, committed
                if step_s is not None:
                    p.step_s = step_s
                self._dirty = True
        if self._probe is not None:
            probed = bool(self._probe())
            if probed != self._probed:
                self._probed, self._dirty = probed, True

    def set_wait_probe(self, probe: Callable[[], bool]) -> None:
        """`probe()` (asked by the writer every PERIOD_S): does the training thread wait on its
        peers where it cannot say so itself? Its answer is OR-ed into the heartbeat's `waiting`."""
        with self._cond:
            self._probe = probe
            self._dirty = True
            self._cond.notify_all()

    def send(self, message: Message) -> None:
        """Queue one message for the agent (never blocks on the socket)."""
        with self._cond:
            self._outbox.append(message)
            self._cond.notify_all()

    # ---- threads ---------------------------------------------------------------------
    def _send_now(self, message: Message) -> None:
        assert self._sock is not None
        self._sock.sendall(encode(message))

    def _write_loop(self) -> None:
        last = 0.0
        while True:
            with self._cond:
                timeout = max(0.0, self._interval - (time.monotonic() - last))
                if self._source is not None:
                    timeout = min(timeout, MIN_HEARTBEAT_GAP)
                if self._probe is not None:
                    timeout = min(timeout, PERIOD_S)
                self._cond.wait_for(
                    lambda: self._closing or self._outbox or self._dirty, timeout=timeout
                )
                self._pull()
                gap = MIN_HEARTBEAT_GAP - (time.monotonic() - last)
                if gap > 0 and not (self._closing or self._outbox) and self._dirty:
                    self._coalescing = True  # progress only: let more changes pile up first
                    self._cond.wait_for(lambda: self._closing or self._outbox, timeout=gap)
                    self._coalescing = False
                    self._pull()
                batch, self._outbox = self._outbox, []
                beat = self._dirty or time.monotonic() - last >= self._interval
                self._dirty = False
                progress = dataclasses.replace(
                    self._progress, time=time.time(), waiting=self._progress.waiting or self._probed
                )
                closing = self._closing
            try:
                # closing: the last progress goes before the bye (the run's record ends at the
                # rank's real last step, not at the heartbeat before it)
                if beat:
                    self._send_now(progress)
                    last = time.monotonic()
                for msg in batch:
                    self._send_now(msg)
            except OSError as exc:
                if not closing:
                    self._log(f"agent channel write failed: {exc}")
                return
            if closing:
                return

    def _read_loop(self) -> None:
        assert self._sock is not None
        buf = b""
        while True:
            try:
                chunk = self._sock.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                self._handle(line)
        with self._cond:
            closing = self._closing
        if not closing:
            # No orphans: a worker whose agent is gone must not keep training on its own.
            self._log("agent connection lost; exiting (the agent owns this worker)")
            os._exit(1)

    def _handle(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            msg = decode(line)
        except MessageError as exc:
            self._log(f"ignored malformed message from agent: {exc}")
            return
        if isinstance(msg, Stop):
            if self._stop.request(msg.generation):
                self._log(f"stop received for generation {msg.generation}")
        elif isinstance(msg, Inject):
            if self._on_inject is None:
                self._log(f"ignored injection (no fault injector in this worker): {msg!r}")
            else:
                self._on_inject(msg)
        elif isinstance(msg, Pause):
            if self._on_pause is None:
                self._log("ignored pause request (no pause gate in this worker)")
            else:
                self._on_pause()
        else:
            self._log(f"ignored message the agent does not send: {msg.op!r}")
