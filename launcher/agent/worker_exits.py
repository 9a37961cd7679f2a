"""The agent's handling of a worker exit: what `exit_verdict` decided, carried out.

Owns: `WorkerExits.on_exit(WorkerExit)`: the exit's facts for `launcher.agent.exit_verdict`,
then one line in the log per verdict; a rank done with the job is marked finished (the agent
finishes when all are); a fault becomes a failure (`launcher.agent.errors`: error file, else
the end of its stderr.log) and a fault report to the controller, with its evidence (traceback,
the hang that killed it, the broken collective that may explain it).
"""

from __future__ import annotations

import os
import time
from typing import Callable

from launcher.agent.agent_state import AgentState
from launcher.agent.errors import Failure, failure_from_exit, stderr_cause, stderr_last_words
from launcher.agent.exit_verdict import ExitFacts, Verdict, exit_verdict, fault_kind
from launcher.protocol import plan as P
from launcher.workers.workers import Worker, WorkerExit, signal_name

STDERR_LINES = 20  # of a failed worker's stderr.log, in its failure when it left no error file


class WorkerExits:
    """Carries out exit verdicts; `finish()` is the agent's end of the job (all ranks done)."""

    def __init__(self, state: AgentState, finish: Callable[[], int | None]) -> None:
        self.state = state
        self.finish = finish

    def on_exit(self, ev: WorkerExit) -> int | None:
        s = self.state
        assert s.world is not None
        w = s.workers.by_local[ev.local_rank]
        if s.executor is not None and s.executor.incoming.on_exit(ev.pid, ev.code):
            return None  # a hot switch's new process ended before the switch: abandoned
        if s.executor is not None and s.executor.returning.on_exit(w, ev.pid, ev.code):
            return None  # a returning process (live grow) ended before the world took it back
        verdict = exit_verdict(
            ExitFacts(
                code=ev.code,
                current=w.pid == ev.pid,
                stopping=w.stopping,
                aware=w.rank in s.workers.aware,
                hung_at_exit=w.hung_at_exit,
                after_goodbye=w.ended_after_goodbye,
            )
        )
        if verdict is Verdict.SUPERSEDED:
            return None
        if verdict is Verdict.FAULT:
            self._fault(w, ev)
            return None
        self._log_ended(w, ev, verdict)
        if verdict is Verdict.FINISHED:
            s.mark_finished(w)
        if verdict.done_with_the_job and s.workers.all_succeeded():
            return self.finish()
        return None

    def _log_ended(self, w: Worker, ev: WorkerExit, verdict: Verdict) -> None:
        """One line for an exit that is not a fault."""
        log, fields = self.state.log, {"rank": w.rank, "pid": ev.pid, "exitcode": ev.code}
        if verdict is Verdict.STOPPED:
            log.info("exit", f"rank {w.rank} stopped by ftrun (code {ev.code})", **fields)
        elif verdict is Verdict.FALLBACK:
            log.info("exit", f"rank {w.rank} left for the fallback (pid {ev.pid})", **fields)
        elif verdict is Verdict.FINISHED:
            log.info("exit", f"rank {w.rank} finished (pid {ev.pid})", **fields)
        elif verdict is Verdict.HUNG_AT_EXIT:  # killed by the hang guard after its goodbye
            log.warning(
                "exit",
                f"rank {w.rank} killed after hanging at exit (pid {ev.pid}, code "
                f"{ev.code}); finished: it had said goodbye",
                hung_at_exit=True,
                **fields,
            )
        elif verdict is Verdict.AFTER_GOODBYE:  # a signal in its teardown, after rt.finish()
            cause = stderr_cause(self._stderr_tail(w))
            log.warning(
                "exit",
                f"rank {w.rank} died of {signal_name(ev.code)} at exit after "
                f"its goodbye (pid {ev.pid}); finished: its work was done"
                + (f"; its stderr: {cause[-200:]!r}" if cause else ""),
                after_goodbye=True,
                **fields,
            )

    def _fault(self, w: Worker, ev: WorkerExit) -> None:
        """A failure for the job's end and a fault report for the controller."""
        s = self.state
        hang = s.hangs.take_killed(w.rank)
        f, tail = self._failure(w, ev)
        evidence: dict = {
            "traceback": f.traceback[-4000:],
            "error_file": f.error_file,
            "stderr_file": f.stderr_file,
            "finished_ranks": s.workers.finished(),
        }
        aware = w.rank in s.workers.aware
        found = fault_kind(
            ev.code, hang is not None, aware, f.message + "\n" + f.traceback + "\n" + tail
        )
        kind = found.kind
        if hang is not None:
            evidence.update(hang.evidence())
            f.message = f"hung: {hang.basis}; killed by ftrun ({f.message})"
        elif found.collective:
            evidence["collective"] = found.collective
        f.kind = kind.value
        s.failures.add(f)
        s.log.error(
            "worker-failed",
            f"rank {w.rank} (pid {ev.pid}) {kind.value}: {f.message}"
            + (f" (its stderr: {f.stderr_file})" if f.stderr_file else ""),
            rank=w.rank,
            pid=ev.pid,
            exitcode=ev.code,
            signal=f.signal,
            stderr_file=f.stderr_file or None,
            fault_kind=kind.value,
            detect_ms=round((time.time() - ev.time) * 1000, 3),
            early_notice=ev.early,
        )
        s.report(
            P.Fault(
                kind=kind.value,
                rank=w.rank,
                node=s.the_world().group_rank,
                generation=s.generation,
                message=f.message,
                exitcode=ev.code,
                signal=f.signal,
                pid=ev.pid,
                local_rank=w.local_rank,
                host=s.host,
                time=ev.time,
                evidence=evidence,
            )
        )

    def _failure(self, w: Worker, ev: WorkerExit) -> tuple[Failure, str]:
        """The failure of `w`'s exit and the end of its stderr.log ("" without one): without
        an error file, what the process said last is the clue."""
        s = self.state
        f = failure_from_exit(
            w.rank,
            w.local_rank,
            s.host,
            ev.pid,
            ev.code,
            ev.time,
            w.generation,
            s.the_world().group_rank,
            w.error_file,
        )
        tail = self._stderr_tail(w)
        if tail:
            f.stderr_file = self._stderr_path(w)
            if not f.traceback:  # a signal or a bare exit: what the process said last is the clue
                lines = stderr_last_words(tail, STDERR_LINES)
                what = (
                    f"last {len(lines)} lines of {f.stderr_file}"
                    if lines == tail.rstrip().splitlines()[-len(lines) :]
                    else f"{len(lines)} lines of {f.stderr_file} (its end before Python's "
                    "fatal-error dump, and the dump's head)"
                )
                f.traceback = f"{what}:\n" + "\n".join(lines)
        return f, tail

    def _stderr_path(self, w: Worker) -> str:
        run_dir = self.state.run_dir
        return os.path.join(run_dir.attempt_dir(w.generation), str(w.local_rank), "stderr.log")

    def _stderr_tail(self, w: Worker) -> str:
        """The end of a worker's stderr.log (--redirects/--tee), "" without one."""
        path = self._stderr_path(w)
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 8192))
                return f.read().decode(errors="replace")
        except OSError:
            return ""
