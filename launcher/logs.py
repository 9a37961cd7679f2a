"""Everything an agent tells people and machines: console lines, events.jsonl, worker output.

Owns: `AgentLog` (one human line per event through rich, with time, node and generation, plus
the same event as one JSON object in `events.jsonl`), the torchrun log-directory layout
(`<log_dir>/<run_id>_<rand>/attempt_<n>/<local_rank>/{stdout,stderr}.log,error.json`) and
`OutputPump`, which copies a worker's pipe to its log file and/or the console with torchrun's
`[role<local_rank>]:` prefix (or the `--log-line-prefix-template`).
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import IO, Any

from rich.console import Console
from rich.markup import escape

STYLES = {"error": "bold red", "warning": "yellow", "info": "", "debug": "dim"}


class AgentLog:
    """Console + JSON event log of one agent. Thread-safe."""

    def __init__(self, node_rank: int | None, events_path: str | None, quiet: bool = False) -> None:
        self.node_rank = node_rank
        self.generation = 0
        self.host = socket.gethostname()
        self._lock = threading.Lock()
        self._console = Console(stderr=True, highlight=False, soft_wrap=True,
                                force_terminal=None if sys.stderr.isatty() else False)
        self._quiet = quiet
        self._events: IO[str] | None = None
        self.events_path = events_path
        if events_path:
            os.makedirs(os.path.dirname(events_path), exist_ok=True)
            self._events = open(events_path, "a", buffering=1, encoding="utf-8")

    def event(self, kind: str, message: str, level: str = "info", **fields: Any) -> None:
        """Log one event: a line for people and a JSON object for machines."""
        now = time.time()
        gen = fields.pop("generation", self.generation)
        rec = {"time": round(now, 6), "event": kind, "node": self.node_rank, "generation": gen,
               "host": self.host, "message": message, **fields}
        with self._lock:
            if self._events is not None:
                self._events.write(json.dumps(rec, default=str) + "\n")
            if not self._quiet or level in ("error", "warning"):
                stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
                node = "?" if self.node_rank is None else self.node_rank
                style = STYLES.get(level, "")
                text = escape(f"[ftrun {stamp} node{node} gen{gen}] {message}")
                self._console.print(f"[{style}]{text}[/]" if style else text)

    def info(self, kind: str, message: str, **fields: Any) -> None:
        self.event(kind, message, "info", **fields)

    def warning(self, kind: str, message: str, **fields: Any) -> None:
        self.event(kind, message, "warning", **fields)

    def error(self, kind: str, message: str, **fields: Any) -> None:
        self.event(kind, message, "error", **fields)

    def print_block(self, text: str) -> None:
        """Print a multi-line block (the failure summary) unstyled to stderr."""
        with self._lock:
            sys.stderr.write(text if text.endswith("\n") else text + "\n")
            sys.stderr.flush()

    def close(self) -> None:
        with self._lock:
            if self._events is not None:
                self._events.close()
                self._events = None


@dataclass
class RunLogDir:
    """torchrun's per-run log directory: `<base>/<run_id>_<rand>/`."""

    path: str

    @classmethod
    def create(cls, base: str | None, run_id: str) -> "RunLogDir":
        if base is None:
            base = tempfile.mkdtemp(prefix="torchelastic_")
        os.makedirs(base, exist_ok=True)
        return cls(tempfile.mkdtemp(prefix=f"{run_id}_", dir=base))

    def attempt_dir(self, attempt: int) -> str:
        return os.path.join(self.path, f"attempt_{attempt}")

    def rank_dir(self, attempt: int, local_rank: int, fresh: bool = True) -> str:
        d = os.path.join(self.attempt_dir(attempt), str(local_rank))
        if fresh and os.path.isdir(d):
            shutil.rmtree(d)
        os.makedirs(d, exist_ok=True)
        return d

    @property
    def events_path(self) -> str:
        return os.path.join(self.path, "events.jsonl")


def read_events(log_dir: str) -> list[dict]:
    """Every event of every run under `log_dir` (the `--log_dir` base), oldest first."""
    out: list[dict] = []
    for path in sorted(glob.glob(os.path.join(log_dir, "*", "events.jsonl"))):
        with open(path, encoding="utf-8") as f:
            out.extend(json.loads(line) for line in f if line.strip())
    return sorted(out, key=lambda e: e["time"])


def render_prefix(template: str | None, role: str, local_rank: int, rank: int, host: str) -> str:
    if not template:
        return f"[{role}{local_rank}]:"
    return (template.replace("${role_name}", role).replace("${local_rank}", str(local_rank))
            .replace("${rank}", str(rank)).replace("${hostname}", host))


class OutputPump:
    """Copies one worker stream (a pipe) to a file and/or a console stream, line by line.

    Owned by the worker handle that created it: `stop()` joins the thread after the pipe closed.
    """

    def __init__(self, pipe: IO[bytes], file_path: str | None, console: IO[str] | None,
                 prefix: str, filters: list[str] | None = None, filtered_path: str | None = None,
                 console_lock: threading.Lock | None = None) -> None:
        self._pipe = pipe
        self._file = open(file_path, "ab") if file_path else None
        self._console = console
        self._prefix = prefix
        self._filters = filters or []
        self._filtered = open(filtered_path, "a", encoding="utf-8") if filtered_path and filters else None
        self._lock = console_lock or threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"pump{prefix}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for raw in iter(self._pipe.readline, b""):
                if self._file is not None:
                    self._file.write(raw)
                    self._file.flush()
                line = raw.decode("utf-8", "replace").rstrip("\n")
                if self._console is not None:
                    with self._lock:
                        self._console.write(f"{self._prefix}{line}\n")
                        self._console.flush()
                if self._filtered is not None and any(f in line for f in self._filters):
                    self._filtered.write(f"{self._prefix}{line}\n")
                    self._filtered.flush()
        except (OSError, ValueError):
            pass
        finally:
            for f in (self._file, self._filtered):
                if f is not None:
                    f.close()
            try:
                self._pipe.close()
            except OSError:
                pass

    def stop(self, timeout: float = 5.0) -> None:
        self._thread.join(timeout)
