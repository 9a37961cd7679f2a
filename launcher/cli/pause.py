"""`ftctl pause` / `ftctl resume`: halt every rank of a live job between steps, then go on.

Owns: both commands' client side. The job is found as `ftctl status` finds it: RUN_DIR (the
run's log directory, or the --log_dir base holding one run; its `store.json` names the store) or
--addr HOST:PORT ($FTRUN_STORE_ADDR). `ftctl pause` writes a `PauseRequest` (`plan.PAUSE_KEY`)
and tells every agent through the inject sequence (an `Injection` of kind `plan.PAUSE_KIND` for
every rank); the ranks halt at the end of one agreed step, no rollback (launcher.runtime.pause),
for at most --max-duration seconds. `ftctl resume` sets the pause's resume key; the ranks go on
with the next step. A pause already in effect (pause) or none in effect (resume): exit 2, one
line.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import click

from launcher.observe.pause_state import pause_state
from launcher.observe.status import connect
from launcher.protocol import plan as P

DEFAULT_MAX_S = 900.0  # the Ascend guide's pause-state timeout (15 min)


def job_addr(run_dir: str | None, addr: str | None) -> str:
    """The store address of the job: --addr, else the `store.json` in RUN_DIR (or in its one
    run subdirectory)."""
    if addr is not None:
        return addr
    if run_dir is None:
        raise click.UsageError("give the run's log directory or --addr HOST:PORT of its store")
    found = glob.glob(os.path.join(run_dir, P.STORE_ADDR_FILE)) or glob.glob(
        os.path.join(run_dir, "*", P.STORE_ADDR_FILE)
    )
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise click.UsageError(
            f"{run_dir}: {what} {P.STORE_ADDR_FILE} found (pass the run's log directory, or "
            "--addr HOST:PORT)"
        )
    with open(found[0], encoding="utf-8") as f:
        return str(json.load(f)["addr"])


def open_job(run_dir: str | None, addr: str | None, token_file: str | None) -> Any:
    """A client of the job's store (found by `job_addr`)."""
    return connect(job_addr(run_dir, addr), token_file)


RUN_DIR_ARG = click.argument(
    "run_dir", required=False, type=click.Path(exists=True, file_okay=False)
)
ADDR_OPTION = click.option(
    "--addr",
    envvar="FTRUN_STORE_ADDR",
    default=None,
    help="The job's store HOST:PORT (printed by ftrun at start; in <run dir>/store.json).",
)
TOKEN_OPTION = click.option("--token-file", default=None, help="Job token file, when required.")


@click.command("pause")
@RUN_DIR_ARG
@ADDR_OPTION
@TOKEN_OPTION
@click.option(
    "--max-duration",
    type=click.FloatRange(min=1.0, max=86400.0),
    default=DEFAULT_MAX_S,
    show_default=True,
    help="Seconds after which the ranks resume by themselves (the pause expires).",
)
def pause(
    run_dir: str | None, addr: str | None, token_file: str | None, max_duration: float
) -> None:
    """Halt every rank at the end of its current step (the same step everywhere, no rollback)
    until `ftctl resume` or --max-duration."""
    kv = open_job(run_dir, addr, token_file)
    try:
        now = pause_state(kv)
        if now is not None and now.in_effect:
            raise click.BadParameter(
                f"{now.describe()}: one pause at a time (ftctl resume ends it)",
                param_hint="pause",
            )
        seq = kv.add(P.PAUSE_SEQ, 1)
        kv.set(P.PAUSE_KEY, P.PauseRequest(seq=seq, max_s=max_duration).to_json())
        nudge = kv.add(P.INJECT_SEQ, 1)
        kv.set(P.inject_key(nudge), P.Injection(rank=P.EVERY_RANK, kind=P.PAUSE_KIND).to_json())
    finally:
        kv.close()
    click.echo(
        f"pause #{seq} requested: every rank halts at the end of a step, for at most "
        f"{max_duration:g} s (ftctl resume continues; ftctl status shows it)"
    )


@click.command("resume")
@RUN_DIR_ARG
@ADDR_OPTION
@TOKEN_OPTION
def resume(run_dir: str | None, addr: str | None, token_file: str | None) -> None:
    """End the pause in effect: every rank continues with its next step."""
    kv = open_job(run_dir, addr, token_file)
    try:
        now = pause_state(kv)
        if now is None or not now.in_effect:
            last = f" (the last: {now.describe()})" if now is not None else ""
            raise click.BadParameter(f"no pause in effect{last}", param_hint="resume")
        why = kv.compare_set(P.resume_key(now.seq), b"", b"ftctl resume")
    finally:
        kv.close()
    click.echo(f"pause #{now.seq} ended ({why.decode(errors='replace')}): the ranks continue")
