"""`ftctl inject`: inject a fault into one rank of a live job, for drills and tests.

Owns: the command's client side. The request goes through the job's store (`plan.inject_key`);
the agent that runs the rank carries it out (`launcher.agent.injections`). The kinds are
`launcher.protocol.faults`'s. Process faults are real: `kill`
and `segv` are real signals sent by the agent (or, with `--at-step`, by the worker itself at that
step), `hang` stops the worker's training thread. Device faults (`uce-low`, `uce-high`,
`network`) and `exception`/`exit` are raised inside the worker by the runtime through the `cpu`
device adapter, and are labelled as injected in every log line. With `--at-step`, a step the
rank already passed (its agent publishes the step it is at) is refused before anything is
written: exit 2, one line naming both steps.
"""

from __future__ import annotations

from typing import Any

import click

from launcher.observe.status import node_snapshots, rank_step
from launcher.protocol import plan as P
from launcher.protocol.faults import INJECTION_KINDS

PHASES = ("forward", "backward", "optimizer")


def _connect(addr: str, token_file: str | None):
    from rendezvous.store import auth
    from rendezvous.store.client import StoreClient

    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise click.BadParameter(f"{addr!r} is not HOST:PORT", param_hint="--addr")
    token = auth.resolve_token(token_file)
    return StoreClient(host.strip("[]"), int(port), token=token, timeout=10.0)


def _refuse_a_step_passed(kv: Any, rank: int, at_step: int) -> None:
    """An injection at a step the rank already passed would never fire: refused (exit 2, nothing
    written). The rank's step is what its agent publishes (`ftctl status`'s node statuses); when
    it is not known (nothing published yet, or the rank is starting or recovering), accepted."""
    now = rank_step(node_snapshots(kv), rank)
    if now is not None and at_step < now:
        raise click.BadParameter(
            f"step {at_step} has already passed: rank {rank} is at step {now}",
            param_hint="--at-step",
        )


@click.command("inject")
@click.option(
    "--addr",
    envvar="FTRUN_STORE_ADDR",
    required=True,
    help="The job's store HOST:PORT (printed by ftrun at start; $FTRUN_STORE_ADDR).",
)
@click.option("--token-file", default=None, help="Job token file, when the store requires one.")
@click.option("--rank", type=click.IntRange(min=0), required=True, help="Global rank to hit.")
@click.option("--kind", type=click.Choice(INJECTION_KINDS), required=True)
@click.option(
    "--at-step",
    type=click.IntRange(min=0),
    default=None,
    help="Fire when the rank reaches this step (runtime-aware workers; a step the rank "
    "already passed is refused).",
)
@click.option(
    "--phase",
    type=click.Choice(PHASES),
    default=None,
    help="Fire in this phase of the step (with --at-step; default forward).",
)
def inject(
    addr: str, token_file: str | None, rank: int, kind: str, at_step: int | None, phase: str | None
) -> None:
    """Inject a fault into RANK of a live job."""
    if phase is not None and at_step is None:
        raise click.BadParameter("--phase needs --at-step", param_hint="--phase")
    kv = _connect(addr, token_file)
    try:
        world = kv.try_get(P.WORLD_SIZE_KEY)
        if world is not None and rank >= int(world):
            raise click.BadParameter(
                f"rank {rank} is not in this job (world size {int(world)})", param_hint="--rank"
            )
        if at_step is not None:
            _refuse_a_step_passed(kv, rank, at_step)
        seq = kv.add(P.INJECT_SEQ, 1)
        kv.set(
            P.inject_key(seq),
            P.Injection(rank=rank, kind=kind, step=at_step, phase=phase).to_json(),
        )
    finally:
        kv.close()
    when = f" at step {at_step} ({phase or 'forward'})" if at_step is not None else " now"
    click.echo(f"injection #{seq}: {kind} into rank {rank}{when}")
