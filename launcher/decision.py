"""The recovery decision: what happens after a fault, decided in one place.

Owns: `decide()` and `fallback()`, pure functions the controller calls and then executes, and the
types they speak: `Situation` (the strategy chain, the restart `Budget`, whether every rank uses
launcher.runtime, the world size and the `Round` in progress) and `Decision` (absorb the report,
or start a new round: strategy, reason, root cause, failed ranks, ranks to restart, whether the
round counts against the budget). No store, no clock, no logging here.

The rules, in the order `decide()` applies them (tests/test_decision.py has a test for each):
  1. absorbed: a report from before the round in progress that the round already covers (a
     bystander of a restart-all/dump/exit, the failed rank reported twice) starts nothing. A
     replacement agent's arrival is never absorbed: it needs the round that starts its ranks.
  2. the chain: walk the user's strategy chain (cheapest first) and take the first strategy that
     can handle the fault's kind, naming every strategy skipped and why (`walk_chain`):
     - retry only for kinds after which the process is healthy (UCE, network, unsafe data), and
       not on a device that had a second UCE within 24 h;
     - unmodified workers (some rank does not use launcher.runtime) get torchrun's semantics:
       restart-all or exit;
     - retry, recover-in-place and restart-all need restart budget left.
  3. node loss: a fault without a rank (a node's agent was lost and replaced) cannot be handled
     by a process-level strategy: every rank restarts (or the job ends).
  4. superseded: a fault while a process-level round still collects the ranks' statuses widens
     that round: the failed ranks accumulate, retry is off (the ranks are mid-recovery, the new
     one restarts), and only the new failed rank restarts (earlier replacements keep running).
     A report from an older generation of another rank joins the round in progress as its cause.
  5. fallback (`fallback()`): when a process-level round cannot complete (no healthy replica,
     ranks that never reported), the first strategy after the process-level ones takes over;
     it is the same round for the budget, so it is not charged again.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from launcher import plan as P
from launcher.faults import IN_PLACE_KINDS, FaultKind

PROCESS_LEVEL = (P.RETRY, P.RECOVER_IN_PLACE)  # the ranks that did not fail keep running
CHARGED = (P.RETRY, P.RECOVER_IN_PLACE, P.RESTART_ALL)  # rounds that use the restart budget


@dataclass(frozen=True)
class Budget:
    """`--max_restarts`: recovery rounds allowed for the whole job, and how many were used."""

    used: int
    limit: int

    @property
    def left(self) -> bool:
        return self.used < self.limit

    def charge(self) -> "Budget":
        return dataclasses.replace(self, used=self.used + 1)


@dataclass(frozen=True)
class Round:
    """The recovery round in progress: the controller's latest plan and how far it got."""

    generation: int
    strategy: str
    failed_ranks: tuple[int, ...]
    cause: P.Fault
    collecting: bool = False  # a process-level round still waiting for every rank's status


@dataclass(frozen=True)
class Situation:
    """Everything a decision depends on besides the fault."""

    chain: tuple[str, ...]
    budget: Budget
    runtime_aware: bool  # every rank said hello: all use launcher.runtime
    world_size: int
    round: Round | None = None


@dataclass(frozen=True)
class Decision:
    """What the controller does: nothing (absorbed) or a new round."""

    strategy: str | None  # None: the report is absorbed by the round in progress
    reason: str
    cause: P.Fault | None = None  # the root cause the new round records
    failed_ranks: tuple[int, ...] = ()
    restart_ranks: tuple[int, ...] = ()
    charged: bool = False  # counts against the restart budget
    supersedes: int | None = None  # the generation of the collecting round this one widens

    @property
    def absorbed(self) -> bool:
        return self.strategy is None


def can_handle(strategy: str, kind: FaultKind, runtime_aware: bool) -> tuple[bool, str]:
    """Whether `strategy` can handle `kind`; the reason when it cannot."""
    if strategy == P.RETRY:
        if not runtime_aware:
            return False, "retry needs every rank to use launcher.runtime"
        if kind not in IN_PLACE_KINDS:
            return False, f"retry handles {', '.join(sorted(k.value for k in IN_PLACE_KINDS))}, not {kind.value}"
        return True, "process stays alive; state repaired in place"
    if strategy == P.RECOVER_IN_PLACE:
        if not runtime_aware:
            return False, "recover-in-place needs every rank to use launcher.runtime"
        return True, "restart only the failed rank and repair it from a replica"
    if strategy == P.RESTART_ALL:
        return True, "restart every worker (from the last checkpoint)"
    if strategy == P.DUMP:
        if not runtime_aware:
            return False, "dump needs every rank to use launcher.runtime"
        return True, "survivors save the current step, then the job exits"
    if strategy == P.EXIT:
        return True, "stop the job"
    return False, f"unknown strategy {strategy}"


def walk_chain(kind: FaultKind, chain: Sequence[str], runtime_aware: bool, budget_left: bool,
               repeat_uce: bool = False, skipped: Sequence[str] = ()) -> tuple[str, str]:
    """Walk `chain` and return (strategy, one-line reason, naming every skipped strategy).

    `repeat_uce`: the device had a second UCE within 24 h, so it is not retried in place.
    `skipped`: strategies the caller removed from the chain already, with why."""
    notes = list(skipped)
    chain = list(chain)
    if repeat_uce and P.RETRY in chain:
        chain = [s for s in chain if s != P.RETRY]
        notes.append("retry: second UCE on this device within 24 h")
    if not runtime_aware:
        # Unmodified scripts: process-level strategies do not apply (torchrun semantics).
        chain = [s for s in chain if s in (P.RESTART_ALL, P.EXIT)]
        notes.append("workers do not use launcher.runtime")
    for s in chain:
        if s in CHARGED and not budget_left:
            notes.append(f"{s}: restart budget spent")
            continue
        ok, why = can_handle(s, kind, runtime_aware)
        if ok:
            return s, "; ".join(notes + [why])
        notes.append(f"{s}: {why}")
    return P.EXIT, "; ".join(notes + ["nothing else left: exit"])


def covered_by(fault: P.Fault, rnd: Round | None) -> bool:
    """Rule 1: a late report that the round in progress already covers."""
    if rnd is None or fault.generation >= rnd.generation:
        return False
    if fault.evidence.get("node_joined"):
        return False  # a replacement agent always gets the round that starts its ranks
    if rnd.strategy in (P.RESTART_ALL, P.EXIT, P.DUMP):
        return True
    return fault.rank in rnd.failed_ranks or fault.rank is None


def restart_ranks(strategy: str, ranks: Sequence[int], world_size: int) -> tuple[int, ...]:
    """Who gets a new process: everyone for restart-all, `ranks` for recover-in-place."""
    if strategy == P.RESTART_ALL:
        return tuple(range(world_size))
    if strategy == P.RECOVER_IN_PLACE:
        return tuple(sorted(set(ranks)))
    return ()


def decide(fault: P.Fault, s: Situation) -> Decision:
    """Rules 1-4 of the module docstring for one reported fault."""
    rnd = s.round
    if covered_by(fault, rnd):
        assert rnd is not None
        return Decision(None, f"part of generation {rnd.generation}'s {rnd.strategy} round")
    kind = FaultKind.parse(fault.kind)
    own = () if fault.rank is None else (fault.rank,)
    cause = fault
    if rnd is not None and rnd.strategy in PROCESS_LEVEL and fault.generation < rnd.generation:
        cause = dataclasses.replace(fault, generation=rnd.generation)  # another rank of that round
    collecting = rnd is not None and rnd.collecting
    chain, skipped = list(s.chain), []
    if collecting and P.RETRY in chain and fault.rank is not None:
        chain.remove(P.RETRY)
        skipped.append(f"retry: rank {fault.rank} failed while the ranks were mid-recovery")
    strategy, why = walk_chain(kind, chain, s.runtime_aware, s.budget.left,
                               repeat_uce=bool(fault.evidence.get("repeat_uce")), skipped=skipped)
    if fault.rank is None and strategy in PROCESS_LEVEL:
        strategy, why = walk_chain(kind, [x for x in s.chain if x not in PROCESS_LEVEL], False,
                                   s.budget.left)
        why = f"node {fault.node}: {fault.message}; {why}"
    if not collecting:
        return Decision(strategy, why, cause, own, restart_ranks(strategy, own, s.world_size),
                        charged=strategy in CHARGED)
    assert rnd is not None
    failed = tuple(sorted(set(rnd.failed_ranks) | set(own)))
    return Decision(strategy, why, cause, failed, restart_ranks(strategy, own, s.world_size),
                    charged=strategy in CHARGED, supersedes=rnd.generation)


def fallback(s: Situation, reason: str) -> Decision:
    """Rule 5: the process-level round in progress cannot complete."""
    rnd = s.round
    if rnd is None:
        raise ValueError("fallback() needs the round in progress")
    rest = [x for x in s.chain if x not in PROCESS_LEVEL]
    strategy = rest[0] if rest else P.EXIT
    own = () if rnd.cause.rank is None else (rnd.cause.rank,)
    return Decision(strategy, f"fallback: {reason}", rnd.cause, own,
                    restart_ranks(strategy, own, s.world_size), charged=False)
