"""Exits ftrun itself caused, told apart from the script's own when a run is read back.

Owns: `ftrun_cause(fault)`, why ftrun (not the training script) ended a rank's process, found in
the last words of the rank's stderr.log (`FaultRow.stderr_file`, with --redirects/--tee), and
`mark_ftrun_exits(view)`, which notes it on the faults of a run read from its directory (their
`cause`, and their words, `launcher.observe.fault_words`). Today's runtime never ends a process
this way: a replacement whose skipped random init cannot be proven harmless goes on (the verdict
is settled at the rank's first start, `launcher.runtime.skip_init`); runs recorded with an older
ftrun have a replacement exiting with code 1 for it, which without this reads as the script's
own exit.
"""

from __future__ import annotations

import os

from launcher.observe.fault_words import describe
from launcher.observe.run_view import FaultRow, RunView

TAIL_BYTES = 16384
# (what an older runtime printed before it exited, what it means in words)
FTRUN_EXITS = (
    (
        "skipped random parameter inits cannot be proven harmless",
        "the replacement's check of its skipped random init failed, so ftrun ended it for a new "
        "replacement to init normally (an older ftrun; it no longer exits for this)",
    ),
)


def ftrun_cause(f: FaultRow) -> str | None:
    """Why ftrun ended the rank's process, from its stderr.log's end; None when it did not say
    (or there is no stderr.log)."""
    if f.kind != "exit" or not f.stderr_file:
        return None
    try:
        with open(f.stderr_file, "rb") as fh:
            fh.seek(max(0, os.path.getsize(f.stderr_file) - TAIL_BYTES))
            tail = fh.read().decode(errors="replace")
    except OSError:
        return None
    for marker, words in FTRUN_EXITS:
        if marker in tail:
            return words
    return None


def mark_ftrun_exits(view: RunView) -> None:
    """Note on each fault ftrun caused that it did, and say so in its words."""
    for f in view.faults:
        cause = ftrun_cause(f)
        if cause is None:
            continue
        f.cause = cause
        f.summary = describe(f, [ro for ro in view.rounds if ro.fault is f])
