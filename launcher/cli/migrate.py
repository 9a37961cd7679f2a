"""`ftctl migrate`: move ranks of a live job to new processes, no fault and no rollback.

Owns: the command's client side. The job is found as `ftctl pause` finds it (RUN_DIR or
--addr). The request (`plan.MigrateRequest`: `--rank R`, repeatable, and/or `--node N`, every
rank of node N) goes to the job's store under `plan.migrate_key`; the controller carries it out
(launcher.control.hot_switch) and answers under `plan.migrate_outcome_key`, which this command
waits for (--timeout) and reports in one line: moved (exit 0), refused (bad request: exit 2),
abandoned (the ranks keep running where they were: exit 1), or no answer within --timeout
(exit 1). A rank outside the job's world is
refused before anything is written.
"""

from __future__ import annotations

import time
from typing import Any

import click

from launcher.agent.subhealth import post_migrate
from launcher.cli.pause import ADDR_OPTION, RUN_DIR_ARG, TOKEN_OPTION, open_job
from launcher.protocol import plan as P

DEFAULT_TIMEOUT_S = 300.0


def wait_outcome(kv: Any, seq: int, timeout: float) -> P.SwitchOutcome | None:
    """The controller's answer to request `seq`, or None after `timeout` seconds."""
    key = P.migrate_outcome_key(seq)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if kv.wait([key], min(1.0, max(0.01, deadline - time.monotonic()))):
            return P.SwitchOutcome.from_json(kv.get(key, 5.0))
    return None


def describe(out: P.SwitchOutcome) -> str:
    """One line for an outcome."""
    if out.outcome == "done":
        return (
            f"hot switch #{out.seq}: ranks {out.ranks} moved to new processes in generation "
            f"{out.generation} (the ranks held {out.cost_s:.2f} s at the step boundary; no "
            "rollback, no restart counted)"
        )
    return f"hot switch #{out.seq} {out.outcome}: {out.why}; the ranks keep running where they were"


def _check_ranks(kv: Any, ranks: list[int]) -> None:
    raw = kv.try_get(P.WORLD_SIZE_KEY)
    if raw is None:
        return  # the controller checks them
    size = int(raw)
    bad = sorted(r for r in ranks if not 0 <= r < size)
    if bad:
        raise click.BadParameter(
            f"rank(s) {bad} not in the job (ranks 0..{size - 1})", param_hint="--rank"
        )


@click.command("migrate")
@RUN_DIR_ARG
@ADDR_OPTION
@TOKEN_OPTION
@click.option("--rank", "ranks", type=int, multiple=True, help="A rank to move (repeatable).")
@click.option("--node", type=click.IntRange(min=0), default=None, help="Move every rank of node N.")
@click.option(
    "--timeout",
    type=click.FloatRange(min=1.0, max=86400.0),
    default=DEFAULT_TIMEOUT_S,
    show_default=True,
    help="Seconds to wait for the controller's answer.",
)
def migrate(
    run_dir: str | None,
    addr: str | None,
    token_file: str | None,
    ranks: tuple[int, ...],
    node: int | None,
    timeout: float,
) -> None:
    """Move ranks (a suspect process, or every rank of a suspect node) to new processes: at
    one step boundary, state from their replicas, no fault and no rollback."""
    if not ranks and node is None:
        raise click.UsageError("name what moves: --rank R (repeatable) or --node N")
    kv = open_job(run_dir, addr, token_file)
    try:
        _check_ranks(kv, list(ranks))
        seq = post_migrate(kv, list(ranks), node, "ftctl", "ftctl migrate")
        out = wait_outcome(kv, seq, timeout)
    finally:
        kv.close()
    if out is None:
        raise click.ClickException(
            f"hot switch #{seq}: no answer from the controller within {timeout:g} s (the "
            "request stays; ftctl status shows the job)"
        )
    if out.outcome == "refused":
        raise click.BadParameter(f"hot switch #{seq} refused: {out.why}", param_hint="migrate")
    if out.outcome != "done":
        raise click.ClickException(describe(out))
    click.echo(describe(out))
