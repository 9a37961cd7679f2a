"""Worker failures as people read them: error files, the root cause, the failure summary.

Owns: reading a worker's `TORCHELASTIC_ERROR_FILE` (written by torch's `@record`),
`Failure` records, choosing the root cause (earliest observed failure), the summary block printed
when a job fails (root cause first, bystanders the agent terminated listed apart, never as
failures), copying the root cause's error file to ftrun's own `TORCHELASTIC_ERROR_FILE`, and
`JobFailures`, what one agent gathers for that summary (its own workers' failures, the ranks it
terminated, the controller's root cause, which may have been observed on another node).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field

from launcher import plan as P
from launcher.logs import AgentLog
from launcher.workers import Worker, signal_name


@dataclass
class Failure:
    rank: int
    local_rank: int
    host: str
    pid: int
    exitcode: int
    time: float
    generation: int
    node: int | None = None
    kind: str = "exit"
    error_file: str = ""
    message: str = ""
    traceback: str = ""
    evidence: dict = field(default_factory=dict)

    @property
    def signal(self) -> str | None:
        return signal_name(self.exitcode)


def read_error_file(path: str) -> tuple[str, str, float | None]:
    """(message, traceback, timestamp) from a torch `@record` error.json; empty when absent."""
    if not path or not os.path.isfile(path):
        return "", "", None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return "", "", None
    msg = data.get("message", {})
    if isinstance(msg, str):
        return msg, "", None
    text = str(msg.get("message", ""))
    extra = msg.get("extraInfo", {}) or {}
    ts = extra.get("timestamp")
    try:
        tsf = float(ts) if ts is not None else None
    except ValueError:
        tsf = None
    return text, str(extra.get("py_callstack", "")), tsf


def failure_from_exit(rank: int, local_rank: int, host: str, pid: int, code: int, when: float,
                      generation: int, node: int | None, error_file: str) -> Failure:
    msg, tb, ts = read_error_file(error_file)
    f = Failure(rank=rank, local_rank=local_rank, host=host, pid=pid, exitcode=code,
                time=ts if ts is not None else when, generation=generation, node=node,
                kind="signal" if code < 0 else "exit",
                error_file=error_file if msg else "", message=msg, traceback=tb)
    if not f.message:
        if code < 0:
            f.message = f"Signal {-code} ({f.signal}) received by PID {pid}"
        else:
            f.message = (f"exited with code {code} (no error file: decorate main with "
                         "torch.distributed.elastic.multiprocessing.errors.record for a traceback)")
    return f


def root_cause(failures: list[Failure]) -> Failure | None:
    return min(failures, key=lambda f: (f.time, f.rank)) if failures else None


def _block(idx: int, f: Failure) -> list[str]:
    code = f"{f.exitcode} (pid: {f.pid})"
    if f.signal:
        code += f"  ({f.signal})"
    lines = [f"[{idx}]:",
             f"  time      : {time.strftime('%Y-%m-%d_%H:%M:%S', time.localtime(f.time))}",
             f"  host      : {f.host}",
             f"  rank      : {f.rank} (local_rank: {f.local_rank}, node: {f.node})",
             f"  generation: {f.generation}",
             f"  kind      : {f.kind}",
             f"  exitcode  : {code}",
             f"  error_file: {f.error_file or '<N/A>'}"]
    tb = (f.traceback or f.message).rstrip().splitlines() or [""]
    lines.append(f"  traceback : {tb[0]}")
    lines.extend("    " + t for t in tb[1:])
    if f.traceback and f.message and f.message not in f.traceback:
        lines.append(f"  message   : {f.message}")
    return lines


def format_summary(title: str, failures: list[Failure], terminated: list[tuple[int, int]],
                   reason: str = "") -> str:
    """The failure summary: root cause first, other failures, then terminated bystanders.

    `terminated` holds (rank, pid) pairs the agent stopped on purpose."""
    root = root_cause(failures)
    body: list[str] = [f"{title} FAILED"]
    if reason:
        body.append(f"reason: {reason}")
    body.append("-")
    body.append("Root Cause (first observed failure):")
    body.extend(_block(0, root) if root else ["  <UNKNOWN>"])
    body.append("-")
    body.append("Other Failures:")
    others = [f for f in failures if f is not root]
    if others:
        for i, f in enumerate(sorted(others, key=lambda f: f.time), 1):
            body.extend(_block(i, f))
    else:
        body.append("  <NO_OTHER_FAILURES>")
    if terminated:
        body.append("-")
        body.append("Terminated by ftrun (not failures): " +
                    ", ".join(f"rank {r} (pid {p})" for r, p in sorted(terminated)))
    width = min(max(len(line) for line in body), 60)
    out = ["=" * width]
    for line in body:
        out.append("-" * width if line == "-" else line)
    out.append("=" * width)
    return "\n".join(out) + "\n"


def copy_root_error_file(root: Failure, dest: str | None) -> bool:
    """Copy the root cause's error.json to `dest` (ftrun's own TORCHELASTIC_ERROR_FILE) with
    `message.errorCode` = exit code, atomically. Returns True when written."""
    if not dest:
        return False
    data: dict
    try:
        with open(root.error_file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {"message": {"message": root.message,
                            "extraInfo": {"py_callstack": root.traceback,
                                          "timestamp": str(int(root.time))}}}
    if isinstance(data.get("message"), dict):
        data["message"]["errorCode"] = root.exitcode
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    tmp = f"{dest}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, dest)
    return True


@dataclass
class JobFailures:
    """What this agent saw go wrong, for the failure summary."""

    failures: list[Failure] = field(default_factory=list)
    terminated: list[tuple[int, int]] = field(default_factory=list)  # (rank, pid) stopped by ftrun
    root_fault: P.Fault | None = None  # the controller's root cause (first plan that named one)

    def add(self, failure: Failure) -> None:
        self.failures.append(failure)

    def note_terminated(self, workers: list[Worker]) -> None:
        self.terminated.extend((w.rank, w.pid or 0) for w in workers)

    def note_root_cause(self, cause: dict | None) -> None:
        if cause and self.root_fault is None:
            names = {f.name for f in dataclasses.fields(P.Fault)}
            self.root_fault = P.Fault(**{k: v for k, v in cause.items() if k in names})

    def for_summary(self) -> tuple[list[Failure], list[tuple[int, int]]]:
        """The failures (the controller's root cause first in time, even when another node
        observed it) and the terminated bystanders that are not failures."""
        failures = list(self.failures)
        rf = self.root_fault
        same = [f for f in failures if rf is not None and f.rank == rf.rank and f.pid == rf.pid]
        if rf is not None and not same:
            failures.append(Failure(rank=rf.rank if rf.rank is not None else -1,
                                    local_rank=rf.local_rank if rf.local_rank is not None else -1,
                                    host=rf.host, pid=rf.pid or 0, exitcode=rf.exitcode or 1,
                                    time=rf.time, generation=rf.generation, node=rf.node,
                                    kind=rf.kind, message=rf.message,
                                    traceback=str(rf.evidence.get("traceback", ""))))
        for f in same:
            f.time = min(f.time, rf.time)  # type: ignore[union-attr]
        terminated = [(r, p) for r, p in self.terminated
                      if not any(f.rank == r and f.pid == p for f in failures)]
        return failures, terminated

    def print_summary(self, log: AgentLog, title: str, reason: str) -> None:
        """Print the summary block, copy the root cause's error file, record the event."""
        failures, terminated = self.for_summary()
        log.print_block(format_summary(title, failures, terminated, reason))
        rc = root_cause(failures)
        if rc is not None and copy_root_error_file(rc, os.environ.get("TORCHELASTIC_ERROR_FILE")):
            log.info("error-file", "root cause error file copied to TORCHELASTIC_ERROR_FILE")
        log.event("summary", "job failed", "error", root_cause=dataclasses.asdict(rc) if rc else None)
