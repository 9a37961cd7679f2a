"""What a worker's exit means: a pure classification, no processes, files or store.

Owns: `exit_verdict(facts)`, which turns what the agent knows about one ended worker process
(`ExitFacts`: its exit code, whether it is the rank's current process, whether ftrun was stopping
it, whether it said goodbye, was killed for hanging at exit, uses the runtime) into one `Verdict`:

  SUPERSEDED      an older process of the rank (already replaced): nothing to do
  STOPPED         ftrun stopped it (a plan, a signal): not a failure
  FALLBACK        a runtime rank left for the fallback (`plan.EXIT_FALLBACK`): not a failure
  FINISHED        it exited 0: done with the job
  HUNG_AT_EXIT    killed by the hang guard after its goodbye: finished
  AFTER_GOODBYE   died of a signal in its teardown after its goodbye: finished
  FAULT           anything else: a fault to report

and `fault_kind(...)`, the kind of a FAULT: HANG when the hang guard killed it, else SIGNAL or
EXIT by its code; a rank without the runtime whose last words show a broken collective is a
NETWORK fault (a peer's fault may explain it: the controller blames the rank that hangs).
The agent (`launcher.agent.worker_exits`) acts on the verdict; nothing here has side effects.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from launcher.protocol import plan as P
from launcher.protocol.faults import FaultKind, collective_failure


class Verdict(enum.Enum):
    SUPERSEDED = "superseded"
    STOPPED = "stopped"
    FALLBACK = "fallback"
    FINISHED = "finished"
    HUNG_AT_EXIT = "hung-at-exit"
    AFTER_GOODBYE = "after-goodbye"
    FAULT = "fault"

    @property
    def done_with_the_job(self) -> bool:
        """The rank's work for the job was done (the agent may finish when all are)."""
        return self in (Verdict.FINISHED, Verdict.HUNG_AT_EXIT, Verdict.AFTER_GOODBYE)


@dataclass(frozen=True)
class ExitFacts:
    """What the agent knows about one ended process when it sees the exit."""

    code: int  # Popen's: negative = killed by that signal
    current: bool  # the rank's current process (not an older one already replaced)
    stopping: bool  # ftrun is stopping it (`Worker.stopping`)
    aware: bool  # the rank uses launcher.runtime (said hello)
    hung_at_exit: bool  # killed by the hang guard after its goodbye (`Worker.hung_at_exit`)
    after_goodbye: bool  # ended with a signal after its goodbye (`Worker.ended_after_goodbye`)


def exit_verdict(facts: ExitFacts) -> Verdict:
    """The meaning of one worker exit; the checks run in this order, the first that holds
    decides."""
    if not facts.current:
        return Verdict.SUPERSEDED
    if facts.stopping:
        return Verdict.STOPPED
    if facts.code == P.EXIT_FALLBACK and facts.aware:
        return Verdict.FALLBACK
    if facts.code == 0:
        return Verdict.FINISHED
    if facts.hung_at_exit:
        return Verdict.HUNG_AT_EXIT
    if facts.after_goodbye:
        return Verdict.AFTER_GOODBYE
    return Verdict.FAULT


@dataclass(frozen=True)
class FaultClass:
    """The kind of a FAULT exit, and the broken collective that made it a NETWORK one."""

    kind: FaultKind
    collective: str = ""  # the broken collective (NETWORK only)


def fault_kind(code: int, hang_killed: bool, aware: bool, last_words: str) -> FaultClass:
    """The kind of a FAULT exit. `last_words`: the failure's message, traceback and stderr end
    (only read for a rank without the runtime: a runtime rank reports its own collectives)."""
    if hang_killed:
        return FaultClass(FaultKind.HANG)
    kind = FaultKind.SIGNAL if code < 0 else FaultKind.EXIT
    if not aware:
        broken = collective_failure(last_words)
        if broken:
            return FaultClass(FaultKind.NETWORK, broken)
    return FaultClass(kind)
