"""The controller's questions to `launcher.control.decision`, and their log lines.

Owns: `Decider`: the `Situation` a decision depends on besides the fault (the chain, the restart
budget, whether every rank uses launcher.runtime, the round in progress, the ranks done with the
job, the ranks live shrinks dropped, the live nodes), deciding one fault (`decide`: logged
`fault-absorbed`, `round-superseded` or `decide`, and
`peers-finished` when ranks done with the job cut the chain) and the fallback of a round that
cannot complete (`fallback`, logged `fallback`). The ranks done with the job are the ones whose
agents set `P.finished_key` from a process at least as new as the plan that last started the
rank (`note_spawns`): an earlier process's mark is stale. The rules live in `decision`, nowhere
else.
"""

from __future__ import annotations

import time
from typing import Callable

from launcher.control.controller_settings import ControllerSettings
from launcher.control.controller_state import ControllerState
from launcher.control.decision import Decision, Situation, decide, fallback
from launcher.control.round_phase import RoundTracker
from launcher.control.shrink_replicas import whole_replicas
from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from rendezvous.kv import KVStore

AWARE_LOOK_S = 5.0  # s between the idle controller's looks at the aware keys (`Decider.prime`)


class Decider:
    def __init__(
        self,
        kv: KVStore,
        log: AgentLog,
        settings: ControllerSettings,
        state: ControllerState,
        rounds: RoundTracker,
    ) -> None:
        self.kv, self.log, self.settings = kv, log, settings
        self.state = state  # the budget and the generation
        self.rounds = rounds
        # rank -> generation of the latest plan that started a new process for it: a finished
        # mark from an earlier process of the rank (`finished_ranks`) is stale
        self.spawned_at: dict[int, int] = {}
        # every rank said hello once (aware keys are only ever added): asked no more
        self._all_aware = False
        self._aware_asked_at = -AWARE_LOOK_S  # monotonic s of the idle loop's last ask
        # the finished marks' keys, built once (one request names every rank's)
        self._finished_keys = [P.finished_key(r) for r in range(settings.world_size)]
        # ranks live shrinks removed from the world (elastic-training): the round driver
        # and the grow back change this set, the saved state keeps it (handoff)
        self.dropped: set[int] = set()
        self.live_nodes: Callable[[], int] | None = None  # the node book's, set by the controller

    def note_spawns(self, plan: P.Plan) -> None:
        for r in plan.restart_ranks:  # every rank for restart-all
            self.spawned_at[r] = plan.generation

    def all_aware(self) -> bool:
        # one request, not one per rank; once true it stays true (a rank's aware key is set at
        # its hello and never deleted: a respawned rank says hello again)
        if not self._all_aware:
            keys = [P.aware_key(r) for r in range(self.settings.world_size)]
            self._all_aware = self.kv.check(keys)
        return self._all_aware

    def prime(self) -> None:
        """The idle controller's look at the aware keys (at most every AWARE_LOOK_S s until
        every rank said hello), so that the first fault's decision does not read them: one
        CHECK of every rank's key is O(ranks), on the round's path otherwise."""
        now = time.monotonic()
        if not self._all_aware and now - self._aware_asked_at >= AWARE_LOOK_S:
            self._aware_asked_at = now
            self.all_aware()

    def situation(self, fault: P.Fault | None = None) -> Situation:
        return Situation(
            self.settings.chain,
            self.state.budget,
            self.all_aware(),
            self.settings.world_size,
            self.rounds.round,
            self.finished_ranks(fault),
            tuple(sorted(self.dropped)),
            None if self.live_nodes is None else self.live_nodes(),
            self.settings.fewest_nodes,
        )

    def finished_ranks(
        self, fault: P.Fault | None = None, among: list[int] | None = None
    ) -> tuple[int, ...]:
        """Ranks whose current process is done with the job (`P.finished_key`, set by their
        agents), with the ones `fault`'s agent saw finished when it reported (its evidence; it
        may be ahead of the store). `among`: only these ranks' marks are read (a round's
        ranks still without a status), else every rank's."""
        out = set()
        # one request for every rank's mark (not a listing of every key in the store: that
        # grows with the rounds)
        world = self.settings.world_size
        if among is None:
            ranks, keys = list(range(world)), self._finished_keys
        else:
            ranks = [r for r in among if 0 <= r < world]
            keys = [self._finished_keys[r] for r in ranks]
        for rank, raw in zip(ranks, self.kv.present(keys) if keys else []):
            if raw is None:
                continue
            try:
                gen = int(raw)
            except ValueError:
                continue
            if gen >= self.spawned_at.get(rank, 0):
                out.add(rank)
        if fault is not None and fault.generation >= self.state.generation:
            out.update(int(r) for r in fault.evidence.get("finished_ranks") or ())
        return tuple(sorted(r for r in out if 0 <= r < self.settings.world_size))

    def decide(self, fault: P.Fault) -> Decision:
        """The decision about one reported fault, logged."""
        # a live shrink drops whole data-parallel replicas (a lost rank's TP/PP peers too)
        d = whole_replicas(decide(fault, self.situation(fault)), self.kv, self.settings.world_size)
        if d.peers_finished and not d.absorbed:
            self.log_peers_finished(fault, d)
        if d.absorbed:
            self.log.info(
                "fault-absorbed",
                f"fault of rank {fault.rank} ({fault.kind}) from "
                f"generation {fault.generation}: {d.reason}",
                rank=fault.rank,
                fault_kind=fault.kind,
            )
        elif d.supersedes is not None:  # one event for it (events.jsonl readers rely on that)
            self._log_superseded(fault, d)
        else:
            self._log_decided(fault, d)
        return d

    def _log_superseded(self, fault: P.Fault, d: Decision) -> None:
        what = (
            f"rank {fault.rank} failed ({fault.kind})"
            if fault.rank is not None
            else f"node {fault.node} "
            + ("taken over" if fault.evidence.get("node_joined") else "lost")
        )
        self.log.warning(
            "round-superseded",
            f"generation {d.supersedes}: {what} during recovery; starting a new round ({d.reason})",
            rank=fault.rank,
            fault_kind=fault.kind,
            strategy=d.strategy,
            reason=d.reason,
            round_phase=self.rounds.phase.value,
        )

    def _log_decided(self, fault: P.Fault, d: Decision) -> None:
        label = " [injected]" if fault.injected else ""
        who = (
            f"rank {fault.rank} {fault.kind}"
            if fault.rank is not None
            else f"no rank, {fault.kind}"
        )
        self.log.info(
            "decide",
            f"fault: {who}{label} on node {fault.node} -> {d.strategy} ({d.reason})",
            rank=fault.rank,
            fault_kind=fault.kind,
            strategy=d.strategy,
            reason=d.reason,
            injected=fault.injected,
        )

    def log_peers_finished(self, fault: P.Fault, d: Decision, g: int | None = None) -> None:
        """One line: the root cause first, then why no process-level round can repair it
        (`g`: the round whose survivors finished meanwhile)."""
        who = f"rank {fault.rank}" if fault.rank is not None else f"node {fault.node}"
        when = "" if g is None else f" during generation {g}'s recovery round"
        self.log.warning(
            "peers-finished",
            f"{who} (generation {fault.generation}) failed: "
            f"{fault.kind}: {fault.message}; its peers {list(d.peers_finished)} "
            f"finished the job{when}, so process-level repair is impossible: "
            f"{d.strategy}",
            rank=fault.rank,
            fault_kind=fault.kind,
            generation=fault.generation,
            round=g,
            finished_ranks=list(d.peers_finished),
            strategy=d.strategy,
        )

    def fallback(self, g: int, reason: str) -> Decision:
        """Peer repair impossible in generation `g`'s round: the decision's fallback rule picks
        what follows."""
        d = fallback(self.situation(), reason)
        rnd = self.rounds.round
        if d.peers_finished and rnd is not None:
            self.log_peers_finished(rnd.cause, d, g)
        self.log.warning(
            "fallback",
            f"generation {g}: peer recovery impossible ({reason}); falling back to {d.strategy}",
            strategy=d.strategy,
            reason=reason,
            round_phase=self.rounds.phase.value,
        )
        return d
