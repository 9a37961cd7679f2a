"""One-line event logs of the in-worker runtime.

Owns: the log line format `[ftrun rank R gen G] message`, written to stderr and flushed at once
so the agent's per-rank log files interleave correctly with the worker's own output.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO


class RankLog:
    """Writes `[ftrun rank R gen G] ...` lines; the generation is read at each call."""

    def __init__(
        self, rank: int, generation: Callable[[], int], stream: TextIO | None = None
    ) -> None:
        self._rank = rank
        self._generation = generation
        self._stream = stream

    def __call__(self, message: str) -> None:
        stream = self._stream if self._stream is not None else sys.stderr
        stamp = (
            time.strftime("%H:%M:%S", time.localtime()) + f".{int(time.time() * 1000) % 1000:03d}"
        )
        line = f"[ftrun rank {self._rank} gen {self._generation()}] {stamp} {message}\n"
        try:
            stream.write(line)
            stream.flush()
        except (OSError, ValueError):
            pass  # stderr closed at interpreter exit: nothing left to tell
