"""Taking over a running world: a replacement for a lost node, and the hot spare's wait.

Owns: `Replacing`, the part of `rendezvous.nodes.membership.Membership` that runs when this
agent arrives after the world closed (`_rejoin`): a static agent takes its node rank back once
its holder is dead (`_try_claim` with judge); a dynamic one claims a vacant group rank
(`_vacancies`: none with scale_up=restart) or waits as a hot spare (`_wait_as_spare`: visible
under `keys.spare_key` until a node is lost, a new round opens, the run finishes, stop, or
spare_timeout); either way it enters the world it took a place in (`_replaced`).
"""

from __future__ import annotations

import logging
import time

from rendezvous.errors import NodeLostError, RendezvousError, RendezvousGracefulExit
from rendezvous.kv import StoreError
from rendezvous.nodes import rounds
from rendezvous.nodes.keys import spare_key
from rendezvous.nodes.member_state import MemberState
from rendezvous.nodes.world import NodeWorld, node_world

log = logging.getLogger("ftrun.membership")


class Replacing(MemberState):
    """Replacement and hot-spare joins (see the module docstring). A mixin of `Membership`,
    whose state it uses; `_find_world`, `_record` and `_register` come from `Joining`."""

    def _rejoin(self, world: dict, deadline: float) -> NodeWorld:
        if world.get("run_id", self.run_id) != self.run_id:
            raise RendezvousError(f"store holds the world of run {world.get('run_id')!r}")
        n = len(world["nodes"])
        if not self.static:
            for gr in self._vacancies(n):
                if self._try_claim(gr, deadline, judge=False):
                    return self._replaced(world, gr)
            return self._wait_as_spare(world)
        assert self.node_rank is not None
        if self.node_rank >= n:
            raise RendezvousError(
                f"node_rank {self.node_rank} is not in the running world of {n} nodes"
            )
        while True:
            if self._try_claim(self.node_rank, deadline, judge=True):
                return self._replaced(world, self.node_rank)
            if time.monotonic() >= deadline:
                break
            self._interrupt.sleep(min(self.timing.interval, max(0.0, deadline - time.monotonic())))
            self._interrupt.check("rendezvous")
        raise RendezvousError(
            f"cannot join run {self.run_id}: node rank {self.node_rank} is "
            "still alive (a replacement only joins in place of a lost node)"
        )

    def _wait_as_spare(self, world: dict) -> NodeWorld:
        """No vacancy: wait as a hot spare, visible under keys.spare_key, until a node is lost
        (claim its rank), the run finishes, stop, or spare_timeout."""
        ranks = list(range(len(world["nodes"])))
        key, rec = spare_key(self.nonce), self._record().to_json()
        self.liveness.put_spare(key, rec)
        log.info(
            "run %s is running with %d nodes: %s waits as a hot spare %s",
            self.run_id,
            len(ranks),
            self.host,
            "for the next lost node"
            if self.rdzv.scale_up == "spare"
            else "for a new rendezvous round (scale_up=restart)",
        )
        end = (
            None if self.rdzv.spare_timeout is None else time.monotonic() + self.rdzv.spare_timeout
        )
        try:
            while True:
                self._interrupt.check("waiting as a hot spare")
                if self.lost.is_set():
                    raise self.lost_error() or NodeLostError("lost while a spare", "")
                for gr in self._vacancies(len(ranks)):
                    if self._try_claim(gr, 0.0, judge=False):
                        log.info("hot spare %s takes over node %d", self.host, gr)
                        return self._replaced(world, gr, from_spare=True)
                doc = rounds.pending(self.kv, int(world.get("round", 0)))
                if doc is not None:
                    log.info("%s joins rendezvous round %d", self.host, doc["round"])
                    self._round_opened = int(doc["round"])
                    return self._find_world(
                        time.monotonic() + self.rdzv.join_timeout, self.rdzv.join_timeout
                    )
                if self.liveness.all_done(ranks):
                    raise RendezvousGracefulExit(
                        f"run {self.run_id} finished while this agent waited as a hot spare"
                    )
                if end is not None and time.monotonic() >= end:
                    raise RendezvousError(
                        f"no node of run {self.run_id} was lost within "
                        f"spare_timeout={self.rdzv.spare_timeout:g}s; this hot "
                        "spare gives up"
                    )
                if not self.can_elect:
                    self.liveness.put_spare(key, rec)  # refresh its time (no lease here)
                self._interrupt.sleep(self.timing.interval)
        finally:
            try:
                self.kv.delete(key)
            except StoreError:
                pass  # leased on etcd: it goes with the lease

    def _vacancies(self, n: int) -> list[int]:
        """Ranks a late dynamic agent may claim: none with scale_up=restart (it waits for a
        new round instead)."""
        return self.liveness.vacancies(list(range(n))) if self.rdzv.scale_up == "spare" else []

    def _try_claim(self, gr: int, deadline: float, judge: bool) -> bool:
        """Take over group rank `gr` if its current holder is dead. With `judge`, give the
        holder up to one heartbeat timeout to be found dead."""
        patience = (
            min(
                max(0.0, deadline - time.monotonic()),
                self.timing.timeout + 2 * self.timing.interval,
            )
            if judge
            else 0.0
        )
        replacing = self.liveness.wait_vacant(gr, patience, judge)
        return replacing is not None and self._register(gr, replacing)

    def _replaced(self, world: dict, gr: int, from_spare: bool = False) -> NodeWorld:
        nw = node_world(world, gr, True, self.run_id)
        nw.from_spare = from_spare
        me = nw.me
        me.host, me.pid, me.incarnation = self.host, self.pid, self.incarnation
        me.hosts_store = self.hosts_store
        nw.generation = self.current_generation()
        ranks = [node.node_rank for node in nw.nodes]
        alive = self.liveness.survey(ranks, gr)
        nw.leader_node = self.liveness.roster.reset(alive, ranks)
        self.liveness.announce_join(gr, self.incarnation)
        log.info(
            "%s took node %d (incarnation %d)",
            "hot spare" if from_spare else "replacement agent",
            gr,
            self.incarnation,
        )
        return nw
