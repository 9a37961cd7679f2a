"""Spares paused while a recovery round holds the pool.

Owns: `SparePause`, kept by the spare pool (`launcher.workers.spare.SparePool`): the idle spares
still preparing (faulting in their heap, or importing torch) when a round begins on the node,
and the spares forked for the pool during it, are stopped (SIGSTOP) until the round's hold ends
(SIGCONT). Their work shares the node's CPUs, memory bandwidth and page allocator with the
state transfer and the redone step: after a kill at step 1 (right after the first step told the
pool how much heap a rank needs, so the successors forked then fault in 176.5 MB each), the
replacement's 172.6 MB took 0.07-0.16 s to arrive instead of 0.017-0.023 s (megatron-core, 3 of
3 runs with a spare preparing beside the round, none without). A paused spare taken for a rank
is continued first; when a replacement starts cold (`hurry`) every paused spare goes on at once
and no other is paused in that round, so a spare can still become ready first and overtake it.
Stopping a process needs no cooperation from it and holds no lock: the signal is taken on its
way back to user space. A forked spare is stopped only once it dies with the agent (its death
signal set, then renamed from the fork server's name: `spare_server.become_spare`): stopped
before, it would outlive an agent SIGKILLed meanwhile, stopped for good. One not there yet
waits (`waiting`) and is stopped at a later check of the round (`pause_waiting`). Nothing here
starts or ends a process.
"""

from __future__ import annotations

import os
import signal

from launcher.workers.spare_server import SERVER_NAME


def dies_with_agent(pid: int) -> bool | None:
    """Whether `pid` has its death signal: a forked spare leaves the fork server's name once it
    has it, a Popen'd spare has it before its exec; None once it is gone."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().strip() != SERVER_NAME
    except OSError:
        return None


class SparePause:
    """The pids this pool stopped, and whether the current round still pauses spares."""

    def __init__(self) -> None:
        self.paused: set[int] = set()
        self.waiting: set[int] = set()  # to be stopped once they die with the agent
        self._hurried = False  # a cold replacement in this round: nothing more is paused

    def hold_begins(self, preparing: set[int]) -> list[int]:
        """A round begins: the spares in `preparing` (alive, not ready) stop until it ends;
        the pids stopped now."""
        self._hurried = False
        self.waiting.clear()  # of an earlier round
        return self.pause(preparing)

    def pause(self, pids: set[int]) -> list[int]:
        """Stop each of `pids` not stopped yet (not after `hurry` in this round) that dies with
        the agent, the others wait (`pause_waiting`); the pids stopped now."""
        if self._hurried:
            return []
        stopped = []
        for pid in sorted(pids - self.paused):
            bound = dies_with_agent(pid)
            self.waiting.discard(pid)
            if not bound:
                if bound is False:
                    self.waiting.add(pid)
                continue
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:  # gone meanwhile: the pool notices at its next check
                continue
            self.paused.add(pid)
            stopped.append(pid)
        return stopped

    def pause_waiting(self, ready: set[int]) -> list[int]:
        """The round goes on: stop the waiting spares that die with the agent by now (those
        `ready` by now are left running); the pids stopped now."""
        self.waiting -= ready
        return self.pause(set(self.waiting))

    def resume(self, pid: int) -> None:
        """Continue `pid` if this pool stopped it (it is about to be taken, or killed)."""
        self.waiting.discard(pid)
        if pid in self.paused:
            self.paused.discard(pid)
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def keep_only(self, alive: set[int]) -> None:
        """Forget the paused pids not in `alive` (gone, or killed: SIGKILL ends a stopped
        process too), so no signal goes to a pid reused since."""
        self.paused &= alive
        self.waiting &= alive

    def hurry(self) -> None:
        """A replacement starts cold: every paused spare goes on now, and none is paused until
        the next round (each races the cold one; the first ready takes its rank)."""
        self._hurried = True
        self.release()

    def release(self) -> list[int]:
        """The round's hold ended: every paused spare goes on; their pids."""
        self.waiting.clear()
        pids = sorted(self.paused)
        for pid in pids:
            self.resume(pid)
        return pids
