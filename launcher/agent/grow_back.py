"""The agent's side of a live grow back: the dropped ranks' returning processes.

Owns: `ReturningRanks`. After a live shrink (an elastic-training plan) this node's dropped ranks
(`NodeWorkers.left`) are "capacity returning": each gets a process for the next generation,
started as a replacement (a warm spare taken, or a cold start: `Spawner.spawn`), which posts
its status for that generation and waits; the controller grows the world once every dropped
rank's is there (launcher.control.grow). A later process-level round before the grow (another
fault) restarts the still-waiting processes for its next generation; a restart-all or an exit
ends them with every worker. The grow's plan (`plan.GROW`) names the returning ranks (one
whose process ended just before gets a new one for the grow's own round); each leaves `left`
(it is a rank of the world again) when it says it recovered. A returning process
that ends before that is one line and no fault (the world stays as it is): its status key is
deleted, so the controller does not grow with it. `FTRUN_ELASTIC_GROW=0` (`--rdzv-conf
elastic_grow=0`, `LaunchConfig.elastic_grow`) starts none: the world stays shrunk. A lost node's
new agent (a hot spare, or the node's agent restarted) whose ranks a live shrink dropped starts
their returning processes when it joins (`rejoin`, launcher.agent.node_return): the world grows
back across hosts the same way.
"""

from __future__ import annotations

import signal

from launcher.agent.loop_store import Call
from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from launcher.workers.spawner import Spawner
from launcher.workers.workers import NodeWorkers, Worker, stop_workers
from rendezvous.kv import KVStore

# the rounds after which a dropped rank's process is (re)started for the next generation
STARTS_AFTER = (P.ELASTIC, P.RECOVER_IN_PLACE, P.RETRY)


class ReturningRanks:
    """This node's returning processes: rank -> the generation it joins."""

    def __init__(
        self,
        log: AgentLog,
        kv: KVStore,
        workers: NodeWorkers,
        spawner: Spawner,
        enabled: bool,
    ) -> None:
        self.log, self.kv, self.workers, self.spawner = log, kv, workers, spawner
        self.enabled = enabled
        self.waiting: dict[int, int] = {}  # rank -> generation its returning process joins
        self.growing: set[int] = set()  # named by a grow plan, not recovered yet

    def after(self, plan: P.Plan) -> None:
        """`plan` was carried out on this node: start (or restart) the returning processes it
        calls for, or note the grow that takes them back."""
        if plan.strategy == P.GROW:
            for w in self.workers.of_ranks(plan.restart_ranks):
                self.waiting.pop(w.rank, None)
                if not w.alive:  # ended just before the grow: a new one joins its round
                    self._start(w, plan.generation)
                    self.waiting.pop(w.rank, None)
                self.growing.add(w.rank)
            return
        if plan.strategy not in STARTS_AFTER:
            self.waiting.clear()  # restart-all, dump, exit: every worker is stopped
            self.growing.clear()
            return
        if not self.enabled:
            return
        target = plan.generation + 1
        for w in self.workers.of_ranks(sorted(self.workers.left)):
            self._start(w, target)

    def rejoin(self, ranks: list[int], target: int) -> None:
        """A replacement agent of a lost node whose `ranks` left the world in a live shrink
        (launcher.agent.node_return): they are this node's dropped ranks, each with a
        returning process for generation `target`, as after a live shrink here."""
        self.workers.left.update(w.rank for w in self.workers.of_ranks(ranks))
        if not self.enabled:
            return
        for w in self.workers.of_ranks(sorted(self.workers.left)):
            self._start(w, target)

    def _start(self, w: Worker, target: int) -> None:
        again = w.rank in self.waiting
        if w.alive:  # waiting for an older generation: that round will not be its grow
            stop_workers([w], signal.SIGKILL, 0.0)
        self.growing.discard(w.rank)
        self.workers.aware.discard(w.rank)
        self.spawner.spawn(w, target, replacement=True)
        self.waiting[w.rank] = target
        self.log.info(
            "grow-start",
            f"rank {w.rank} left the world: its returning process (pid {w.pid}) joins "
            f"generation {target} once the world grows back"
            + (" (restarted: a newer round came first)" if again else ""),
            rank=w.rank,
            pid=w.pid,
            generation=target,
        )

    def recovered(self, rank: int) -> None:
        """Rank `rank` resumed: a returning one is in the world again."""
        if rank in self.growing:
            self.growing.discard(rank)
            self.workers.left.discard(rank)

    def on_exit(self, w: Worker, pid: int, code: int) -> bool:
        """A process of `w` ended: True when it was a returning process that ended before the
        grow (one line, no fault); False to handle the exit as usual."""
        target = self.waiting.get(w.rank)
        left_out = w.rank in self.growing and code == P.EXIT_FALLBACK
        if (target is None and not left_out) or w.pid != pid or w.stopping:
            return False
        self.waiting.pop(w.rank, None)
        self.growing.discard(w.rank)
        if target is not None:  # no grow with it: the controller looks for this key
            Call.start(lambda: self.kv.delete(P.status_key(target, w.rank)), "returning")
        self.log.warning(
            "grow-abandoned",
            f"rank {w.rank}'s returning process (pid {pid}) ended with code {code} before the "
            "world took it back; the world stays as it is",
            rank=w.rank,
            pid=pid,
            exitcode=code,
        )
        return True
