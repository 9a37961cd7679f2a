"""The agent's side of a hot switch (`ftctl migrate`, sub-health): this node's incoming processes.

Owns: `IncomingRanks`. The controller's `SwitchOrder` (`plan.SWITCH_KEY`, announced by an
injection of kind `plan.SWITCH_KIND`: `on_order`) names the ranks that move; for each of this
node's, a second process is started beside the running one (a warm spare taken first, else a
cold start: `Spawner.spawn` into a Worker of its own) for the switch's generation; it posts
its status for that generation and waits (launcher.control.hot_switch waits for every one).
Meanwhile the rank's messages stay with the running process (`ChannelServer.keep`: the pause
reaches it) and the incoming process's own messages are not acted on (`holds`).

The switch's plan (`plan.SWITCH`, `take_over`): each drained process is stopped (SIGKILL: it is
halted at the step boundary, its state is its replicas') and the incoming one takes its place
in the node's table (`NodeWorkers.by_local`) and on the channel. An incoming process that
ended just before gets a fresh replacement for the round. Before that point anything that goes
wrong abandons the switch and the ranks keep running: an incoming process that ends
(`on_exit`: one line, `plan.switch_ended_key` set for the controller, its status deleted), the
controller abandoning it (its ended key, on the next nudge: `on_order`), or any other plan
first (`take_over`: the incoming processes are stopped and their statuses deleted before the
plan's stop reaches the running ranks, so that round counts the running processes only).
"""

from __future__ import annotations

import signal

from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from launcher.workers.channel import ChannelServer
from launcher.workers.spawner import Spawner
from launcher.workers.workers import NodeWorkers, Worker, stop_workers
from rendezvous.kv import KVStore


class IncomingRanks:
    """This node's part of the hot switch in progress: rank -> its incoming process."""

    def __init__(
        self,
        log: AgentLog,
        kv: KVStore,
        workers: NodeWorkers,
        spawner: Spawner,
        channel: ChannelServer,
        node: int,
    ) -> None:
        self.log, self.kv, self.workers, self.spawner = log, kv, workers, spawner
        self.channel, self.node = channel, node
        self.order: P.SwitchOrder | None = None  # the latest switch this node heard of
        self.incoming: dict[int, Worker] = {}  # rank -> its incoming process (not yet in place)

    def holds(self, pid: int | None) -> bool:
        """`pid` is an incoming process not yet in its rank's place: its messages wait."""
        return pid is not None and any(w.pid == pid for w in self.incoming.values())

    # ---- the order, and its end without a switch -----------------------------------------
    def on_order(self) -> None:
        """The controller's switch order changed (started or abandoned): act on it."""
        raw = self.kv.try_get(P.SWITCH_KEY)
        if raw is None:
            return
        order = P.SwitchOrder.from_json(raw)
        ended = self.kv.try_get(P.switch_ended_key(order.seq))
        if ended is not None:
            if self.incoming and self.order is not None and self.order.seq == order.seq:
                self._drop(f"the controller abandoned it ({ended.decode(errors='replace')})")
            return
        if self.order is not None and self.order.seq >= order.seq:
            return  # heard of already
        self._drop("a newer switch replaces it")
        self.order = order
        for w in self.workers.of_ranks(order.ranks):
            if not w.alive or w.rank in self.workers.left:
                self._fail(order, f"rank {w.rank} has no running process on node {self.node}")
                return
            self._start(w, order)

    def _start(self, w: Worker, order: P.SwitchOrder) -> None:
        new = Worker(local_rank=w.local_rank, rank=w.rank, spawns=w.spawns)
        self.channel.keep(w.rank, w.pid)  # the pause and the stop still reach the running one
        self.spawner.spawn(new, order.generation, replacement=True)
        self.incoming[w.rank] = new
        self.log.info(
            "switch-incoming",
            f"hot switch #{order.seq}: rank {w.rank}'s new process (pid {new.pid}) starts for "
            f"generation {order.generation}; pid {w.pid} keeps running until the switch",
            rank=w.rank,
            pid=new.pid,
            old_pid=w.pid,
            generation=order.generation,
            seq=order.seq,
        )

    def _fail(self, order: P.SwitchOrder, why: str) -> None:
        """This node cannot take part: the controller abandons the switch (first word wins)."""
        self.kv.compare_set(P.switch_ended_key(order.seq), b"", why.encode())
        self._drop(why)

    def _drop(self, why: str) -> None:
        """Stop every incoming process; the ranks keep their running ones."""
        if not self.incoming:
            return
        gone = list(self.incoming.values())
        self.incoming.clear()
        stop_workers(gone, signal.SIGKILL, 0.0)
        for w in gone:
            self.channel.release(w.rank, promote=False)
            self.kv.delete(P.status_key(w.generation, w.rank))
        self.log.warning(
            "switch-abandoned",
            f"hot switch: the new processes of ranks {[w.rank for w in gone]} are stopped "
            f"({why}); the ranks keep running",
            ranks=[w.rank for w in gone],
            reason=why,
        )

    def on_exit(self, pid: int, code: int) -> bool:
        """A process ended: True when it was an incoming one (the switch is abandoned)."""
        w = next((w for w in self.incoming.values() if w.pid == pid), None)
        if w is None or self.order is None:
            return False
        del self.incoming[w.rank]
        self.channel.release(w.rank, promote=False)
        self.kv.delete(P.status_key(w.generation, w.rank))  # the controller looks for it
        why = (
            f"rank {w.rank}'s new process (pid {pid}) on node {self.node} ended with code {code} "
            "before the switch"
        )
        self.log.warning(
            "switch-abandoned",
            f"{why}; rank {w.rank} keeps running",
            rank=w.rank,
            pid=pid,
            exitcode=code,
        )
        self._fail(self.order, why)
        return True

    # ---- the switch ------------------------------------------------------------------------
    def take_over(self, plan: P.Plan) -> None:
        """Before `plan` is carried out: a hot switch's plan puts the incoming processes in
        their ranks' places (the drained ones stopped); any other plan ends the switch."""
        o = self.order
        if plan.strategy != P.SWITCH or o is None or o.generation != plan.generation:
            self._drop(f"generation {plan.generation} ({plan.strategy}) came first")
            return
        for w in self.workers.of_ranks(plan.restart_ranks):
            new = self.incoming.pop(w.rank, None)
            old_pid = w.pid
            stop_workers([w], signal.SIGKILL, 0.0)  # halted at the boundary: its replicas hold it
            if new is None or not new.alive:  # ended just before: a fresh one joins the round
                self.channel.release(w.rank, promote=False)
                self.workers.aware.discard(w.rank)
                self.spawner.spawn(w, plan.generation, replacement=True)
                new = w
            else:
                self.workers.by_local[w.local_rank] = new
                self.channel.release(w.rank, promote=True)
            self.log.warning(
                "switch-moved",
                f"generation {plan.generation}: rank {w.rank} moved from pid {old_pid} (stopped) "
                f"to pid {new.pid}",
                rank=w.rank,
                pid=new.pid,
                old_pid=old_pid,
                generation=plan.generation,
            )
