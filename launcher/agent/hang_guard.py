"""What one agent does about hangs: find the local rank that hangs, dump its stacks, kill it, and
publish its ranks' progress for the controller's blame.

Owns, for the agent's health check (every monitor interval):
  - runtime-aware ranks: `HangWatch` (heartbeats, adaptive timeout; process state read from
    /proc for the ranks past their allowance);
  - unmodified ranks (no heartbeats): `SilenceWatch` (CPU time and I/O of the worker's process
    tree). A silent rank is declared hung when its process is stopped or stuck, or when every
    live rank of this node is silent and no rank of another node progressed within the timeout
    (a rank blocked on a hung peer is silent too: `decision.blame_local` picks the one to blame,
    and says when it could only pick the first to go silent);
  - ranks that said goodbye (`rt.finish()`) but have not exited: the same `SilenceWatch` from
    the goodbye on. One silent for longer than the unmodified-script limit (`--hang-timeout S`:
    S; auto: FTRUN_HANG_UNMODIFIED, 600 s) hangs at exit (a teardown deadlock, e.g. a process
    group destroyed while its thread needs the GIL): its stacks are dumped and it is killed,
    and since its work for the job was done it counts as finished (`Worker.hung_at_exit`) --
    the job ends instead of waiting forever, and nothing is restarted;
  - the node's progress record in the store (`launcher.control.progress`), at most once a
    second, written off the agent's loop (`launcher.agent.loop_store`); the other nodes' records
    are read on a thread the loop waits for at most READ_WAIT s (a store that does not answer
    holds up neither the health check nor, so, the self-fencing);
and `act()`: log the hang, dump the stacks (`launcher.hang.stacks`), remember the kill so that the
exit is reported as a `hang` with its evidence, kill the process. `dump()` is the same dump for a
rank the controller blamed (the plan executor calls it before it kills that rank).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable

from launcher.agent.loop_store import Call
from launcher.config import LaunchConfig
from launcher.control.decision import RankProgress, blame_local
from launcher.control.progress import ProgressBoard, read_progress
from launcher.hang.hang_watch import Hang, HangWatch
from launcher.hang.proc_watch import SilenceWatch, proc_state
from launcher.hang.stacks import Dump, dump_stacks, py_spy_available, py_spy_dump
from launcher.observe.logs import AgentLog, RunLogDir
from launcher.protocol.faults import FROZEN_STATES
from launcher.protocol.messages import Heartbeat
from launcher.workers.workers import NodeWorkers, Worker, send_signal
from rendezvous.kv import KVStore

READ_WAIT = 0.2  # s the health check waits for the other nodes' progress records


class HangGuard:
    """Owned by the agent; `attach()` once the store and the node are known."""

    def __init__(
        self,
        cfg: LaunchConfig,
        log: AgentLog,
        run_dir: RunLogDir,
        host: str,
        workers: Callable[[], NodeWorkers],
    ) -> None:
        self.cfg = cfg
        self.policy = cfg.hang
        self.log = log
        self.run_dir = run_dir
        self.host = host
        self._workers = workers
        self.watch = HangWatch(cfg.hang)
        self.silence = SilenceWatch()
        self.board: ProgressBoard | None = None
        self._kv: KVStore | None = None
        self._nnodes = 1
        self._declared: int | None = None  # generation in which an unmodified hang was declared
        self._reading: Call | None = None  # the other nodes' records, being read

    def attach(
        self, kv: KVStore, node: int, nnodes: int, put: Callable[[str, bytes], None] | None = None
    ) -> None:
        self._kv, self._nnodes = kv, nnodes
        self.board = ProgressBoard(kv, node, put=put)

    # ---- fed by the agent ---------------------------------------------------------------
    def on_heartbeat(self, hb: Heartbeat) -> None:
        self.watch.on_heartbeat(hb)

    def on_bye(self, rank: int) -> None:
        self.watch.stop_clock(rank)

    def stop_sent(self, rank: int, generation: int) -> None:
        """The plan executor sent `rank` the stop of round `generation`."""
        self.watch.stop_sent(rank, generation)

    def on_spawn(self, w: Worker) -> None:
        self.watch.forget(w.rank)
        self.silence.forget(w.rank)

    def take_killed(self, rank: int) -> Hang | None:
        return self.watch.take_killed(rank)

    # ---- the health check ---------------------------------------------------------------
    def check(self, generation: int, node: int) -> None:
        now = time.time()
        workers = self._workers()
        live = [w for w in workers.alive() if not w.stopping]
        aware = [w for w in live if w.rank in workers.aware]
        plain = [w for w in live if w.rank not in workers.aware]
        pids = {w.rank: w.pid for w in live}
        for hang in self.watch.overdue(
            [w.rank for w in aware], now, state_of=lambda r: proc_state(pids.get(r))
        ):
            self.act(workers.by_rank(hang.rank), hang, aware=True)  # type: ignore[arg-type]
        leaving = [w for w in live if w.said_bye]
        if (plain or leaving) and self.policy.enabled:
            self.silence.sample({w.rank: w.pid for w in plain + leaving if w.pid}, now)
            if plain:
                self._check_plain(plain, generation, node, now)
            self._check_exits(leaving, now)
        if self.board is not None and self.board.due(now):
            self.board.publish(
                {w.rank: self._record(w, w.rank in workers.aware, now) for w in live}, now
            )

    def _record(self, w: Worker, aware: bool, now: float) -> dict:
        rec = self.watch.progress_of(w.rank, now) if aware else None
        if rec is None:
            rec = {
                "aware": aware,
                "phase": "",
                "waiting": False,
                "silent_s": 0.0,
                "idle_s": round(self.silence.silent_for(w.rank, now), 3),
            }
        rec.update(state=proc_state(w.pid), pid=w.pid, local_rank=w.local_rank, host=self.host)
        return rec

    def _check_plain(self, plain: list[Worker], generation: int, node: int, now: float) -> None:
        """Unmodified workers: declare at most one hang per generation on this node."""
        if self._declared == generation:
            return
        limit = self.policy.unmodified_timeout()
        silent = [
            RankProgress(
                w.rank,
                node,
                False,
                self.silence.silent_for(w.rank, now),
                state=proc_state(w.pid),
                pid=w.pid,
                local_rank=w.local_rank,
                host=self.host,
            )
            for w in plain
            if self.silence.silent_for(w.rank, now) > limit
        ]
        frozen = [p for p in silent if p.state in FROZEN_STATES]
        if not frozen and (
            not silent or len(silent) < len(plain) or self._others_progress(node, limit)
        ):
            return  # some rank still progresses: a slow job, not a hung one
        outside: list[int] = []
        if not frozen and py_spy_available():
            outside = [
                q.rank
                for q in silent
                if Dump("py-spy", py_spy_dump(q.pid or 0) or "").in_collective is False
            ]
        p, why, weak = blame_local(frozen or silent, outside)
        self._declared = generation
        w = next(w for w in plain if w.rank == p.rank)
        self.act(w, Hang(p.rank, p.idle_s, limit, why, p.state, weak=weak), aware=False)

    def _check_exits(self, leaving: list[Worker], now: float) -> None:
        """Ranks that said goodbye: kill the ones silent past the limit (they hang at exit)."""
        limit = self.policy.unmodified_timeout()
        for w in leaving:
            idle = self.silence.silent_for(w.rank, now)
            if idle <= limit or w.pid is None or w.hung_at_exit:
                continue
            self.log.error(
                "exit-hang",
                f"rank {w.rank} (pid {w.pid}) said goodbye (rt.finish()) but has not "
                f"exited: silent (no I/O, idle CPU) for {idle:.1f}s "
                f"({self._timeout_flag()}, allowance {limit:g}s); dumping its stacks, then "
                "killing it. Its work for the job was done, so it counts as finished",
                rank=w.rank,
                pid=w.pid,
                idle_s=round(idle, 3),
                timeout_s=limit,
                state=proc_state(w.pid),
            )
            w.hung_at_exit = True  # the agent reads it at the exit: finished, not a fault
            self.dump(w, aware=False)
            send_signal(w, signal.SIGKILL)

    def _others_progress(self, node: int, limit: float) -> bool:
        """Whether a rank of another node progressed within `limit` s (its agent's record)."""
        if self._kv is None or self._nnodes <= 1:
            return False
        kv, nnodes = self._kv, self._nnodes
        if self._reading is None:
            self._reading = Call.start(lambda: read_progress(kv, nnodes), "progress")
        if not self._reading.wait(READ_WAIT):
            return True  # unknown (the store does not answer): not a reason to kill a rank
        call, self._reading = self._reading, None
        if call.error is not None:
            return True
        return any(p.node != node and p.idle_s < limit for p in call.value)

    # ---- acting on a hang ---------------------------------------------------------------
    def act(self, w: Worker, hang: Hang, aware: bool) -> None:
        """Log the hang, dump the stacks, kill the process; its exit is reported as a hang."""
        self.log.error(
            "hang",
            f"rank {w.rank} (pid {w.pid}) hangs: {hang.basis} ({self._timeout_flag()}, "
            f"allowance {hang.timeout_s:.1f}s); dumping its stacks, then killing it",
            rank=w.rank,
            pid=w.pid,
            **hang.evidence(),
        )
        self.watch.killed(hang)
        self.dump(w, aware)
        send_signal(w, signal.SIGKILL)

    def _timeout_flag(self) -> str:
        return (
            f"--hang-timeout {self.policy.timeout:g}"
            if self.policy.timeout
            else "--hang-timeout auto"
        )

    def dump(self, w: Worker, aware: bool) -> Dump:
        """Dump the stacks of `w` (alive), log where they went, record them in the events."""
        err = os.path.join(self.run_dir.attempt_dir(w.generation), str(w.local_rank), "stderr.log")
        d = dump_stacks(w.pid or 0, aware, err if os.path.exists(err) else None)
        self.log.warning(
            "hang-stacks",
            f"rank {w.rank} stacks dumped by {d.how} to {d.where}"
            + (
                ""
                if d.in_collective is None
                else f"; inside a torch.distributed call: {d.in_collective}"
            ),
            rank=w.rank,
            pid=w.pid,
            how=d.how,
            stacks=d.text[-20000:],
        )
        if d.how == "py-spy":
            self.log.print_block(f"[ftrun] stacks of rank {w.rank} (pid {w.pid}):\n{d.text}")
        return d
