"""Worker failures as people read them: error files, the root cause, the failure summary.

Owns: reading a worker's `TORCHELASTIC_ERROR_FILE` (written by torch's `@record`),
`Failure` records, choosing the root cause, the summary block printed when a job fails (root
cause first, with the strategies tried for it; earlier faults of the job, recovered, listed
apart as history with their outcome; bystanders the agent terminated listed apart, never as
failures), copying the root cause's error file to ftrun's own `TORCHELASTIC_ERROR_FILE`, and
`JobFailures`, what one agent gathers for that summary (its own workers' failures, the ranks it
terminated, and from the controller's latest plan the root cause, which may have been observed on
another node, and the job's fault history).

The root cause is the fault whose handling failed: the cause of the controller's last plan (the
exit or dump that ended the job). Without a plan (a failure before any round), the earliest
observed failure.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field

from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from launcher.protocol.faults import FaultKind
from launcher.workers.workers import Worker, signal_name

NODE_LOST = FaultKind.NODE_LOST.value


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
    stderr_file: str = (
        ""  # its stderr.log (--redirects/--tee), "" when its stderr went to the console
    )

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


def _fatal_dump_at(lines: list[str]) -> int | None:
    """Where the last of Python's fatal-error dumps starts in `lines` (faulthandler's
    `Fatal Python error: ...`, then every thread's stack and the extension modules; ftrun sets
    PYTHONFAULTHANDLER=1), or None."""
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Fatal Python error"):
            return i
    return None


def stderr_last_words(tail: str, n: int) -> list[str]:
    """At most `n` last lines of a worker's stderr, its cause kept: when the stream ends in a
    fatal-error dump longer than `n` / 2 lines, the lines before the dump (up to half) and the
    dump's head, instead of the dump's tail (the module list)."""
    lines = tail.rstrip().splitlines()
    i = _fatal_dump_at(lines)
    if i is None or len(lines) - i <= n // 2:
        return lines[-n:]
    before = lines[max(0, i - n // 2) : i]
    return before + lines[i : i + n - len(before)]


def stderr_cause(tail: str) -> str:
    """The line of a worker's stderr that most likely says why it died: the last non-blank
    line before a fatal-error dump when it ends in one (e.g. "terminate called without an
    active exception"), else the last line; "" for an empty stream."""
    lines = tail.rstrip().splitlines()
    i = _fatal_dump_at(lines)
    if i is None:
        return lines[-1] if lines else ""
    before = [line for line in lines[:i] if line.strip()]
    return before[-1] if before else lines[i]


def failure_from_exit(
    rank: int,
    local_rank: int,
    host: str,
    pid: int,
    code: int,
    when: float,
    generation: int,
    node: int | None,
    error_file: str,
) -> Failure:
    msg, tb, ts = read_error_file(error_file)
    f = Failure(
        rank=rank,
        local_rank=local_rank,
        host=host,
        pid=pid,
        exitcode=code,
        time=ts if ts is not None else when,
        generation=generation,
        node=node,
        kind="signal" if code < 0 else "exit",
        error_file=error_file if msg else "",
        message=msg,
        traceback=tb,
    )
    if not f.message:
        if code < 0:
            f.message = f"Signal {-code} ({f.signal}) received by PID {pid}"
        else:
            f.message = (
                f"exited with code {code} (no error file: decorate main with "
                "torch.distributed.elastic.multiprocessing.errors.record for a traceback)"
            )
    return f


def root_cause(failures: list[Failure]) -> Failure | None:
    return min(failures, key=lambda f: (f.time, f.rank)) if failures else None


def _block(idx: int, f: Failure) -> list[str]:
    code = f"{f.exitcode} (pid: {f.pid})"
    if f.signal:
        code += f"  ({f.signal})"
    lines = [
        f"[{idx}]:",
        f"  time      : {time.strftime('%Y-%m-%d_%H:%M:%S', time.localtime(f.time))}",
        f"  host      : {f.host}",
        (
            f"  rank      : none (node {f.node} lost: {f.message.splitlines()[0][:200]})"
            if f.kind == NODE_LOST and f.rank < 0
            else f"  rank      : {f.rank} (local_rank: {f.local_rank}, node: {f.node})"
        ),
        f"  generation: {f.generation}",
        f"  kind      : {f.kind}",
        f"  exitcode  : {code}",
        f"  error_file: {f.error_file or '<N/A>'}",
    ]
    if f.stderr_file:
        lines.append(f"  stderr    : {f.stderr_file}")
    tb = (f.traceback or f.message).rstrip().splitlines() or [""]
    lines.append(f"  traceback : {tb[0]}")
    lines.extend("    " + t for t in tb[1:])
    if f.traceback and f.message and f.message not in f.traceback:
        lines.append(f"  message   : {f.message}")
    return lines


def handling_line(entry: dict) -> str:
    """`recover-in-place (gen 2) -> restart-all (gen 3) -> exit (gen 4)`."""
    return " -> ".join(f"{s} (gen {g})" for s, g in entry.get("handling", []))


def history_line(entry: dict) -> str:
    """One earlier fault: what it was, what was tried, how it ended."""
    tag = " [injected]" if entry.get("injected") else ""
    msg = (str(entry.get("message") or "").splitlines() or [""])[0][:120]
    merged = entry.get("consequences") or 0
    more = f" ({merged} consequence report(s) merged)" if merged else ""
    who = (
        f"node {entry.get('node')} lost"
        if entry.get("rank") is None and entry.get("kind") == NODE_LOST
        else f"rank {entry.get('rank')} {entry.get('kind')}{tag} on node {entry.get('node')}"
    )
    return f"  {who}: {msg}{more} -> {handling_line(entry)}: {entry.get('outcome')}"


def format_summary(
    title: str,
    failures: list[Failure],
    terminated: list[tuple[int, int]],
    reason: str = "",
    root: Failure | None = None,
    history: list[dict] | None = None,
) -> str:
    """The failure summary: root cause first (with the strategies tried for it when `history`
    holds it last), the job's earlier faults and their outcome, other failures, then terminated
    bystanders. `root`: the controller's root cause (else the earliest of `failures`);
    `terminated` holds (rank, pid) pairs the agent stopped on purpose."""
    history = list(history or [])
    label = "the fault whose handling failed" if root is not None else "first observed failure"
    root = root if root is not None else root_cause(failures)
    body: list[str] = [f"{title} FAILED"]
    if reason:
        body.append(f"reason: {reason}")
    body.append("-")
    body.append(f"Root Cause ({label}):")
    body.extend(_block(0, root) if root else ["  <UNKNOWN>"])
    last = (
        history.pop()
        if history and root is not None and history[-1].get("rank") == root.rank
        else None
    )
    if last is not None:
        body.append(f"  handling  : {handling_line(last)}: {last.get('outcome')}")
    if history:
        body.append("-")
        body.append("Earlier faults (history, oldest first):")
        body.extend(history_line(h) for h in history)
    body.append("-")
    body.append("Other Failures:")
    earlier = {(h.get("rank"), h.get("pid")) for h in history}
    others = [f for f in failures if f is not root and (f.rank, f.pid) not in earlier]
    if others:
        for i, f in enumerate(sorted(others, key=lambda f: f.time), 1):
            body.extend(_block(i, f))
    else:
        body.append("  <NO_OTHER_FAILURES>")
    if terminated:
        body.append("-")
        body.append(
            "Terminated by ftrun (not failures): "
            + ", ".join(f"rank {r} (pid {p})" for r, p in sorted(terminated))
        )
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
        data = {
            "message": {
                "message": root.message,
                "extraInfo": {"py_callstack": root.traceback, "timestamp": str(int(root.time))},
            }
        }
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
    root_fault: P.Fault | None = None  # the cause of the controller's latest plan
    history: list[dict] = field(default_factory=list)  # the job's faults (the latest plan's)

    def add(self, failure: Failure) -> None:
        self.failures.append(failure)

    def note_terminated(self, workers: list[Worker]) -> None:
        self.terminated.extend((w.rank, w.pid or 0) for w in workers)

    def note_plan(self, plan: P.Plan) -> None:
        """The controller's latest plan: its cause is the root cause should the job end now."""
        if plan.root_cause and plan.strategy != P.SWITCH:  # a hot switch: no fault
            names = {f.name for f in dataclasses.fields(P.Fault)}
            self.root_fault = P.Fault(**{k: v for k, v in plan.root_cause.items() if k in names})
        self.history = [dict(h) for h in plan.history]

    def for_summary(self) -> tuple[Failure | None, list[Failure], list[tuple[int, int]]]:
        """The root cause (the controller's, even when another node observed it; else the
        earliest failure), all failures, and the terminated bystanders that are not failures."""
        failures = list(self.failures)
        rf = self.root_fault
        root: Failure | None = None
        if rf is not None:
            root = next((f for f in failures if f.rank == rf.rank and f.pid == rf.pid), None)
            if root is None:
                root = Failure(
                    rank=rf.rank if rf.rank is not None else -1,
                    local_rank=rf.local_rank if rf.local_rank is not None else -1,
                    host=rf.host,
                    pid=rf.pid or 0,
                    exitcode=rf.exitcode or 1,
                    time=rf.time,
                    generation=rf.generation,
                    node=rf.node,
                    kind=rf.kind,
                    message=rf.message,
                    traceback=str(rf.evidence.get("traceback", "")),
                    stderr_file=str(rf.evidence.get("stderr_file") or ""),
                )
                failures.append(root)
            root.kind, root.time = rf.kind, min(root.time, rf.time)
        terminated = [
            (r, p)
            for r, p in self.terminated
            if not any(f.rank == r and f.pid == p for f in failures)
        ]
        return root, failures, terminated

    def print_summary(self, log: AgentLog, title: str, reason: str) -> None:
        """Print the summary block, copy the root cause's error file, record the event."""
        root, failures, terminated = self.for_summary()
        log.print_block(format_summary(title, failures, terminated, reason, root, self.history))
        rc = root if root is not None else root_cause(failures)
        if rc is not None and copy_root_error_file(rc, os.environ.get("TORCHELASTIC_ERROR_FILE")):
            log.info("error-file", "root cause error file copied to TORCHELASTIC_ERROR_FILE")
        what = (
            f"node {rc.node} lost"
            if rc is not None and rc.kind == NODE_LOST and rc.rank < 0
            else f"rank {rc.rank if rc else '?'} {rc.kind if rc else 'unknown'}"
        )
        log.event(
            "summary",
            f"job failed; root cause: {what}",
            "error",
            root_cause=dataclasses.asdict(rc) if rc else None,
            history=self.history,
        )
