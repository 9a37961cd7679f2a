"""The agent's side of `ftctl inject`: carrying out one injection request on a local worker.

Owns: `carry_out`. Signals (`kill`, `segv`, and `hang` of a worker without the runtime) are sent
by the agent itself; everything else is forwarded to the worker's runtime over its channel,
which raises it at the requested step and phase. Every line is labelled as injected.
"""

from __future__ import annotations

import os
import signal
from typing import Callable

from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from launcher.protocol.faults import RUNTIME_INJECTIONS
from launcher.protocol.messages import Inject, Message
from launcher.workers.workers import Worker


def carry_out(
    inj: P.Injection, w: Worker, aware: bool, send: Callable[[int, Message], bool], log: AgentLog
) -> None:
    """The agent's part: inject `inj` into its local worker `w` (`aware`: it uses the runtime).
    Signals are sent by the agent itself; everything else is forwarded to the worker's runtime."""
    where = f" at step {inj.step} ({inj.phase or 'forward'})" if inj.step is not None else ""
    if not w.alive:
        log.warning(
            "inject-skipped",
            f"injection {inj.kind} into rank {inj.rank}: not running",
            rank=inj.rank,
        )
        return
    if not aware and (inj.kind in RUNTIME_INJECTIONS or inj.step is not None):
        log.error(
            "inject-refused",
            f"rank {inj.rank} does not use launcher.runtime: only "
            "kill, segv and hang (without --at-step) can be injected",
            rank=inj.rank,
        )
        return
    log.warning(
        "inject",
        f"[injected] {inj.kind} into rank {inj.rank} (pid {w.pid}){where}",
        rank=inj.rank,
        fault_kind=inj.kind,
        injected=True,
        step=inj.step,
    )
    if inj.step is None and inj.kind in ("kill", "segv"):
        os.kill(w.pid or 0, signal.SIGKILL if inj.kind == "kill" else signal.SIGSEGV)
    elif inj.step is None and inj.kind == "hang" and not aware:
        os.kill(w.pid or 0, signal.SIGSTOP)  # a real hang of an unmodified worker
    else:
        send(inj.rank, Inject(kind=inj.kind, step=inj.step, phase=inj.phase or "forward"))
