"""Driving a published round through its phases, each with a timeout, through the store.

Owns: `RoundDriver`. Restart-all (WAITING_FOR_STOP): wait until every live node stopped its
workers, clear the worker keys, release them (`P.go_key`). Process-level (COLLECTING): collect
every rank's status (one record per node, `StatusCollection`) and write the repair plan
(`repair_planning.plan_repair`); a new fault meanwhile supersedes the round, a lost node's
timeout or waiting agents regroup the world, and missing statuses, peers that finished the job
instead of reporting, or no healthy replica make it fall back (`Decider.fallback`). While the
statuses of a lost node's ranks are missing the phase timeout does not apply:
node_replace_timeout bounds that wait. Dump
(COLLECTING_SURVIVORS): collect the survivors' statuses and write the dying-gasp plan
(`repair_planning.plan_dump`). A stopped controller (deposed, or its agent leaves) leaves the
round as it is: a successor takes it up.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from launcher.control.controller_settings import ControllerSettings
from launcher.control.decider import Decider
from launcher.control.decision import Decision
from launcher.control.fault_intake import FaultIntake
from launcher.control.node_book import NodeBook
from launcher.control.plan_publisher import PlanPublisher
from launcher.control.repair_planning import plan_dump, plan_repair
from launcher.control.round_phase import RoundPhase, RoundTracker
from launcher.control.shrink import after_shrink, members, shrink_plan
from launcher.control.status_collection import StatusCollection
from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from rendezvous.kv import KVStore

# s between two looks at a round's ranks themselves: ranks that finished instead of reporting
# their status, and nodes whose status record is late (their ranks' own keys); O(ranks) each,
# too much for every 0.2 s wait of a long round of thousands of ranks
FINISHED_CHECK_S = 1.0
FIRST_LOOK_S = 0.2  # s from the plan to the first look (a node whose agent does not relay)
# a fault during the round is seen at the end of the status wait's slice: short slices for the
# round's first second (a fast round is one a newer fault must supersede at once, issue 32's
# kill during a recovery), the 0.2 s ones after it (the wait names one key per node)
FAST_SLICE_S, FAST_FOR_S, SLOW_SLICE_S = 0.02, 1.0, 0.2
# s between two reads of the node records that came while the wait goes on (O(nodes) keys):
# parsed as they come, the last record leaves little to parse on the round's path
TAKE_ARRIVED_S = 0.1


def status_slice(elapsed: float) -> float:
    """Seconds the status wait blocks for, `elapsed` s into the round (see FAST_SLICE_S)."""
    return FAST_SLICE_S if elapsed < FAST_FOR_S else SLOW_SLICE_S


# the repair plan of a round the controller starts itself: (plan, statuses, world) -> repair
OwnRepair = Callable[[P.Plan, list[P.RankStatus], list[int]], P.RepairPlan]


class RoundDriver:
    def __init__(
        self,
        kv: KVStore,
        log: AgentLog,
        settings: ControllerSettings,
        rounds: RoundTracker,
        intake: FaultIntake,
        decider: Decider,
        nodes: NodeBook,
        publisher: PlanPublisher,
        overdue: Callable[[], Decision | None],
        stopped: threading.Event,
    ) -> None:
        self.kv, self.log, self.settings, self.rounds = kv, log, settings, rounds
        self.intake, self.decider, self.nodes, self.publisher = intake, decider, nodes, publisher
        self.overdue = overdue  # a lost node's timeout or waiting agents (WorldChanges)
        self.stopped = stopped
        self.dropped = decider.dropped  # ranks live shrinks removed (elastic-training)
        # a lost node's live shrink that cannot be made: what follows instead (the shrink by
        # restart-all in a new rendezvous round, or the exit; WorldChanges.unreplaced)
        self.node_fallback: Callable[[P.Fault, str], Decision] | None = None
        # the repair plan of the controller's own rounds, by strategy (a grow round's:
        # launcher.control.grow GrowBack.repair; a hot switch's: launcher.control.hot_switch),
        # set by the controller
        self.own_repairs: dict[str, OwnRepair] = {}

    # ---- restart-all ---------------------------------------------------------------------
    def release_restart_all(self, g: int) -> None:
        timeout = self.settings.phase_timeout
        deadline = time.monotonic() + timeout
        while not self.kv.wait([P.all_stopped_key(g)], 0.05):
            need = self.nodes.live_nodes()
            raw = self.kv.try_get(P.stopped_key(g))
            if raw is not None and int(raw) >= need:
                break
            if self.stopped.is_set():
                return  # stopped (deposed, or its agent leaves): a successor releases it
            if time.monotonic() > deadline:
                self.log.error(
                    "phase-timeout",
                    f"generation {g}: not every node stopped its workers "
                    f"within {timeout:.0f}s; releasing anyway",
                    round_phase=self.rounds.phase.value,
                )
                break
        n = self.kv.clear_except(P.ROOT + "/")
        self.dropped.clear()  # every rank of the job starts again
        self.kv.set(P.go_key(g), b"1")
        self.rounds.advance(g, RoundPhase.DONE)
        self.publisher.outcome(g, "restarted (restart-all)")
        self.log.info(
            "restart-all-go",
            f"generation {g}: all nodes stopped; cleared {n} worker keys; workers restart",
            generation=g,
            cleared=n,
            round_phase=self.rounds.phase.value,
        )

    # ---- process-level -------------------------------------------------------------------
    def drive_repair(self, plan: P.Plan) -> Decision | None:
        """Collect every rank's status, then write the repair plan. Returns what must follow
        (a fault that superseded the round, a change of the world, its fallback), None when
        the round is in the workers' hands (or this controller stopped). The statuses come
        one record per node (`StatusCollection`: the wait, re-sent every 0.02 s for the
        round's first second and every 0.2 s after it, names one key per node; a newer fault
        is read between two waits); a node whose record is late is read from its ranks' own
        keys at the first look and then once a second, with the look for ranks that finished
        instead (only the ranks still without a status); the records that came meanwhile
        are parsed every TAKE_ARRIVED_S."""
        g = plan.generation
        ranks = members(self.settings.world_size, self.dropped, plan)
        statuses = StatusCollection(self.kv, g, ranks, self.settings.node_of)
        t0 = time.monotonic()
        deadline = t0 + self.settings.phase_timeout
        look_at = t0 + FIRST_LOOK_S
        take_at = t0 + TAKE_ARRIVED_S
        while not statuses.wait(status_slice(time.monotonic() - t0)):
            newer = self.intake.take(0.0)
            if newer is not None:
                d = self.decider.decide(newer)
                if not d.absorbed:
                    return d
                continue
            overdue = self.overdue()
            if overdue is not None:
                return overdue
            if self.stopped.is_set():
                return None  # stopped (deposed, or its agent leaves): a successor takes it up
            if time.monotonic() >= take_at:
                take_at = time.monotonic() + TAKE_ARRIVED_S
                if statuses.take_arrived():
                    break
            if time.monotonic() >= look_at:
                look_at = time.monotonic() + FINISHED_CHECK_S
                if statuses.look():
                    break
                gone = self.finished_without_status(g, plan.failed_ranks, statuses.waiting())
                if gone:
                    return self.decider.fallback(
                        g,
                        f"ranks {gone} finished the job instead of reporting "
                        "their status (the stop came after their last step)",
                    )
            if time.monotonic() > deadline:
                missing = statuses.missing()
                if self.nodes.waiting_for_node(missing):
                    continue  # node_replace_timeout bounds this wait (WorldChanges.unreplaced)
                self.log.error(
                    "phase-timeout",
                    f"generation {g}: ranks {missing} did not report "
                    f"within {self.settings.phase_timeout:.0f}s",
                    round_phase=self.rounds.phase.value,
                )
                return self.decider.fallback(g, f"ranks {missing} did not report status")
        return self._write_repair(plan, ranks, statuses.statuses(), t0)

    def _write_repair(
        self, plan: P.Plan, ranks: list[int], statuses: list[P.RankStatus], t0: float
    ) -> Decision | None:
        """Every status is in: the repair plan (COLLECTING ends: DONE, or FELL_BACK when the
        plan names a fallback, whose decision is returned). After a live shrink every plan
        names the world (`RepairPlan.world`); an elastic-training round's is the shrink's."""
        g = plan.generation
        s = self.settings
        repair = plan_repair(statuses, g, s.transfer_stripes, s.node_of)
        if plan.strategy == P.ELASTIC:
            repair = shrink_plan(repair, statuses, ranks)
            if not repair.fallback:
                self._shrunk(plan, ranks)
        elif plan.strategy in self.own_repairs:
            repair = self.own_repairs[plan.strategy](plan, statuses, ranks)
        elif self.dropped and not repair.fallback:
            repair = after_shrink(repair, ranks)
        self.kv.set(P.repair_key(g), repair.to_json())
        self.rounds.advance(g, RoundPhase.FELL_BACK if repair.fallback else RoundPhase.DONE)
        self.log.info(
            "repair-plan",
            f"generation {g}: resume at step {repair.resume_step} "
            f"({repair.action}); transfers {repair.pairs or 'none'}"
            + (f"; fallback {repair.fallback}: {repair.reason}" if repair.fallback else ""),
            generation=g,
            resume_step=repair.resume_step,
            action=repair.action,
            pairs=repair.pairs,
            fallback=repair.fallback,
            world=repair.world or None,
            status_wait_s=round(time.monotonic() - t0, 4),
            round_phase=self.rounds.phase.value,
        )
        if repair.fallback:
            rnd = self.rounds.round
            if (  # a lost node's: no agent there restarts its ranks, the world regroups
                plan.strategy == P.ELASTIC
                and rnd is not None
                and rnd.cause.rank is None
                and rnd.cause.evidence.get("node_lost")
                and self.node_fallback is not None
            ):
                return self.node_fallback(rnd.cause, repair.reason or "no live shrink")
            return self.decider.fallback(g, repair.reason or "no healthy replica")
        self.publisher.outcome(g, "recovered")
        return None

    def _shrunk(self, plan: P.Plan, ranks: list[int]) -> None:
        self.dropped |= set(plan.failed_ranks)
        self.publisher.save()  # a successor knows the world is shrunk (handoff)
        before = self.settings.world_size - len(self.dropped) + len(plan.failed_ranks)
        self.log.warning(
            "world-shrink",
            f"generation {plan.generation}: ranks {plan.failed_ranks} leave the world, the "
            f"others continue live: world size {before} -> {len(ranks)} (elastic-training)",
            generation=plan.generation,
            strategy=plan.strategy,
            dropped=sorted(self.dropped),
            world=ranks,
            world_size=before,
            new_world_size=len(ranks),
        )

    def finished_without_status(
        self, g: int, failed: list[int], among: list[int] | None = None
    ) -> list[int]:
        """Ranks of generation `g`'s round that finished the job without reporting a status:
        they never will. `among`: the ranks whose status is not in hand (only their finished
        marks are read: late in a round of thousands of ranks, a few nodes' ranks), else all."""
        return [
            r
            for r in self.decider.finished_ranks(among=among)
            if r not in failed and self.kv.try_get(P.status_key(g, r)) is None
        ]

    # ---- dump ----------------------------------------------------------------------------
    def drive_dump(self, plan: P.Plan) -> None:
        """Survivors report, then save the current step (the runtime's dump fallback) and exit."""
        g = plan.generation
        live = [
            r
            for r in range(self.settings.world_size)
            if r not in plan.failed_ranks and r not in self.dropped
        ]
        keys = [P.status_key(g, r) for r in live]
        self._wait_survivors(g, plan.failed_ranks, keys)
        statuses = [P.RankStatus.from_json(raw) for raw in self.kv.present(keys) if raw]
        repair = plan_dump(statuses, g)
        self.kv.set(P.repair_key(g), repair.to_json())
        self.rounds.advance(g, RoundPhase.DONE)
        self.log.info(
            "dump-plan",
            f"generation {g}: survivors save step {repair.resume_step} and exit",
            generation=g,
            resume_step=repair.resume_step,
            writers=repair.writers,
            round_phase=self.rounds.phase.value,
        )

    def _wait_survivors(self, g: int, failed: list[int], keys: list[str]) -> None:
        """Until every survivor reported, some finished the job instead, or the phase timeout."""
        timeout = self.settings.phase_timeout
        deadline = time.monotonic() + timeout
        while not self.kv.wait(keys, 0.2):
            gone = self.finished_without_status(g, failed)
            if gone:
                self.log.error(
                    "dump-incomplete",
                    f"generation {g}: ranks {gone} finished the job "
                    "instead of reporting their status; the dying-gasp checkpoint "
                    "has the other survivors' state only",
                    finished_ranks=gone,
                )
                return
            if time.monotonic() > deadline:
                self.log.error(
                    "phase-timeout",
                    f"generation {g}: survivors did not report within "
                    f"{timeout:.0f}s; the dying-gasp checkpoint may be "
                    "incomplete",
                    round_phase=self.rounds.phase.value,
                )
                return
