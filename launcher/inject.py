"""`ftctl inject`: inject a fault into one rank of a live job, for drills and tests.

Owns: the command, and the agent's side of a request (`carry_out`). The request goes through
the job's store (`plan.inject_key`); the agent that runs the rank carries it out. The kinds are
`launcher.faults`'s. Process faults are real: `kill`
and `segv` are real signals sent by the agent (or, with `--at-step`, by the worker itself at that
step), `hang` stops the worker's training thread. Device faults (`uce-low`, `uce-high`,
`network`) and `exception`/`exit` are raised inside the worker by the runtime through the `cpu`
device adapter, and are labelled as injected in every log line.
"""
from __future__ import annotations

import os
import signal
from typing import Callable

import click

from launcher import plan as P
from launcher.faults import INJECTION_KINDS, RUNTIME_INJECTIONS
from launcher.logs import AgentLog
from launcher.messages import Inject, Message
from launcher.workers import Worker

PHASES = ("forward", "backward", "optimizer")


def _connect(addr: str, token_file: str | None):
    from rendezvous import auth
    from rendezvous.client import StoreClient

    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise click.BadParameter(f"{addr!r} is not HOST:PORT", param_hint="--addr")
    token = auth.resolve_token(token_file)
    return StoreClient(host.strip("[]"), int(port), token=token, timeout=10.0)


@click.command("inject")
@click.option("--addr", envvar="FTRUN_STORE_ADDR", required=True,
              help="The job's store HOST:PORT (printed by ftrun at start; $FTRUN_STORE_ADDR).")
@click.option("--token-file", default=None, help="Job token file, when the store requires one.")
@click.option("--rank", type=click.IntRange(min=0), required=True, help="Global rank to hit.")
@click.option("--kind", type=click.Choice(INJECTION_KINDS), required=True)
@click.option("--at-step", type=click.IntRange(min=0), default=None,
              help="Fire when the rank reaches this step (runtime-aware workers).")
@click.option("--phase", type=click.Choice(PHASES), default=None,
              help="Fire in this phase of the step (with --at-step; default forward).")
def inject(addr: str, token_file: str | None, rank: int, kind: str, at_step: int | None,
           phase: str | None) -> None:
    """Inject a fault into RANK of a live job."""
    if phase is not None and at_step is None:
        raise click.BadParameter("--phase needs --at-step", param_hint="--phase")
    kv = _connect(addr, token_file)
    try:
        world = kv.try_get(P.WORLD_SIZE_KEY)
        if world is not None and rank >= int(world):
            raise click.BadParameter(f"rank {rank} is not in this job (world size {int(world)})",
                                     param_hint="--rank")
        seq = kv.add(P.INJECT_SEQ, 1)
        kv.set(P.inject_key(seq), P.Injection(rank=rank, kind=kind, step=at_step, phase=phase).to_json())
    finally:
        kv.close()
    when = f" at step {at_step} ({phase or 'forward'})" if at_step is not None else " now"
    click.echo(f"injection #{seq}: {kind} into rank {rank}{when}")


def carry_out(inj: P.Injection, w: Worker, aware: bool, send: Callable[[int, Message], bool],
              log: AgentLog) -> None:
    """The agent's part: inject `inj` into its local worker `w` (`aware`: it uses the runtime).
    Signals are sent by the agent itself; everything else is forwarded to the worker's runtime."""
    where = f" at step {inj.step} ({inj.phase or 'forward'})" if inj.step is not None else ""
    if not w.alive:
        log.warning("inject-skipped", f"injection {inj.kind} into rank {inj.rank}: not running",
                    rank=inj.rank)
        return
    if not aware and (inj.kind in RUNTIME_INJECTIONS or inj.step is not None):
        log.error("inject-refused", f"rank {inj.rank} does not use launcher.runtime: only "
                  "kill, segv and hang (without --at-step) can be injected", rank=inj.rank)
        return
    log.warning("inject", f"[injected] {inj.kind} into rank {inj.rank} (pid {w.pid}){where}",
                rank=inj.rank, fault_kind=inj.kind, injected=True, step=inj.step)
    if inj.step is None and inj.kind in ("kill", "segv"):
        os.kill(w.pid or 0, signal.SIGKILL if inj.kind == "kill" else signal.SIGSEGV)
    elif inj.step is None and inj.kind == "hang" and not aware:
        os.kill(w.pid or 0, signal.SIGSTOP)  # a real hang of an unmodified worker
    else:
        send(inj.rank, Inject(kind=inj.kind, step=inj.step, phase=inj.phase or "forward"))
