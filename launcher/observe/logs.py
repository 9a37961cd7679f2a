"""Everything an agent tells people and machines: console lines, events.jsonl, worker output.

Owns: `AgentLog` (one human line per event through rich, with time, node and generation, plus
the same event as one JSON object in `events.jsonl`, plus the sinks that watch the event stream:
the observer, status and metrics read events here instead of being called from the agent), the
torchrun log-directory layout
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
from typing import IO, Any, Callable

from rich.console import Console
from rich.markup import escape

STYLES = {"error": "bold red", "warning": "yellow", "info": "", "debug": "dim"}
Sink = Callable[[dict], None]


class AgentLog:
    """Console + JSON event log of one agent. Thread-safe."""

    def __init__(self, node_rank: int | None, events_path: str | None, quiet: bool = False) -> None:
        self.node_rank = node_rank
        self.generation = 0
        self.host = socket.gethostname()
        self._lock = threading.Lock()
        self._console = Console(
            stderr=True,
            highlight=False,
            soft_wrap=True,
            force_terminal=None if sys.stderr.isatty() else False,
        )
        self._quiet = quiet
        self._events: IO[str] | None = None
        self.events_path = events_path
        if events_path:
            os.makedirs(os.path.dirname(events_path), exist_ok=True)
            self._events = open(events_path, "a", buffering=1, encoding="utf-8")
        self._sinks: list[Sink] = []
        self._sink_errors = 0

    def add_sink(self, sink: Sink) -> None:
        """Call `sink(record)` for every event from now on (any thread, outside the log lock).
        Observations (`observe`) reach sinks only."""
        with self._lock:
            self._sinks = [*self._sinks, sink]

    def remove_sink(self, sink: Sink) -> None:
        with self._lock:
            self._sinks = [s for s in self._sinks if s is not sink]

    def event(
        self, kind: str, message: str, level: str = "info", console: bool = True, **fields: Any
    ) -> None:
        """Log one event: a line for people (unless `console` is False) and a JSON object for
        machines; then hand the record to the sinks."""
        now = time.time()
        gen = fields.pop("generation", self.generation)
        rec = {
            "time": round(now, 6),
            "event": kind,
            "node": self.node_rank,
            "generation": gen,
            "host": self.host,
            "message": message,
            **fields,
        }
        with self._lock:
            if self._events is not None:
                self._events.write(json.dumps(rec, default=str) + "\n")
            sinks = self._sinks
            if console and (not self._quiet or level in ("error", "warning")):
                stamp = (
                    time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
                )
                node = "?" if self.node_rank is None else self.node_rank
                style = STYLES.get(level, "")
                text = escape(f"[ftrun {stamp} node{node} gen{gen}] {message}")
                self._console.print(f"[{style}]{text}[/]" if style else text)
        self._feed(sinks, rec)

    def record(self, kind: str, message: str, **fields: Any) -> None:
        """An event for machines only (events.jsonl and sinks, no console line): periodic
        progress samples and other records people read through `ftctl status|report`."""
        self.event(kind, message, "debug", console=False, **fields)

    def observe(self, kind: str, **fields: Any) -> None:
        """A high-rate observation (a worker heartbeat) for the sinks only: not written."""
        with self._lock:
            sinks = self._sinks
        if sinks:
            rec = {"time": time.time(), "event": kind, "node": self.node_rank, **fields}
            self._feed(sinks, rec)

    def _feed(self, sinks: list[Sink], rec: dict) -> None:
        for sink in sinks:
            try:
                sink(rec)
            except Exception as e:  # noqa: BLE001 - an observer bug must never stop the agent
                self._sink_errors += 1
                if self._sink_errors <= 3:
                    self.print_block(
                        f"[ftrun] event sink {getattr(sink, '__qualname__', sink)} "
                        f"failed on {rec.get('event')}: {type(e).__name__}: {e}"
                    )

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
        out.extend(read_event_file(path))
    return sorted(out, key=lambda e: e["time"])


def read_event_file(path: str) -> list[dict]:
    """The events of one events.jsonl, in file order. A torn last line (the agent is still
    writing it) is skipped."""
    out: list[dict] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except ValueError:
                if line.endswith("\n"):
                    raise
    return out


def run_event_files(path: str) -> list[str]:
    """The events.jsonl files of one run, given its run directory (`<log_dir>/<run_id>_<rand>`)
    or the `--log_dir` base. Under a base, every agent of the newest run is taken (agents of one
    machine each have their own run directory; a run is identified by its rdzv id)."""
    own = os.path.join(path, "events.jsonl")
    if os.path.isfile(own):
        return [own]
    files = sorted(glob.glob(os.path.join(path, "*", "events.jsonl")), key=os.path.getmtime)
    if not files:
        return []
    runs = {f: _run_id_of(f) for f in files}
    newest = runs[files[-1]]
    return [f for f in files if runs[f] == newest]


def _run_id_of(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    try:
        return str(json.loads(first).get("config", {}).get("rdzv_id", path))
    except ValueError:
        return path


def render_prefix(template: str | None, role: str, local_rank: int, rank: int, host: str) -> str:
    if not template:
        return f"[{role}{local_rank}]:"
    return (
        template.replace("${role_name}", role)
        .replace("${local_rank}", str(local_rank))
        .replace("${rank}", str(rank))
        .replace("${hostname}", host)
    )


class OutputPump:
    """Copies one worker stream (a pipe) to a file and/or a console stream, line by line.

    Owned by the worker handle that created it: `stop()` joins the thread after the pipe closed.
    """

    def __init__(
        self,
        pipe: IO[bytes],
        file_path: str | None,
        console: IO[str] | None,
        prefix: str,
        filters: list[str] | None = None,
        filtered_path: str | None = None,
        console_lock: threading.Lock | None = None,
    ) -> None:
        self._pipe = pipe
        self._file = open(file_path, "ab") if file_path else None
        self._console = console
        self._prefix = prefix
        self._filters = filters or []
        self._filtered = (
            open(filtered_path, "a", encoding="utf-8") if filtered_path and filters else None
        )
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
