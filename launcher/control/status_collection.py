"""Collecting a process-level round's rank statuses, one record per node.

Owns: `StatusCollection`: the statuses of generation g's round, gathered by node. Each agent
speaks for its ranks: once every local rank of the round posted its `RankStatus`, it posts
them together under `P.node_statuses_key(g, node)` (`launcher.agent.status_relay`). The
controller waits on those keys, one per node of the round (`wait`), so a wait re-sent while
the round lasts costs O(nodes), not O(ranks), and the statuses come in one read per node
record instead of one key per rank. A node whose record is late or does not name every member
rank of that node (an agent that cannot relay: its store calls failed, a rank it does not know)
is read from its ranks' own keys instead (`look`, at the caller's cadence: one CHECK of every
such rank, then one read). Records that came while the wait goes on are parsed at the
caller's cadence too (`take_arrived`), so the last record's arrival leaves one or a few to
parse, not the round's thousands of statuses. `missing` names the ranks without a status (the
phase timeout's message).
"""

from __future__ import annotations

from typing import Callable

from launcher.protocol import plan as P
from rendezvous.kv import KVStore

RECORD_READ_TIMEOUT = 5.0  # s: reading keys a WAIT or CHECK just found


class StatusCollection:
    """Generation `generation`'s statuses of `ranks` (the round's members), gathered by node
    (`node_of`: rank -> node)."""

    def __init__(
        self, kv: KVStore, generation: int, ranks: list[int], node_of: Callable[[int], int]
    ) -> None:
        self.kv, self.generation = kv, generation
        self.ranks = list(ranks)
        self.of_node: dict[int, list[int]] = {}
        for r in self.ranks:
            self.of_node.setdefault(node_of(r), []).append(r)
        self.pending: set[int] = set(self.of_node)  # nodes whose record is awaited
        self.by_rank: set[int] = set()  # nodes whose record came without every member
        self.got: dict[int, P.RankStatus] = {}

    @property
    def done(self) -> bool:
        return not self.pending and not self.by_rank

    def _keys(self) -> list[str]:
        """What a wait waits on: the awaited records, the ranks' keys of the nodes read so."""
        g = self.generation
        return [P.node_statuses_key(g, n) for n in sorted(self.pending)] + self._rank_keys(
            self.by_rank
        )

    def _rank_keys(self, nodes: set[int]) -> list[str]:
        g = self.generation
        return [P.status_key(g, r) for n in sorted(nodes) for r in self.of_node[n]]

    def wait(self, timeout: float) -> bool:
        """Until every node's statuses are in (True: then read), or `timeout` s."""
        if self.done:
            return True
        if not self.kv.wait(self._keys(), timeout):
            return False
        waited_by_rank = set(self.by_rank)  # every one of their ranks' keys is in
        nodes = sorted(self.pending)
        keys = [P.node_statuses_key(self.generation, n) for n in nodes]
        # every record is in (the wait found them; records are never empty): one read
        self._take_records(nodes, self.kv.present(keys))
        if waited_by_rank:
            self._take_ranks(waited_by_rank)
        return self.done

    def take_arrived(self) -> bool:
        """The awaited records that came (one read of O(nodes) keys), parsed now rather than
        all at once when the last one comes. True when every status is in."""
        nodes = sorted(self.pending)
        if nodes:
            keys = [P.node_statuses_key(self.generation, n) for n in nodes]
            self._take_records(nodes, self.kv.present(keys))
        return self.done

    def look(self) -> bool:
        """The nodes not in yet: their records that came, then their ranks' own keys (one
        CHECK for all; read when every one is in). True when every status is in."""
        self.take_arrived()
        rest = self.pending | self.by_rank
        if rest and self.kv.check(self._rank_keys(rest)):
            self._take_ranks(rest)
        return self.done

    def _take_ranks(self, nodes: set[int]) -> None:
        """Read the ranks' own keys of `nodes` (every one is in)."""
        raws = self.kv.multi_get(self._rank_keys(nodes), RECORD_READ_TIMEOUT)
        for raw in raws:
            st = P.RankStatus.from_json(raw)
            self.got[st.rank] = st
        self.pending -= nodes
        self.by_rank -= nodes

    def _take_records(self, nodes: list[int], raws: list[bytes | None]) -> None:
        for node, raw in zip(nodes, raws):
            if raw is None:
                continue
            self.pending.discard(node)
            rec = P.NodeStatuses.from_json(raw)
            by_rank = rec.ranks()
            mine = self.of_node[node]
            if rec.generation != self.generation or any(r not in by_rank for r in mine):
                self.by_rank.add(node)  # its ranks' own keys instead
                continue
            for r in mine:
                self.got[r] = by_rank[r]

    def statuses(self) -> list[P.RankStatus]:
        """Every member's status, in rank order (once `done`)."""
        return [self.got[r] for r in self.ranks]

    def waiting(self) -> list[int]:
        """The members whose status is not in hand (their nodes' records not taken yet), read
        from nothing: the ranks a look at finished ranks needs to ask about."""
        return [r for n in sorted(self.pending | self.by_rank) for r in self.of_node[n]]

    def missing(self) -> list[int]:
        """The members without a status yet (their own keys read)."""
        todo = self.waiting()
        raws = self.kv.present([P.status_key(self.generation, r) for r in todo])
        return [r for r, raw in zip(todo, raws) if raw is None]
