"""A fault and what ftrun did about it, in the words an operator uses.

Owns: `describe(fault, rounds)`, one or two sentences for the fault table of `ftctl report` and
`ftctl status` ("rank 2 was killed (SIGKILL); ftrun restarted only rank 2 and copied its state
from rank 0."), from the fault's record and the recovery rounds it started (more than one when
a round fell back); the controller's own reason stays beside it for engineers. Pure: no I/O.
"""

from __future__ import annotations

import re

from launcher.observe.run_view import FaultRow, Round

SIGNAL_WORDS = {
    "SIGKILL": "was killed (SIGKILL)",
    "SIGTERM": "was terminated (SIGTERM)",
    "SIGINT": "was interrupted (SIGINT)",
    "SIGSEGV": "crashed (SIGSEGV, a segmentation fault)",
    "SIGBUS": "crashed (SIGBUS, a bus error)",
    "SIGABRT": "aborted (SIGABRT)",
    "SIGFPE": "crashed (SIGFPE, an arithmetic error)",
}
KIND_WORDS = {
    "hang": "hung (no progress) and was killed by ftrun",
    "uce-high": "hit an uncorrectable memory error on its device (UCE, its state must be rebuilt)",
    "uce-low": "hit an uncorrectable memory error on its device (UCE, repairable in place)",
    "network": "lost contact with its peers (a network or collective error)",
    "unsafe-data": "touched data marked unsafe after an earlier fault",
    "exception": "raised an exception in the training script",
    "ftrun-exit": "was ended by ftrun itself, not by the script",
}

AFTERMATH = {
    "superseded": " (a later fault cut that round short)",
    "failed": "; the job failed during that round",
    "in-progress": " (still running)",
}


def describe(f: FaultRow, rounds: list[Round]) -> str:
    """What happened and what ftrun did; `rounds`: the rounds the fault started, in order."""
    said = _what_happened(f) + (" (a drill: injected)" if f.injected else "")
    if not rounds:
        if f.strategy:
            return f"{said}; ftrun chose {f.strategy}."
        return f"{said}."
    if f.during_recovery:
        said += ", during the recovery of an earlier fault"
    done = [_what_ftrun_did(f, ro) for ro in rounds]
    text = f"{said}; ftrun {done[0]}"
    for prev, now in zip(rounds, done[1:]):
        text += f", which could not complete ({prev.outcome}), so it then {now}"
    return text + AFTERMATH.get(rounds[-1].outcome, "") + "."


def _what_happened(f: FaultRow) -> str:
    if f.rank is None:
        host = f" ({f.host})" if f.host else ""
        return f"node {f.node}{host} was lost (its agent stopped answering)"
    who = f"rank {f.rank}"
    if f.cause:
        return f"{who}'s process was ended by ftrun itself, not by the script: {f.cause}"
    if f.kind == "signal":
        sig = f.signal or _first(r"SIG[A-Z0-9]+", f.evidence)
        return f"{who} " + SIGNAL_WORDS.get(sig or "", f"died of {sig or 'a signal'}")
    if f.kind == "exit":
        code = f.exitcode if f.exitcode is not None else _first(r"code (-?\d+)", f.evidence)
        return f"{who}'s process exited with code {code if code is not None else '?'}"
    return f"{who} " + KIND_WORDS.get(f.kind, f"failed ({f.kind})")


def _what_ftrun_did(f: FaultRow, ro: Round) -> str:
    step = f" at step {ro.resume_step}" if ro.resume_step is not None else ""
    if ro.strategy == "retry":
        return f"retried in place on every rank, no process restarted, going on{step}"
    if ro.strategy == "recover-in-place":
        return _restarted_only(f, ro) + (f"; every rank went on{step}" if step else "")
    if ro.strategy == "elastic-training":
        left = ro.failed_ranks or ([f.rank] if f.rank is not None else [])
        their = "its replica" if len(left) == 1 else "their replicas"
        if ro.outcome in ("fallback", "superseded"):
            return f"tried to go on live without {_ranks(left)} and {their} (elastic-training)"
        return (
            f"let {_ranks(left)} leave the world with {their}, restarting no process: the "
            f"other ranks went on live in a smaller world{step}"
        )
    if ro.strategy == "restart-all":
        return "stopped and restarted every rank (from the last checkpoint, if any)"
    if ro.strategy == "dump":
        return "saved the surviving ranks' state and stopped the job"
    if ro.strategy == "exit":
        return "stopped the job: no recovery applied (see the reason)"
    return f"recovered with {ro.strategy}"


def _restarted_only(f: FaultRow, ro: Round) -> str:
    restarted = ro.restart_ranks or ([f.rank] if f.rank is not None else [])
    sources = sorted({p[0] for p in ro.pairs if len(p) == 2 and p[1] in restarted})
    text = f"restarted only {_ranks(restarted)}" if restarted else "repaired the failed ranks"
    if sources:
        their = "its" if len(restarted) == 1 else "their"
        text += f" and copied {their} state from {_ranks(sources)}"
    return text


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "no rank"
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _first(pattern: str, text: str) -> str | None:
    m = re.search(pattern, text or "")
    return None if m is None else (m.group(1) if m.groups() else m.group(0))
