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
  3. node loss: a fault without a rank names a node (`node_ranks`: its ranks, in the evidence):
     lost (`node_lost`: its agent is gone) or taken over (`node_joined`: a hot spare or a
     replacement agent arrived). When every rank uses launcher.runtime and recover-in-place is
     in the chain, the node's ranks are the failed ranks and they are repaired from replicas on
     the other nodes: the loss starts a round that stops the survivors and waits for the new
     agent (nobody can start the ranks yet); the arrival starts the round in which the new agent
     starts them (not charged again when the loss's round already was). Unmodified workers keep
     torchrun's semantics: the loss waits (absorbed), the arrival restarts every rank. A node not
     taken over within node_replace_timeout (`unreplaced()`) shrinks the world: live, when the
     chain has elastic-training (`live_node_shrink`: the node's ranks leave the world, the
     survivors on the other nodes continue at the interrupted step, nobody restarts), else by
     restart-all in a new rendezvous round without it; either when the nodes left are at least
     --nnodes MIN, the chain has it and the budget has room (the node-loss round already charged
     counts); otherwise the job ends, saying which of these stopped it. Without recover-in-place
     before elastic-training nothing could start the node's ranks again on a new agent, so the
     live shrink happens at once. After a live shrink (`Situation.dropped`) the node's loss
     changes nothing more, and its new agent (a hot spare or the agent restarted) is absorbed:
     its ranks come back through the live grow back (launcher.control.grow). With --rdzv-conf
     scale_up=restart, agents waiting to get in grow the world the same way (`scale_up()`:
     restart-all in a new round that includes them, not charged, as in torchrun).
  4. superseded: a fault while a process-level round still collects the ranks' statuses widens
     that round: the failed ranks accumulate, retry is off (the ranks are mid-recovery, the new
     one restarts), and only the new failed rank restarts (earlier replacements keep running).
     A report from an older generation of another rank joins the round in progress as its cause.
  5. fallback (`fallback()`): when a process-level round cannot complete (no healthy replica,
     ranks that never reported, peers that finished meanwhile), the first strategy after the
     process-level ones takes over; it is the same round for the budget, so it is not charged
     again.
  6. peers finished (`Situation.finished`, applied within 2, 3 and 5): a rank done with the job
     (it said goodbye after `rt.finish()`, or exited 0) takes part in no round, so when any
     rank other than the failed ones finished, retry, recover-in-place and dump are impossible
     (nobody live to repair from or to save the step): they are skipped at once, saying which
     ranks finished, and the chain goes on to restart-all (torchrun's answer to a failed
     worker: the whole group restarts, from the script's last checkpoint) or exit.

One event, one fault (`merge()`, before `decide()`): reports that may be consequences of another
rank's fault (`may_be_consequence`: a collective that failed or timed out on the reporting rank,
a hang blamed only for going silent first) are held by the controller for a short window; every
report of that window becomes one fault:
  - a report that is not a consequence (an exit, a hang the agent proved, a UCE) is the fault,
    the others its consequences;
  - else `blame()` looks at every rank's progress record: the rank that does not progress while
    its peers wait (its process stopped or stuck, its heartbeats silent, or simply idle while not
    waiting in a collective) is the fault, a `hang` of that rank;
  - else the earliest report is the fault (a real network error), the rest its consequences.
A network report from a generation older than the round in progress is a consequence of that
round's stop (rule 1): it never starts a round.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from launcher.protocol import plan as P
from launcher.protocol.budget import restarts_left
from launcher.protocol.faults import FROZEN_STATES as FROZEN
from launcher.protocol.faults import IN_PLACE_KINDS, FaultKind

# the ranks that did not fail keep running (elastic-training: in a world without the failed
# ranks' replicas, launcher.control.shrink)
# GROW: launcher.control.grow; SWITCH: launcher.control.hot_switch
PROCESS_LEVEL = (P.RETRY, P.RECOVER_IN_PLACE, P.ELASTIC, P.GROW, P.SWITCH)
NEEDS_PEERS = (P.RETRY, P.RECOVER_IN_PLACE, P.ELASTIC, P.DUMP)  # rounds the live peers take part in
CHARGED = (P.RETRY, P.RECOVER_IN_PLACE, P.ELASTIC, P.RESTART_ALL)  # rounds that use the budget


@dataclass(frozen=True)
class Budget:
    """`--max_restarts`: recovery rounds allowed for the whole job, and how many were used."""

    used: int
    limit: int

    @property
    def left(self) -> bool:
        return restarts_left(self.used, self.limit) > 0

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
    finished: tuple[int, ...] = ()  # ranks done with the job: they take part in no round (rule 6)
    dropped: tuple[int, ...] = ()  # ranks live shrinks removed from the world (elastic-training)
    nodes_left: int | None = None  # live nodes (None: not known; no --nnodes MIN check)
    min_nodes: int = 1  # --nnodes MIN: the fewest nodes a lost node may shrink the world to


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
    continues: bool = False  # a fallback: the same fault's handling goes on (history)
    shrink: bool = False  # restart-all in a new rendezvous round without the lost node(s)
    grow: bool = False  # restart-all in a new rendezvous round with the waiting nodes (scale-up)
    peers_finished: tuple[int, ...] = ()  # rule 6 cut the chain: these peers had finished

    @property
    def absorbed(self) -> bool:
        return self.strategy is None


def can_handle(strategy: str, kind: FaultKind, runtime_aware: bool) -> tuple[bool, str]:
    """Whether `strategy` can handle `kind`; the reason when it cannot."""
    if strategy == P.RETRY:
        if not runtime_aware:
            return False, "retry needs every rank to use launcher.runtime"
        if kind not in IN_PLACE_KINDS:
            kinds = ", ".join(sorted(k.value for k in IN_PLACE_KINDS))
            return False, f"retry handles {kinds}, not {kind.value}"
        return True, "process stays alive; state repaired in place"
    if strategy == P.RECOVER_IN_PLACE:
        if not runtime_aware:
            return False, "recover-in-place needs every rank to use launcher.runtime"
        return True, "restart only the failed rank and repair it from a replica"
    if strategy == P.ELASTIC:
        if not runtime_aware:
            return False, "elastic-training needs every rank to use launcher.runtime"
        return True, "the failed rank's replica leaves; the others go on in a smaller world"
    if strategy == P.RESTART_ALL:
        return True, "restart every worker (from the last checkpoint)"
    if strategy == P.DUMP:
        if not runtime_aware:
            return False, "dump needs every rank to use launcher.runtime"
        return True, "survivors save the current step, then the job exits"
    if strategy == P.EXIT:
        return True, "stop the job"
    return False, f"unknown strategy {strategy}"


def walk_chain(
    kind: FaultKind,
    chain: Sequence[str],
    runtime_aware: bool,
    budget_left: bool,
    repeat_uce: bool = False,
    skipped: Sequence[str] = (),
) -> tuple[str, str]:
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


def without_finished(
    chain: Sequence[str], finished: Sequence[int], failed: Sequence[int]
) -> tuple[list[str], list[str], tuple[int, ...]]:
    """Rule 6: `chain` without the strategies the finished peers would have to take part in.
    Returns (chain left, one note per strategy removed, the finished peers)."""
    peers = tuple(sorted(set(finished) - set(failed)))
    if not peers:
        return list(chain), [], ()
    what = f"ranks {list(peers)} already finished the job"
    notes = [
        f"{x}: {what}, "
        + (
            "no live survivor to save the current step"
            if x == P.DUMP
            else "no live peer to repair from"
        )
        for x in chain
        if x in NEEDS_PEERS
    ]
    return [x for x in chain if x not in NEEDS_PEERS], notes, peers


def covered_by(fault: P.Fault, rnd: Round | None) -> bool:
    """Rule 1: a late report that the round in progress already covers."""
    if rnd is None or fault.generation >= rnd.generation:
        return False
    if fault.evidence.get("node_joined") or fault.evidence.get("node_lost"):
        return False  # a node's loss and its new agent always get a round of their own
    if rnd.strategy in (P.RESTART_ALL, P.EXIT, P.DUMP):
        return True
    if FaultKind.parse(fault.kind) == FaultKind.NETWORK:
        return True  # a peer's collective broken by the round's own stop
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
        why = (
            "a consequence of the stop of generation "
            if fault.kind == FaultKind.NETWORK.value
            else "part of generation "
        )
        return Decision(None, f"{why}{rnd.generation}'s {rnd.strategy} round")
    kind = FaultKind.parse(fault.kind)
    own = () if fault.rank is None else (fault.rank,)
    cause = fault
    if rnd is not None and rnd.strategy in PROCESS_LEVEL and fault.generation < rnd.generation:
        cause = dataclasses.replace(fault, generation=rnd.generation)  # another rank of that round
    collecting = rnd is not None and rnd.collecting
    if fault.rank is None and node_ranks(fault):
        return _node_decision(fault, s)
    failed = tuple(
        sorted(set(rnd.failed_ranks if collecting and rnd is not None else ()) | set(own))
    )
    chain, skipped, peers = without_finished(s.chain, s.finished, failed)
    if collecting and P.RETRY in chain and fault.rank is not None:
        chain.remove(P.RETRY)
        skipped.append(f"retry: rank {fault.rank} failed while the ranks were mid-recovery")
    strategy, why = walk_chain(
        kind,
        chain,
        s.runtime_aware,
        s.budget.left,
        repeat_uce=bool(fault.evidence.get("repeat_uce")),
        skipped=skipped,
    )
    if fault.rank is None and strategy in PROCESS_LEVEL:
        strategy, why = walk_chain(
            kind, [x for x in s.chain if x not in PROCESS_LEVEL], False, s.budget.left
        )
        why = f"node {fault.node}: {fault.message}; {why}"
    if not collecting:
        return Decision(
            strategy,
            why,
            cause,
            own,
            restart_ranks(strategy, own, s.world_size),
            charged=strategy in CHARGED,
            peers_finished=peers,
        )
    assert rnd is not None
    return Decision(
        strategy,
        why,
        cause,
        failed,
        restart_ranks(strategy, own, s.world_size),
        charged=strategy in CHARGED,
        supersedes=rnd.generation,
        peers_finished=peers,
    )


def _prune_for_node_loss(chain: list[str], skipped: list[str], s: Situation, joined: bool) -> None:
    """The strategies a lost node's ranks cannot use, removed from `chain` (why, in
    `skipped`)."""
    if P.RETRY in chain:
        chain.remove(P.RETRY)  # the node's processes are gone
        skipped.append("retry: the node's processes are gone")
    few = too_few_nodes(s.nodes_left, s.min_nodes)
    if P.ELASTIC in chain and (few or joined):
        chain.remove(P.ELASTIC)
        skipped.append(
            "elastic-training: "
            + (few or "the node is back: its ranks need a start, not a smaller world")
        )


def too_few_nodes(nodes_left: int | None, min_nodes: int) -> str:
    """Why the world may not shrink to `nodes_left` nodes ("" when it may)."""
    if nodes_left is not None and nodes_left < min_nodes:
        return f"--nnodes MIN={min_nodes} does not allow continuing on {nodes_left} node(s)"
    return ""


def out_of_world(ranks: Sequence[int], s: Situation) -> bool:
    """True when every rank of `ranks` left the world in a live shrink (done, or the
    elastic-training round in progress that drops them)."""
    rnd = s.round
    gone = set(s.dropped)
    if rnd is not None and rnd.strategy == P.ELASTIC and rnd.collecting:
        gone |= set(rnd.failed_ranks)
    return bool(ranks) and set(ranks) <= gone


NODE_SHRINK_AT_ONCE = (
    "its ranks {ranks} leave the world at once (no recover-in-place before elastic-training "
    "could start them on a new agent); the other nodes' ranks go on in a smaller world (live "
    "shrink)"
)


def node_loss_outlook(
    chain: Sequence[str],
    ranks: Sequence[int],
    timeout: float,
    aware: bool | None = None,
    nodes_left: int | None = None,
    min_nodes: int = 0,
) -> str:
    """What a lost node's ranks do next, in words, for the loss's first lines (`node-lost`,
    `fault-reported`): what `decide` does with the loss while the budget has room. `aware`:
    whether every rank uses launcher.runtime (None: not known here, both cases are said)."""
    wait = (
        f"its ranks {list(ranks)} wait up to node_replace_timeout={timeout:g}s for a hot spare "
        "or a replacement agent"
    )
    if aware is False or too_few_nodes(nodes_left, min_nodes):
        return wait
    chain = [s for s in chain if s != P.RETRY]  # _prune_for_node_loss: the processes are gone
    if walk_chain(FaultKind.NODE_LOST, chain, True, True)[0] != P.ELASTIC:
        return wait
    at_once = NODE_SHRINK_AT_ONCE.format(ranks=list(ranks))
    if aware:
        return at_once
    return f"{at_once} when every rank uses launcher.runtime; else {wait}"


def dropped_node(what: str, ranks: Sequence[int], joined: bool) -> Decision:
    """A node whose ranks left the world in a live shrink: its loss, timeout or new agent
    starts no round (the new agent's ranks come back through the live grow back)."""
    return Decision(
        None,
        f"{what}: its ranks {list(ranks)} left the world in a live shrink (elastic-training)"
        + ("; they come back through the live grow back" if joined else "; nothing more to do"),
    )


def node_ranks(fault: P.Fault) -> tuple[int, ...]:
    """The ranks of the node a rank-less fault names (its evidence), () when it names none."""
    return tuple(sorted(int(r) for r in fault.evidence.get("node_ranks") or ()))


def _node_decision(fault: P.Fault, s: Situation) -> Decision:
    """Rule 3: a node lost or taken over (see the module docstring)."""
    rnd = s.round
    ranks = node_ranks(fault)
    joined = bool(fault.evidence.get("node_joined"))
    what = (
        f"node {fault.node} taken over ({fault.message})"
        if joined
        else f"node {fault.node} lost ({fault.message})"
    )
    if out_of_world(ranks, s):
        return dropped_node(what, ranks, joined)
    collecting = rnd is not None and rnd.collecting
    prior = set(rnd.failed_ranks) if collecting and rnd is not None else set()
    continues = joined and collecting and set(ranks) <= prior
    chain, skipped, peers = without_finished(s.chain, s.finished, sorted(prior | set(ranks)))
    _prune_for_node_loss(chain, skipped, s, joined)
    strategy, why = walk_chain(
        FaultKind.NODE_LOST, chain, s.runtime_aware, s.budget.left or continues, skipped=skipped
    )
    if strategy == P.RECOVER_IN_PLACE:
        failed = tuple(sorted(prior | set(ranks)))
        restart = ranks if joined else ()  # the lost node has no agent to start them yet
        why = f"{what}: its ranks {list(ranks)} " + (
            "start on the new agent and are repaired from replicas on the other nodes"
            if joined
            else "wait for a hot spare or a "
            "replacement agent; the survivors stop and keep their processes"
        )
        return Decision(
            strategy,
            why,
            fault,
            failed,
            restart,
            charged=not continues,
            supersedes=rnd.generation if collecting and rnd is not None else None,
            continues=continues,
        )
    if not joined and strategy == P.RESTART_ALL:
        return Decision(
            None,
            f"{what}: unmodified workers restart every rank once a hot spare "
            "or a replacement agent takes over the node",
        )
    failed = tuple(sorted(prior | set(ranks)))
    if strategy == P.ELASTIC:
        why = NODE_SHRINK_AT_ONCE.format(ranks=list(ranks))
    return Decision(
        strategy,
        f"{what}; {why}",
        fault,
        failed,
        restart_ranks(strategy, ranks, s.world_size),
        charged=strategy in CHARGED,
        supersedes=rnd.generation if collecting and rnd is not None else None,
        peers_finished=peers,
    )


def is_loss_round(rnd: Round | None, node: int) -> bool:
    """True when `rnd` is the process-level round that node `node`'s loss started (its ranks
    wait there for a new agent; that round was charged already)."""
    return (
        rnd is not None
        and rnd.cause.node == node
        and rnd.cause.rank is None
        and bool(rnd.cause.evidence.get("node_lost"))
        and rnd.strategy in PROCESS_LEVEL
    )


def unreplaced(
    fault: P.Fault,
    waited: float,
    timeout: float,
    nodes_left: int,
    min_nodes: int,
    s: Situation | None = None,
    nnodes: int = 0,
    renumber: str = "",
    live: bool = True,
) -> Decision:
    """A lost node (`fault`, its node_lost report) that no hot spare or replacement agent took
    over in time. When --nnodes MIN allows continuing on the `nodes_left` remaining nodes of
    `nnodes`, the world shrinks: live (`live`, elastic-training in `s.chain`:
    `live_node_shrink`), else by restart-all in a new rendezvous round (`shrink=True`; not
    possible: `renumber` says why), with budget (the node's charged loss round counts).
    Otherwise the job ends, saying why; a node already out of the world is absorbed."""
    what = (
        f"node {fault.node} lost ({fault.message}): no hot spare or replacement agent took "
        f"it over within node_replace_timeout={timeout:g}s (waited {waited:.1f}s)"
    )
    failed = node_ranks(fault)
    continues = is_loss_round(s.round if s is not None else None, fault.node)
    if s is not None and out_of_world(failed, s):
        return dropped_node(what, failed, False)
    few = too_few_nodes(nodes_left, min_nodes)
    if live and not few and (d := live_node_shrink(fault, what, s, continues)) is not None:
        return d
    if few:
        rest = few
    elif s is None or P.RESTART_ALL not in s.chain:
        rest = (
            f"continuing on the {nodes_left} remaining node(s) needs restart-all in "
            "--recover-strategy"
        )
    elif not (s.budget.left or continues):
        rest = (
            f"continuing on the {nodes_left} remaining node(s) needs a restart: restart "
            f"budget spent (--max_restarts={s.budget.limit})"
        )
    elif renumber:
        rest = f"continuing on the {nodes_left} remaining node(s) is not possible: {renumber}"
    else:
        before = s.world_size
        after = before // max(1, nnodes) * nodes_left if nnodes else before - len(failed)
        why = (
            f"{what}; continuing on {nodes_left} node(s): world size {before} -> {after} "
            "(restart-all)"
        )
        return Decision(
            P.RESTART_ALL,
            why,
            fault,
            failed,
            tuple(range(after)),
            charged=not continues,
            continues=continues,
            shrink=True,
        )
    return Decision(P.EXIT, f"{what}; {rest}", fault, failed, (), charged=False)


def live_node_shrink(
    fault: P.Fault, what: str, s: Situation | None, continues: bool
) -> Decision | None:
    """The live shrink of a lost node not taken over in time (elastic-training in the chain,
    every rank uses launcher.runtime, budget left or the node's loss round charged already):
    its ranks (and the loss round's other failed ranks) leave the world; None otherwise."""
    if s is None or P.ELASTIC not in s.chain or not s.runtime_aware:
        return None
    if not (s.budget.left or continues):
        return None
    rnd = s.round
    collecting = rnd is not None and rnd.collecting
    prior = set(rnd.failed_ranks) if collecting and rnd is not None else set()
    ranks = node_ranks(fault)
    failed = tuple(sorted(prior | set(ranks)))
    why = (
        f"{what}; elastic-training: its ranks {list(ranks)} leave the world, the other nodes' "
        f"ranks continue live at the interrupted step: world size {s.world_size - len(s.dropped)}"
        f" -> {s.world_size - len(s.dropped) - len(failed)} (live shrink)"
    )
    return Decision(
        P.ELASTIC,
        why,
        fault,
        failed,
        (),
        charged=not continues,
        supersedes=rnd.generation if collecting and rnd is not None else None,
        continues=continues,
    )


def scale_up(
    waiting: int, nodes: int, max_nodes: int, per_node: int, rnd: Round | None
) -> Decision | None:
    """`--rdzv-conf scale_up=restart` (torchrun's behaviour): `waiting` agents wait to get in
    while the world has `nodes` live nodes (of `per_node` ranks each) of at most `max_nodes`:
    restart-all in a new rendezvous round that includes them, not charged (torchrun does not
    count membership changes against --max_restarts). None while nobody waits, the world is
    full, or a process-level round is still collecting (it goes first), unless that round waits
    for a lost node to be taken over: with scale_up=restart nobody takes it over, the new round
    includes the waiting nodes."""
    waits_for_node = (
        rnd is not None and rnd.cause.rank is None and bool(rnd.cause.evidence.get("node_lost"))
    )
    if (
        waiting <= 0
        or nodes >= max_nodes
        or (rnd is not None and rnd.collecting and not waits_for_node)
    ):
        return None
    join = min(waiting, max_nodes - nodes)
    cause = P.Fault(
        kind="scale-up",
        rank=None,
        node=nodes,
        generation=rnd.generation if rnd else 0,
        message=f"{waiting} node(s) waiting to join",
        evidence={"scale_up": waiting},
    )
    why = (
        f"{waiting} node(s) waiting to join (scale_up=restart): restart-all in a new "
        f"rendezvous round with {join} of them: {nodes} -> {nodes + join} node(s), world size "
        f"{nodes * per_node} -> {(nodes + join) * per_node}"
    )
    return Decision(P.RESTART_ALL, why, cause, (), (), charged=False, grow=True)


def fallback(s: Situation, reason: str) -> Decision:
    """Rule 5: the process-level round in progress cannot complete."""
    rnd = s.round
    if rnd is None:
        raise ValueError("fallback() needs the round in progress")
    rest, notes, peers = without_finished(
        [x for x in s.chain if x not in PROCESS_LEVEL], s.finished, rnd.failed_ranks
    )
    strategy = rest[0] if rest else P.EXIT
    own = () if rnd.cause.rank is None else (rnd.cause.rank,)
    why = "; ".join([f"fallback: {reason}", *notes])
    return Decision(
        strategy,
        why,
        rnd.cause,
        own,
        restart_ranks(strategy, own, s.world_size),
        charged=False,
        continues=True,
        peers_finished=peers,
    )


# ---------------------------------------------------------------- one event, one fault
MIN_BLAME_IDLE = 2.0  # a rank idle for less than this is not blamed for its peers' timeouts


@dataclass(frozen=True)
class RankProgress:
    """One rank's progress record as its agent published it (`launcher.control.progress`)."""

    rank: int
    node: int
    aware: bool  # uses launcher.runtime (heartbeats); else only /proc progress is known
    idle_s: float  # seconds since its last progress
    waiting: bool = False  # blocked in a collective on its peers
    silent_s: float = 0.0  # seconds since its last heartbeat (aware ranks)
    state: str = ""  # process state letter
    phase: str = ""
    pid: int | None = None
    local_rank: int | None = None
    host: str = ""


def may_be_consequence(fault: P.Fault) -> bool:
    """A report that another rank's fault may explain: held for the merge window."""
    if fault.rank is None:
        return False
    ev = fault.evidence
    if FaultKind.parse(fault.kind) == FaultKind.NETWORK:
        return bool(ev.get("collective"))
    return FaultKind.parse(fault.kind) == FaultKind.HANG and bool(ev.get("weak"))


def blame(
    progress: Sequence[RankProgress],
    reporters: Sequence[int],
    min_idle: float = MIN_BLAME_IDLE,
    first_silent: bool = True,
) -> tuple[RankProgress, str] | None:
    """The rank that does not progress while `reporters` wait on it, and why; None when no rank
    stands out. Order: a frozen process (stopped or stuck), then silent heartbeats, then a rank
    idle while not waiting in a collective, then (unmodified ranks, which say nothing about
    waiting) the first to go silent, when `first_silent` (the reporters timed out waiting, so
    they are not it); the longest idle first within each."""
    others = [p for p in progress if p.rank not in reporters and p.phase != "done"]
    frozen = [p for p in others if p.state in FROZEN and p.idle_s >= min_idle]
    if frozen:
        p = max(frozen, key=lambda p: p.idle_s)
        return p, f"its process is {FROZEN[p.state]}, no progress for {p.idle_s:.1f}s"
    silent = [p for p in others if p.aware and p.silent_s >= min_idle + 3.0]
    if silent:
        p = max(silent, key=lambda p: p.silent_s)
        return p, f"its heartbeats stopped {p.silent_s:.1f}s ago (the process is frozen)"
    # idleness is evidence only with heartbeats: an unmodified rank blocked on a peer is idle too
    idle = [
        p
        for p in others
        if p.aware
        and not p.waiting
        and p.idle_s >= min_idle
        and p.phase not in ("init", "recovering")
    ]
    if idle:
        p = max(idle, key=lambda p: p.idle_s)
        return p, f"no progress for {p.idle_s:.1f}s while not waiting in a collective"
    quiet = [p for p in others if first_silent and not p.aware and p.idle_s >= min_idle]
    if quiet:  # the reporters timed out waiting: of the silent others, the first to go silent
        p = max(quiet, key=lambda p: p.idle_s)
        return p, (
            f"silent (no I/O, idle CPU) for {p.idle_s:.1f}s, the first of the silent ranks to "
            "go silent while the reporters timed out waiting (nothing else tells them apart)"
        )
    return None


def culprit(
    batch: Sequence[P.Fault], progress: Sequence[RankProgress]
) -> tuple[RankProgress, str] | None:
    """`blame()` for a window of reports that may all be consequences."""
    reporters = sorted({f.rank for f in batch if f.rank is not None})
    waited = all(FaultKind.parse(f.kind) == FaultKind.NETWORK for f in batch)
    return blame(progress, reporters, first_silent=waited)


def _consequence(f: P.Fault) -> dict:
    return {"rank": f.rank, "kind": f.kind, "node": f.node, "message": f.message[:300]}


def merge(batch: Sequence[P.Fault], progress: Sequence[RankProgress]) -> P.Fault:
    """The one fault of a window of reports (see the module docstring)."""
    if not batch:
        raise ValueError("merge() needs at least one report")
    strong = [f for f in batch if not may_be_consequence(f)]
    first = min(strong or list(batch), key=lambda f: f.time)
    rest = [f for f in batch if f is not first]
    if not strong:
        reporters = sorted({f.rank for f in batch if f.rank is not None})
        found = culprit(batch, progress)
        if found is not None:
            p, why = found
            cause = P.Fault(
                kind=FaultKind.HANG.value,
                rank=p.rank,
                node=p.node,
                generation=min(f.generation for f in batch),
                message=f"rank {p.rank} hangs: {why}; ranks {reporters} waited on it",
                pid=p.pid,
                local_rank=p.local_rank,
                host=p.host,
                time=min(f.time for f in batch),
                evidence={
                    "blamed_by": "controller",
                    "basis": why,
                    "proc_state": p.state,
                    "idle_s": round(p.idle_s, 3),
                },
            )
            rest = list(batch)
            first = cause
    if not rest:
        return first
    ev = dict(first.evidence)
    ev["consequences"] = list(ev.get("consequences", [])) + [_consequence(f) for f in rest]
    return dataclasses.replace(first, evidence=ev)


def blame_local(
    silent: Sequence[RankProgress], outside: Sequence[int] = ()
) -> tuple[RankProgress, str, bool]:
    """Among this node's silent unmodified workers, the one to blame: a frozen process, else one
    whose stacks are not inside a torch.distributed call (`outside`, from py-spy), else the first
    to go silent (weak: the controller may find a better culprit). (rank, why, weak)."""
    if not silent:
        raise ValueError("blame_local() needs at least one silent worker")
    frozen = [p for p in silent if p.state in FROZEN]
    if frozen:
        p = max(frozen, key=lambda p: p.idle_s)
        return p, f"its process is {FROZEN[p.state]}, no progress for {p.idle_s:.1f}s", False
    apart = [p for p in silent if p.rank in outside]
    if apart and len(apart) < len(silent):  # stacks tell only when some ranks wait and some not
        p = max(apart, key=lambda p: p.idle_s)
        return (
            p,
            (
                f"no progress for {p.idle_s:.1f}s and its stacks are not inside a "
                "torch.distributed call (its peers' are)"
            ),
            False,
        )
    p = max(silent, key=lambda p: p.idle_s)
    others = sorted(q.rank for q in silent if q is not p)
    hint = (
        "none of their stacks is inside a torch.distributed call"
        if apart
        else "install py-spy for stacks"
    )
    why = (
        f"silent (no I/O, idle CPU) for {p.idle_s:.1f}s; first of the silent ranks to go silent"
        + (f" (ranks {others} silent too)" if others else "")
        + f": nothing tells which one waits on which ({hint})"
    )
    return p, why, True
