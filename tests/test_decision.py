"""The recovery decision: one test per rule of launcher.control.decision (pure, no store)."""

from __future__ import annotations

import pytest

from launcher.control.decision import (
    NODE_SHRINK_AT_ONCE,
    Budget,
    RankProgress,
    Round,
    Situation,
    blame,
    blame_local,
    decide,
    fallback,
    may_be_consequence,
    merge,
    node_loss_outlook,
    walk_chain,
)
from launcher.protocol import plan as P
from launcher.protocol.faults import FaultKind

DEFAULT = (P.RETRY, P.RECOVER_IN_PLACE, P.RESTART_ALL, P.EXIT)


def fault(rank: int | None = 1, kind: str = "signal", gen: int = 0, **evidence) -> P.Fault:
    return P.Fault(kind=kind, rank=rank, node=0, generation=gen, message="x", evidence=evidence)


def situation(
    chain=DEFAULT, used=0, limit=3, aware=True, rnd: Round | None = None, finished=()
) -> Situation:
    return Situation(tuple(chain), Budget(used, limit), aware, 4, rnd, tuple(finished))


def round_of(strategy: str, failed=(1,), gen: int = 1, collecting: bool = False) -> Round:
    return Round(gen, strategy, tuple(failed), fault(failed[0] if failed else None), collecting)


# ---------------------------------------------------------------- the chain (walk_chain)
@pytest.mark.parametrize(
    "kind, expected",
    [
        (FaultKind.UCE_LOW, P.RETRY),
        (FaultKind.UCE_HIGH, P.RETRY),
        (FaultKind.NETWORK, P.RETRY),
        (FaultKind.SIGNAL, P.RECOVER_IN_PLACE),
        (FaultKind.EXIT, P.RECOVER_IN_PLACE),
        (FaultKind.HANG, P.RECOVER_IN_PLACE),
        (FaultKind.EXCEPTION, P.RECOVER_IN_PLACE),
    ],
)
def test_cheapest_strategy_per_kind(kind: FaultKind, expected: str) -> None:
    assert walk_chain(kind, DEFAULT, runtime_aware=True, budget_left=True)[0] == expected


def test_unmodified_scripts_get_torchrun_semantics() -> None:
    s, why = walk_chain(FaultKind.SIGNAL, DEFAULT, runtime_aware=False, budget_left=True)
    assert s == P.RESTART_ALL and "launcher.runtime" in why


def test_chain_falls_through_when_earlier_strategies_are_disabled() -> None:
    assert (
        walk_chain(FaultKind.UCE_LOW, [P.RECOVER_IN_PLACE, P.EXIT], True, True)[0]
        == P.RECOVER_IN_PLACE
    )
    assert walk_chain(FaultKind.UCE_LOW, [P.RESTART_ALL, P.EXIT], True, True)[0] == P.RESTART_ALL
    assert walk_chain(FaultKind.UCE_LOW, [P.DUMP, P.EXIT], True, True)[0] == P.DUMP
    assert walk_chain(FaultKind.UCE_LOW, [P.EXIT], True, True)[0] == P.EXIT


def test_budget_spent_skips_restarts_and_says_why() -> None:
    s, why = walk_chain(
        FaultKind.SIGNAL, [P.RECOVER_IN_PLACE, P.RESTART_ALL, P.DUMP, P.EXIT], True, False
    )
    assert s == P.DUMP and "budget" in why
    s, why = walk_chain(FaultKind.SIGNAL, DEFAULT, True, False)
    assert s == P.EXIT and "budget" in why


def test_repeat_uce_is_not_retried_in_place() -> None:
    s, why = walk_chain(FaultKind.UCE_LOW, DEFAULT, True, True, repeat_uce=True)
    assert s == P.RECOVER_IN_PLACE and "24 h" in why


# ---------------------------------------------------------------- decide(): a new round
def test_a_fault_with_no_round_in_progress_starts_one_and_is_charged() -> None:
    d = decide(fault(rank=2), situation())
    assert (d.strategy, d.failed_ranks, d.restart_ranks, d.charged) == (
        P.RECOVER_IN_PLACE,
        (2,),
        (2,),
        True,
    )
    assert d.cause is not None and d.cause.rank == 2 and d.supersedes is None
    d = decide(fault(rank=2, kind="uce-low"), situation())
    assert (d.strategy, d.restart_ranks, d.charged) == (P.RETRY, (), True)
    d = decide(fault(rank=2), situation(aware=False))
    assert (d.strategy, d.restart_ranks) == (P.RESTART_ALL, (0, 1, 2, 3))


def test_budget_and_repeat_uce_reach_decide() -> None:
    d = decide(fault(), situation(used=3))
    assert d.strategy == P.EXIT and not d.charged and "budget" in d.reason
    d = decide(fault(kind="uce-low", repeat_uce=True), situation())
    assert d.strategy == P.RECOVER_IN_PLACE and "second UCE" in d.reason


def test_an_unknown_kind_is_handled_as_unknown() -> None:
    assert decide(fault(kind="martian"), situation()).strategy == P.RECOVER_IN_PLACE


# ---------------------------------------------------------------- rule 1: absorbed
@pytest.mark.parametrize("strategy", [P.RESTART_ALL, P.DUMP, P.EXIT])
def test_bystanders_of_a_whole_job_round_are_absorbed(strategy: str) -> None:
    d = decide(fault(rank=3, gen=0), situation(rnd=round_of(strategy)))
    assert d.absorbed and d.strategy is None and "generation 1" in d.reason


def test_the_failed_rank_reported_twice_is_absorbed_but_another_rank_is_not() -> None:
    rnd = round_of(P.RECOVER_IN_PLACE, failed=(1,))
    assert decide(fault(rank=1, gen=0), situation(rnd=rnd)).absorbed
    assert not decide(fault(rank=2, gen=0), situation(rnd=rnd)).absorbed
    assert not decide(fault(rank=1, gen=1), situation(rnd=rnd)).absorbed  # failed again, later


def test_a_replacement_agent_is_never_absorbed() -> None:
    d = decide(
        fault(rank=None, kind="exit", gen=0, node_joined=True),
        situation(rnd=round_of(P.RESTART_ALL)),
    )
    assert not d.absorbed


# ---------------------------------------------------------------- rule 3: node loss
def test_a_lost_node_restarts_every_rank() -> None:
    d = decide(fault(rank=None, kind="exit", node_joined=True), situation())
    assert d.strategy == P.RESTART_ALL and d.restart_ranks == (0, 1, 2, 3) and d.failed_ranks == ()
    assert d.reason.startswith("node 0: x;")
    d = decide(fault(rank=None, kind="exit"), situation(chain=(P.RECOVER_IN_PLACE, P.DUMP, P.EXIT)))
    assert d.strategy == P.EXIT  # dump needs the runtime on every rank: a lost node has none
    d = decide(fault(rank=None, kind="exit"), situation(used=3))
    assert d.strategy == P.EXIT


# ---------------------------------------------------------------- rule 4: superseded
def test_a_fault_while_the_round_collects_statuses_widens_it() -> None:
    rnd = round_of(P.RECOVER_IN_PLACE, failed=(1,), gen=1, collecting=True)
    d = decide(fault(rank=3, kind="network", gen=1), situation(rnd=rnd))
    # retry is off mid-recovery; the new rank restarts, rank 1's replacement keeps running
    assert d.strategy == P.RECOVER_IN_PLACE and "mid-recovery" in d.reason
    assert d.failed_ranks == (1, 3) and d.restart_ranks == (3,) and d.supersedes == 1 and d.charged


def test_a_superseding_fault_respects_the_chain_and_the_budget() -> None:
    rnd = round_of(P.RETRY, failed=(1,), gen=1, collecting=True)
    d = decide(
        fault(rank=2, kind="uce-low", gen=1),
        situation(chain=(P.RETRY, P.RESTART_ALL, P.EXIT), rnd=rnd),
    )
    assert (
        d.strategy == P.RESTART_ALL and d.failed_ranks == (1, 2) and d.restart_ranks == (0, 1, 2, 3)
    )
    d = decide(fault(rank=2, gen=1), situation(used=3, rnd=rnd))
    assert d.strategy == P.EXIT and d.failed_ranks == (1, 2)


def test_after_the_repair_plan_a_new_fault_is_a_round_of_its_own() -> None:
    rnd = round_of(P.RECOVER_IN_PLACE, failed=(1,), gen=1, collecting=False)
    d = decide(fault(rank=2, kind="uce-low", gen=0), situation(rnd=rnd))
    assert d.strategy == P.RETRY and d.failed_ranks == (2,) and d.supersedes is None
    assert d.cause is not None and d.cause.generation == 1  # another rank of generation 1's round


def test_a_lost_node_during_a_collecting_round_restarts_every_rank() -> None:
    rnd = round_of(P.RECOVER_IN_PLACE, failed=(1,), gen=1, collecting=True)
    d = decide(fault(rank=None, kind="exit", gen=1, node_joined=True), situation(rnd=rnd))
    assert d.strategy == P.RESTART_ALL and d.restart_ranks == (0, 1, 2, 3)


# ---------------------------------------------------------------- rule 5: fallback
def test_fallback_takes_the_first_strategy_after_the_process_level_ones_uncharged() -> None:
    rnd = round_of(P.RECOVER_IN_PLACE, failed=(1,), collecting=True)
    d = fallback(situation(rnd=rnd), "no healthy replica")
    assert (d.strategy, d.charged, d.restart_ranks) == (P.RESTART_ALL, False, (0, 1, 2, 3))
    assert (
        d.reason == "fallback: no healthy replica"
        and d.cause is rnd.cause
        and d.failed_ranks == (1,)
    )
    assert (
        fallback(situation(chain=(P.RECOVER_IN_PLACE, P.DUMP, P.EXIT), rnd=rnd), "x").strategy
        == P.DUMP
    )
    assert fallback(situation(chain=(P.RECOVER_IN_PLACE,), rnd=rnd), "x").strategy == P.EXIT
    # the round already used the budget: its fallback is allowed even with none left
    assert fallback(situation(used=3, rnd=rnd), "x").strategy == P.RESTART_ALL


def test_fallback_needs_a_round() -> None:
    with pytest.raises(ValueError, match="round in progress"):
        fallback(situation(), "x")


# ---------------------------------------------------------------- rule 6: peers finished
def test_a_rank_failing_after_its_peers_finished_restarts_every_rank_at_once() -> None:
    d = decide(fault(rank=1), situation(finished=(0, 2, 3)))
    assert (d.strategy, d.charged, d.restart_ranks, d.peers_finished) == (
        P.RESTART_ALL,
        True,
        (0, 1, 2, 3),
        (0, 2, 3),
    )
    assert d.reason.startswith(
        "retry: ranks [0, 2, 3] already finished the job, no live peer to "
        "repair from; recover-in-place: ranks [0, 2, 3] already finished"
    ), d.reason
    # the failed rank's own goodbye does not count; one finished peer is enough
    assert decide(fault(rank=1), situation(finished=(1, 3))).strategy == P.RESTART_ALL
    assert decide(fault(rank=1), situation(finished=(1,))).strategy == P.RECOVER_IN_PLACE
    # a UCE is not retried either: the finished ranks cannot roll back with it
    assert decide(fault(rank=1, kind="uce-low"), situation(finished=(0,))).strategy == P.RESTART_ALL


@pytest.mark.parametrize(
    "chain, used, expected, needle",
    [
        (
            (P.RECOVER_IN_PLACE, P.DUMP, P.EXIT),
            0,
            P.EXIT,
            "no live survivor to save the current step",
        ),
        (DEFAULT, 3, P.EXIT, "restart-all: restart budget spent"),
    ],
)
def test_with_its_peers_finished_and_no_restart_left_the_job_exits_saying_so(
    chain, used, expected, needle
) -> None:
    d = decide(fault(rank=1), situation(chain=chain, used=used, finished=(0, 2, 3)))
    assert (d.strategy, d.charged, d.peers_finished) == (expected, False, (0, 2, 3))
    assert "ranks [0, 2, 3] already finished the job" in d.reason and needle in d.reason, d.reason


def test_a_round_whose_peers_finished_meanwhile_falls_back_past_dump() -> None:
    rnd = round_of(P.RECOVER_IN_PLACE, failed=(1,), collecting=True)
    d = fallback(
        situation(
            chain=(P.RECOVER_IN_PLACE, P.DUMP, P.RESTART_ALL, P.EXIT), rnd=rnd, finished=(0, 2)
        ),
        "ranks [0, 2] finished",
    )
    assert (d.strategy, d.charged, d.peers_finished) == (P.RESTART_ALL, False, (0, 2))
    assert "dump: ranks [0, 2] already finished the job" in d.reason, d.reason
    # a replacement failing while its peers finished: the superseding round cannot repair it
    d = decide(fault(rank=1, gen=1), situation(rnd=rnd, finished=(0, 2, 3)))
    assert (d.strategy, d.supersedes) == (P.RESTART_ALL, 1)


def test_a_lost_node_whose_peers_finished_is_not_repaired_from_them() -> None:
    f = fault(rank=None, kind="node-lost", node_joined=True, node_ranks=[2, 3])
    d = decide(f, situation(finished=(0, 1)))
    assert d.strategy == P.RESTART_ALL and d.peers_finished == (0, 1), d


# ---------------------------------------------------------------- one event, one fault
def net(rank: int, gen: int = 0, t: float = 100.0) -> P.Fault:
    f = fault(rank, "network", gen, collective="gradient all_reduce")
    f.time = t
    return f


def rec(
    rank: int,
    idle: float,
    waiting: bool = False,
    state: str = "S",
    silent: float = 0.5,
    aware: bool = True,
    phase: str = "forward",
) -> RankProgress:
    return RankProgress(
        rank=rank,
        node=rank // 2,
        aware=aware,
        idle_s=idle,
        waiting=waiting,
        silent_s=silent,
        state=state,
        phase=phase,
        pid=1000 + rank,
        local_rank=rank % 2,
        host="h",
    )


WAITERS = [rec(0, 9.0, True), rec(2, 9.0, True), rec(3, 8.5, True)]


def test_which_reports_may_be_consequences() -> None:
    assert may_be_consequence(net(0))
    assert not may_be_consequence(fault(0, "network"))  # raised at a phase edge, not a collective
    assert may_be_consequence(fault(0, "hang", weak=True))
    assert not may_be_consequence(fault(0, "hang"))  # proven: stopped, or idle while not waiting
    assert not may_be_consequence(fault(0, "signal")) and not may_be_consequence(
        fault(None, "network", collective="x")
    )


def test_blame_the_rank_that_does_not_progress_while_its_peers_wait() -> None:
    p, why = blame(WAITERS + [rec(1, 12.0)], reporters=[0, 2, 3])
    assert p.rank == 1 and "not waiting in a collective" in why
    p, why = blame(WAITERS + [rec(1, 12.0, waiting=True, state="T")], reporters=[0])
    assert p.rank == 1 and "state T" in why  # stopped while inside a collective: still hung
    p, why = blame(WAITERS + [rec(1, 12.0, waiting=True, silent=12.0)], reporters=[0])
    assert p.rank == 1 and "heartbeats stopped" in why
    assert blame(WAITERS + [rec(1, 0.3)], reporters=[0, 2, 3]) is None  # rank 1 progresses
    assert blame(WAITERS + [rec(1, 30.0, phase="recovering")], reporters=[0]) is None
    assert blame(WAITERS, reporters=[0, 2, 3]) is None  # everyone waits: a real network fault
    plain = [rec(0, 40.0, aware=False), rec(2, 35.0, aware=False)]  # no heartbeats, no waiting flag
    assert blame(plain + [rec(3, 20.0, aware=False, state="D")], reporters=[1])[0].rank == 3
    p, why = blame(plain, reporters=[1])  # rank 1 timed out waiting: of the others, first silent
    assert p.rank == 0 and "first of the silent ranks" in why
    assert blame([rec(0, 1.0, aware=False)], reporters=[1]) is None
    assert blame(plain, reporters=[1], first_silent=False) is None
    weak = fault(1, "hang", weak=True)  # rank 1 was the first to go silent on its node: it stays
    assert merge([weak], plain) == weak


def test_reports_of_one_collective_timeout_merge_into_one_hang_of_the_culprit() -> None:
    batch = [net(0, t=100.0), net(2, t=100.2), net(3, t=100.1)]
    one = merge(batch, WAITERS + [rec(1, 12.0)])
    assert (one.kind, one.rank, one.node, one.pid, one.time) == ("hang", 1, 0, 1001, 100.0)
    assert one.evidence["blamed_by"] == "controller"
    assert sorted(c["rank"] for c in one.evidence["consequences"]) == [0, 2, 3]
    d = decide(one, situation())
    assert d.strategy == P.RECOVER_IN_PLACE and d.failed_ranks == (1,) and d.restart_ranks == (1,)


def test_with_no_culprit_the_earliest_report_is_the_fault_and_the_rest_its_consequences() -> None:
    one = merge([net(2, t=100.2), net(0, t=100.0)], WAITERS)
    assert (one.kind, one.rank) == ("network", 0) and [
        c["rank"] for c in one.evidence["consequences"]
    ] == [2]
    assert decide(one, situation()).strategy == P.RETRY
    assert merge([net(3)], WAITERS) == net(3)  # alone and unexplained: unchanged


def test_a_proven_fault_in_the_window_wins_over_the_reports_it_explains() -> None:
    exit1 = fault(1, "signal")
    exit1.time = 101.0
    one = merge([net(0, t=100.0), exit1, net(2, t=100.5)], WAITERS + [rec(1, 12.0)])
    assert (one.kind, one.rank) == ("signal", 1)
    assert sorted(c["rank"] for c in one.evidence["consequences"]) == [0, 2]
    with pytest.raises(ValueError):
        merge([], WAITERS)


def test_network_reports_from_before_the_round_are_its_consequences_not_new_rounds() -> None:
    rnd = round_of(P.RECOVER_IN_PLACE, failed=(1,), gen=1, collecting=True)
    for rank in (0, 2, 3):  # the issue: three reports used to start three rounds
        d = decide(net(rank, gen=0), situation(rnd=rnd))
        assert d.absorbed and "consequence of the stop of generation 1" in d.reason
    d = decide(net(2, gen=1), situation(rnd=rnd))  # a collective of the new generation failed
    assert not d.absorbed
    assert not decide(fault(2, "signal", gen=0), situation(rnd=rnd)).absorbed  # a real death


def test_local_blame_prefers_a_frozen_process_then_stacks_then_the_first_silent() -> None:
    silent = [
        rec(0, 40.0, aware=False),
        rec(1, 31.0, aware=False, state="T"),
        rec(2, 35.0, aware=False),
    ]
    p, why, weak = blame_local(silent)
    assert p.rank == 1 and "state T" in why and not weak
    plain = [rec(0, 40.0, aware=False), rec(2, 35.0, aware=False)]
    p, why, weak = blame_local(plain, outside=[2])
    assert p.rank == 2 and "not inside a torch.distributed call" in why and not weak
    p, why, weak = blame_local(plain)
    assert p.rank == 0 and weak and "first of the silent ranks" in why and "ranks [2]" in why
    with pytest.raises(ValueError):
        blame_local([])


def test_stacks_that_all_sit_outside_a_collective_blame_no_one_strongly() -> None:
    """Bug (CI with py-spy installed): three sleeping ranks, none inside a collective, and one was
    blamed strongly for being "not inside a torch.distributed call (its peers' are)"."""
    plain = [rec(0, 6.0, aware=False), rec(1, 9.0, aware=False), rec(2, 7.0, aware=False)]
    p, why, weak = blame_local(plain, outside=[0, 1, 2])
    assert p.rank == 1 and weak and "first of the silent ranks" in why
    assert "none of their stacks is inside a torch.distributed call" in why and "peers'" not in why


# ------------------------------------------------------- rule 3: node loss repaired from peers
def node_fault(joined: bool, gen: int = 0, ranks=(2, 3)) -> P.Fault:
    ev = {"node_joined": True} if joined else {"node_lost": "no heartbeat for 5s"}
    return P.Fault(
        kind="node-lost",
        rank=None,
        node=1,
        generation=gen,
        message="x",
        evidence={**ev, "node_ranks": list(ranks)},
    )


def test_a_lost_node_of_a_runtime_job_stops_the_survivors_and_waits_for_its_new_agent() -> None:
    d = decide(node_fault(joined=False), situation())
    assert d.strategy == P.RECOVER_IN_PLACE and d.failed_ranks == (2, 3)
    assert d.restart_ranks == () and d.charged and "wait for a hot spare" in d.reason


def test_the_new_agent_of_a_lost_node_starts_its_ranks_repaired_from_peers_uncharged() -> None:
    rnd = Round(1, P.RECOVER_IN_PLACE, (2, 3), node_fault(joined=False), collecting=True)
    d = decide(node_fault(joined=True, gen=1), situation(used=1, limit=1, rnd=rnd))
    assert d.strategy == P.RECOVER_IN_PLACE and d.restart_ranks == (2, 3)
    assert d.failed_ranks == (2, 3) and d.supersedes == 1 and not d.charged and d.continues
    # an arrival nobody saw the loss of (the node left by signal): a round of its own, charged
    d = decide(node_fault(joined=True), situation())
    assert d.strategy == P.RECOVER_IN_PLACE and d.restart_ranks == (2, 3) and d.charged


def test_a_node_loss_is_never_absorbed_by_an_older_round() -> None:
    rnd = round_of(P.RECOVER_IN_PLACE, failed=(1,), gen=3)
    assert not decide(node_fault(joined=False, gen=0), situation(rnd=rnd)).absorbed


def test_unmodified_workers_wait_for_the_new_agent_then_every_rank_restarts() -> None:
    d = decide(node_fault(joined=False), situation(aware=False))
    assert d.absorbed and "once a hot spare" in d.reason
    d = decide(node_fault(joined=True), situation(aware=False))
    assert d.strategy == P.RESTART_ALL and d.restart_ranks == (0, 1, 2, 3)


def test_without_recover_in_place_in_the_chain_a_node_loss_follows_the_chain() -> None:
    d = decide(node_fault(joined=True), situation(chain=(P.RESTART_ALL, P.EXIT)))
    assert d.strategy == P.RESTART_ALL and "node 1 taken over" in d.reason
    d = decide(node_fault(joined=False), situation(used=3))
    assert d.strategy == P.EXIT and d.failed_ranks == (2, 3)


def test_a_node_not_taken_over_in_time_ends_the_job_below_min_saying_why() -> None:
    from launcher.control.decision import unreplaced

    d = unreplaced(
        node_fault(joined=False),
        12.3,
        10.0,
        nodes_left=1,
        min_nodes=2,
        s=situation(aware=False),
        nnodes=2,
    )
    assert d.strategy == P.EXIT and d.failed_ranks == (2, 3) and not d.charged and not d.shrink
    assert d.reason.startswith(
        "node 1 lost (x): no hot spare or replacement agent took it over "
        "within node_replace_timeout=10s (waited 12.3s)"
    )
    assert "--nnodes MIN=2 does not allow continuing on 1 node(s)" in d.reason


def test_a_node_not_taken_over_in_time_shrinks_the_world_when_min_allows() -> None:
    from launcher.control.decision import unreplaced

    # 3 nodes of 2 ranks (world 6), node 1 lost, --nnodes 2:3, unmodified workers
    s = Situation(DEFAULT, Budget(1, 3), False, 6, None)
    d = unreplaced(node_fault(joined=False), 3.2, 3.0, nodes_left=2, min_nodes=2, s=s, nnodes=3)
    assert (d.strategy, d.shrink, d.charged, d.continues) == (P.RESTART_ALL, True, True, False)
    assert d.failed_ranks == (2, 3) and d.restart_ranks == (0, 1, 2, 3)
    assert d.reason == (
        "node 1 lost (x): no hot spare or replacement agent took it over within "
        "node_replace_timeout=3s (waited 3.2s); continuing on 2 node(s): world "
        "size 6 -> 4 (restart-all)"
    )
    # a runtime job: the loss's recover-in-place round was charged; the shrink continues it
    rnd = Round(1, P.RECOVER_IN_PLACE, (2, 3), node_fault(joined=False), collecting=True)
    s = Situation(DEFAULT, Budget(3, 3), True, 6, rnd)
    d = unreplaced(node_fault(joined=False), 3.2, 3.0, nodes_left=2, min_nodes=1, s=s, nnodes=3)
    assert (d.strategy, d.shrink, d.charged, d.continues) == (P.RESTART_ALL, True, False, True)


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"used": 3}, "needs a restart: restart budget spent (--max_restarts=3)"),
        (
            {"chain": (P.RECOVER_IN_PLACE, P.DUMP, P.EXIT)},
            "needs restart-all in --recover-strategy",
        ),
    ],
)
def test_a_node_not_taken_over_without_budget_or_restart_all_ends_the_job(kw, needle) -> None:
    from launcher.control.decision import unreplaced

    d = unreplaced(
        node_fault(joined=False),
        3.0,
        3.0,
        nodes_left=2,
        min_nodes=2,
        s=situation(aware=False, **kw),
        nnodes=3,
    )
    assert d.strategy == P.EXIT and not d.shrink and not d.charged
    assert f"; continuing on the 2 remaining node(s) {needle}" in d.reason, d.reason


def test_a_static_rendezvous_cannot_shrink_and_says_so() -> None:
    from launcher.control.decision import unreplaced

    d = unreplaced(
        node_fault(joined=False),
        3.0,
        3.0,
        nodes_left=2,
        min_nodes=2,
        s=situation(aware=False),
        nnodes=3,
        renumber="a static rendezvous",
    )
    assert d.strategy == P.EXIT and d.reason.endswith("is not possible: a static rendezvous")


def test_scale_up_restart_grows_the_world_uncharged_when_nodes_wait() -> None:
    from launcher.control.decision import scale_up

    d = scale_up(waiting=2, nodes=2, max_nodes=3, per_node=2, rnd=None)
    assert d is not None and (d.strategy, d.grow, d.charged) == (P.RESTART_ALL, True, False)
    assert d.reason == (
        "2 node(s) waiting to join (scale_up=restart): restart-all in a new "
        "rendezvous round with 1 of them: 2 -> 3 node(s), world size 4 -> 6"
    )
    assert scale_up(waiting=0, nodes=2, max_nodes=3, per_node=2, rnd=None) is None
    assert scale_up(waiting=1, nodes=3, max_nodes=3, per_node=2, rnd=None) is None  # full
    busy = round_of(P.RECOVER_IN_PLACE, collecting=True)
    assert scale_up(waiting=1, nodes=2, max_nodes=3, per_node=2, rnd=busy) is None
    # a round waiting for a lost node to be taken over: with scale_up=restart nobody will
    lost = Round(1, P.RECOVER_IN_PLACE, (2, 3), node_fault(joined=False), collecting=True)
    d = scale_up(waiting=1, nodes=1, max_nodes=2, per_node=2, rnd=lost)
    assert d is not None and d.grow and "1 -> 2 node(s), world size 2 -> 4" in d.reason


def test_the_loss_round_of_a_node_is_the_process_level_round_its_loss_started() -> None:
    from launcher.control.decision import is_loss_round

    lost = node_fault(joined=False)
    assert is_loss_round(Round(1, P.RECOVER_IN_PLACE, (2, 3), lost, collecting=True), 1)
    assert not is_loss_round(Round(1, P.RECOVER_IN_PLACE, (2, 3), lost), 0)  # another node's
    assert not is_loss_round(Round(1, P.RESTART_ALL, (2, 3), lost), 1)  # not process-level
    joined = node_fault(joined=True)
    assert not is_loss_round(Round(1, P.RECOVER_IN_PLACE, (2, 3), joined), 1)  # an arrival's
    assert not is_loss_round(round_of(P.RECOVER_IN_PLACE), 0)  # a rank's fault
    assert not is_loss_round(None, 1)


# ------------------------------------------------------- elastic-training (issue 33)
ELASTIC_CHAIN = (P.ELASTIC, P.RESTART_ALL, P.EXIT)


def test_elastic_training_drops_the_failed_rank_and_restarts_nobody() -> None:
    d = decide(fault(rank=3), situation(chain=ELASTIC_CHAIN))
    assert d.strategy == P.ELASTIC and d.failed_ranks == (3,) and d.restart_ranks == ()
    assert d.charged and "smaller world" in d.reason


def test_elastic_training_needs_the_runtime_else_restart_all() -> None:
    d = decide(fault(rank=3), situation(chain=ELASTIC_CHAIN, aware=False))
    assert d.strategy == P.RESTART_ALL


def test_recover_in_place_comes_before_elastic_training_in_the_chain() -> None:
    chain = (P.RECOVER_IN_PLACE, P.ELASTIC, P.RESTART_ALL, P.EXIT)
    assert decide(fault(rank=3), situation(chain=chain)).strategy == P.RECOVER_IN_PLACE


def test_a_lost_node_shrinks_live_at_once_without_recover_in_place() -> None:
    """elastic-training without recover-in-place before it: nothing could start the node's
    ranks on a new agent, so they leave the world at once; nobody restarts."""
    d = decide(node_fault(joined=False), situation(chain=ELASTIC_CHAIN))
    assert (d.strategy, d.failed_ranks, d.restart_ranks, d.charged) == (
        P.ELASTIC,
        (2, 3),
        (),
        True,
    )
    assert "node 1 lost (x); its ranks [2, 3] leave the world at once" in d.reason


@pytest.mark.parametrize(
    "chain, aware, nodes_left, expected",
    [
        # the at-once chain: what decide() does (the test above), said before it decides
        (ELASTIC_CHAIN, True, 1, "leave the world at once"),
        (("retry",) + ELASTIC_CHAIN, True, 1, "leave the world at once"),
        # runtime unknown (a non-leader agent): both outcomes, the at-once one first
        (ELASTIC_CHAIN, None, 1, "leave the world at once"),
        # recover-in-place before elastic-training: the wait of the waiting rule
        ((P.RECOVER_IN_PLACE, P.ELASTIC, P.RESTART_ALL), True, 1, "wait up to"),
        ((P.RESTART_ALL, P.ELASTIC), True, 1, "wait up to"),
        (DEFAULT, True, 1, "wait up to"),
        # unmodified workers, or too few nodes to shrink: the loss waits for a takeover
        (ELASTIC_CHAIN, False, 1, "wait up to"),
        (ELASTIC_CHAIN, True, 0, "wait up to"),
    ],
)
def test_a_lost_nodes_outlook_says_what_decide_does(chain, aware, nodes_left, expected) -> None:
    """The loss's first lines (`node-lost`, `fault-reported`) say what the decision will be."""
    text = node_loss_outlook(chain, [2, 3], 270.0, aware, nodes_left, min_nodes=1)
    assert text.startswith("its ranks [2, 3] " + expected), text
    if expected == "wait up to":
        assert "leave the world" not in text and "node_replace_timeout=270s" in text
        s = Situation(
            tuple(chain), Budget(0, 3), bool(aware), 4, nodes_left=nodes_left, min_nodes=1
        )
        d = decide(node_fault(joined=False), s)
        assert d.absorbed or d.strategy != P.ELASTIC
    elif aware:
        assert "wait up to" not in text and "node_replace_timeout" not in text
        d = decide(node_fault(joined=False), situation(chain=chain))
        assert d.strategy == P.ELASTIC and NODE_SHRINK_AT_ONCE.format(ranks=[2, 3]) in d.reason
    else:
        assert "when every rank uses launcher.runtime; else its ranks [2, 3] wait up to" in text


def test_a_lost_node_below_nnodes_min_does_not_shrink_live() -> None:
    s = Situation(ELASTIC_CHAIN, Budget(0, 3), True, 4, nodes_left=1, min_nodes=2)
    d = decide(node_fault(joined=False), s)
    # the chain goes on to restart-all: the loss waits for a takeover (unreplaced then ends it)
    assert d.absorbed and "once a hot spare" in d.reason
    from launcher.control.decision import unreplaced

    e = unreplaced(node_fault(joined=False), 3.2, 3.0, nodes_left=1, min_nodes=2, s=s, nnodes=2)
    assert e.strategy == P.EXIT and "--nnodes MIN=2 does not allow continuing on 1" in e.reason


def test_with_recover_in_place_first_a_lost_node_waits_then_shrinks_live() -> None:
    """The waiting rule: the loss round waits for a hot spare or the agent's return; when
    none came within node_replace_timeout, the node's ranks leave the world live (the round
    already charged; it supersedes the loss round)."""
    from launcher.control.decision import unreplaced

    chain = (P.RECOVER_IN_PLACE, P.ELASTIC, P.RESTART_ALL, P.EXIT)
    lost = node_fault(joined=False)
    assert decide(lost, situation(chain=chain)).strategy == P.RECOVER_IN_PLACE
    rnd = Round(4, P.RECOVER_IN_PLACE, (2, 3), lost, collecting=True)
    s = Situation(chain, Budget(3, 3), True, 6, rnd, nodes_left=2, min_nodes=2)
    d = unreplaced(lost, 3.2, 3.0, nodes_left=2, min_nodes=2, s=s, nnodes=3)
    assert (d.strategy, d.failed_ranks, d.restart_ranks, d.shrink) == (P.ELASTIC, (2, 3), (), False)
    assert (d.charged, d.continues, d.supersedes) == (False, True, 4)
    assert d.reason.endswith(
        "elastic-training: its ranks [2, 3] leave the world, the other nodes' ranks continue "
        "live at the interrupted step: world size 6 -> 4 (live shrink)"
    )
    # refused (live=False: the survivors cannot continue in a smaller world): restart-all
    d = unreplaced(lost, 3.2, 3.0, nodes_left=2, min_nodes=2, s=s, nnodes=3, live=False)
    assert (d.strategy, d.shrink) == (P.RESTART_ALL, True)
    # unmodified workers never shrink live
    s = Situation(chain, Budget(0, 3), False, 6, None)
    assert unreplaced(lost, 3.2, 3.0, 2, 2, s, 3).strategy == P.RESTART_ALL


def test_a_node_whose_ranks_left_in_a_live_shrink_is_absorbed() -> None:
    """After the live shrink the node's timeout and its new agent start no round: its ranks
    come back through the live grow back (launcher.control.grow)."""
    from launcher.control.decision import unreplaced

    s = Situation(ELASTIC_CHAIN, Budget(1, 3), True, 4, None, dropped=(2, 3))
    joined = decide(node_fault(joined=True), s)
    assert joined.absorbed and "come back through the live grow back" in joined.reason
    assert decide(node_fault(joined=False), s).absorbed
    assert unreplaced(node_fault(joined=False), 9.0, 3.0, 1, 1, s, 2).absorbed
    # the elastic-training round dropping them is still collecting: the same
    rnd = Round(2, P.ELASTIC, (2, 3), node_fault(joined=False), collecting=True)
    s = Situation(ELASTIC_CHAIN, Budget(1, 3), True, 4, rnd)
    assert decide(node_fault(joined=True), s).absorbed
    # another node's ranks are not out of the world
    other = Situation(ELASTIC_CHAIN, Budget(1, 3), True, 6, None, dropped=(4, 5))
    assert decide(node_fault(joined=False), other).strategy == P.ELASTIC


def test_a_returning_node_is_not_shrunk_again() -> None:
    """An arrival whose ranks are in the world (a takeover before any shrink) is never a live
    shrink: its ranks need a start."""
    chain = (P.ELASTIC, P.RECOVER_IN_PLACE, P.RESTART_ALL)
    d = decide(node_fault(joined=True), situation(chain=chain))
    assert d.strategy == P.RECOVER_IN_PLACE and d.restart_ranks == (2, 3)
