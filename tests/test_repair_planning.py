"""Repair planning (pure functions): sources, stripes, resume step, dump writers."""

from __future__ import annotations

import pytest

from launcher.control.repair_planning import plan_repair
from launcher.protocol.plan import RESTART_ALL, RankStatus


def st(rank, committed, step=None, shard="dp", replacement=False, dirty=False, gen=1):
    return RankStatus(
        rank=rank,
        generation=gen,
        replacement=replacement,
        committed_step=-1 if replacement else committed,
        step=committed + 1 if step is None else step,
        dirty=dirty,
        shard=shard,
    )


def test_replacement_gets_lowest_healthy_replica_and_rollback():
    sts = [st(0, 4), st(1, 4), st(2, -1, replacement=True), st(3, 4)]
    p = plan_repair(sts, 1, max_stripes=1)
    assert (p.resume_step, p.action, p.pairs, p.fallback) == (5, "rollback", [[0, 2]], None)


def test_commit_when_update_finished_everywhere():
    sts = [st(0, 5, step=5), st(1, 5, step=5), st(2, -1, replacement=True), st(3, 5, step=5)]
    p = plan_repair(sts, 1, max_stripes=1)
    assert (p.resume_step, p.action, p.pairs) == (6, "commit", [[0, 2]])


def test_dirty_ranks_need_repair():
    sts = [
        st(0, 4, step=5, dirty=True),
        st(1, 5, step=5),
        st(2, -1, replacement=True),
        st(3, 5, step=5),
    ]
    p = plan_repair(sts, 1, max_stripes=1)
    assert p.pairs == [[1, 0], [1, 2]] and p.resume_step == 6


def test_healthy_ranks_with_lower_committed_step_need_repair():
    sts = [st(0, 4, step=5), st(1, 5, step=5), st(2, -1, replacement=True), st(3, 5, step=5)]
    p = plan_repair(sts, 1, max_stripes=1)
    assert p.pairs == [[1, 0], [1, 2]] and p.resume_step == 6


def test_source_comes_from_the_same_shard():
    sh = ["tp0-pp0", "tp1-pp0", "tp0-pp0", "tp1-pp0"]
    sts = [
        st(0, 7, shard=sh[0], replacement=True),
        st(1, 7, shard=sh[1]),
        st(2, 7, shard=sh[2]),
        st(3, 7, shard=sh[3], replacement=True),
    ]
    p = plan_repair(sts, 1, max_stripes=1)
    assert p.pairs == [[2, 0], [1, 3]] and p.fallback is None


def test_no_healthy_replica_for_a_shard_falls_back_to_restart_all():
    sh = ["tp0-pp0", "tp1-pp0", "tp0-pp0", "tp1-pp0"]
    sts = [
        st(0, 7, shard=sh[0], replacement=True),
        st(1, 7, shard=sh[1]),
        st(2, 7, shard=sh[2], dirty=True),
        st(3, 7, shard=sh[3]),
    ]
    p = plan_repair(sts, 1, max_stripes=1)
    assert p.fallback == RESTART_ALL and p.pairs == [] and "tp0-pp0" in p.reason


def test_lagging_only_holder_is_not_a_source():
    sts = [
        st(0, 3, shard="a"),
        st(1, 4, shard="b"),
        st(2, -1, shard="a", replacement=True),
        st(3, 4, shard="b"),
    ]
    p = plan_repair(sts, 1, max_stripes=1)
    assert p.fallback == RESTART_ALL and "'a'" in p.reason


def test_no_trusted_rank_at_all():
    p = plan_repair([st(0, 0, replacement=True), st(1, 0, dirty=True)], 1)
    assert p.fallback == RESTART_ALL


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="at least one"):
        plan_repair([], 1)
    with pytest.raises(ValueError, match="duplicate"):
        plan_repair([st(0, 1), st(0, 1)], 1)
    with pytest.raises(ValueError, match="generation 2"):
        plan_repair([st(0, 1)], 2)


def test_plan_round_trips_as_json():
    from launcher.protocol.plan import RepairPlan

    p = plan_repair([st(0, 2), st(1, -1, replacement=True)], 1)
    assert RepairPlan.from_json(p.to_json()) == p


def test_controller_import_does_not_load_torch():
    """The controller plans repairs inside a recovery round: planning must not load torch."""
    import subprocess
    import sys

    from helpers_runtime import base_env

    code = (
        "import sys; from launcher.control.repair_planning import plan_repair; "
        "print('torch' in sys.modules)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=base_env(), capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr


def test_plan_dump_saves_the_newest_healthy_step_written_by_the_lowest_holder() -> None:
    from launcher.control.repair_planning import plan_dump
    from launcher.protocol.plan import DUMP

    sts = [
        RankStatus(0, 2, False, 5, 6, shard="a"),
        RankStatus(1, 2, False, 5, 6, dirty=True, shard="b"),
        RankStatus(2, 2, False, 5, 6, shard="a"),
        RankStatus(3, 2, False, 4, 5, shard="b"),
        RankStatus(4, 2, True, -1, -1, shard="b"),
    ]
    p = plan_dump(sts, 2)
    assert (p.generation, p.resume_step, p.fallback) == (2, 6, DUMP)
    assert p.writers == {"a": 0}  # shard b has no healthy holder at step 5: nobody writes it
    assert plan_dump([RankStatus(0, 2, True, -1, -1, shard="a")], 2).resume_step == 0


def test_striped_repair_lists_up_to_max_stripes_sources_per_target_in_rank_order():
    sts = [
        st(0, 4),
        st(1, 4),
        st(2, -1, replacement=True),
        st(3, 4),
        st(4, 3),
        st(5, 4, dirty=True),
    ]
    p = plan_repair(sts, 1, max_stripes=2)
    assert p.pairs == [[0, 2], [1, 2], [0, 4], [1, 4], [0, 5], [1, 5]]
    assert plan_repair(sts, 1, max_stripes=8).pairs[:3] == [[0, 2], [1, 2], [3, 2]]
    # only up-to-date healthy ranks of the same shard send
    sts = [
        st(0, 4, shard="a"),
        st(1, 4, shard="b"),
        st(2, 4, shard="a", replacement=True),
        st(3, 4, shard="b"),
        st(4, 4, shard="a"),
        st(5, 4, shard="b", replacement=True),
    ]
    assert plan_repair(sts, 1, max_stripes=3).pairs == [[0, 2], [4, 2], [1, 5], [3, 5]]
    for bad in (-1, 17):
        with pytest.raises(ValueError, match=f"max_stripes={bad} must be 0 \\(auto"):
            plan_repair(sts, 1, max_stripes=bad)


def test_auto_striping_takes_the_lowest_up_to_date_replica_on_each_node():
    from launcher.control.repair_planning import AUTO_STRIPES

    # 3 nodes x 2 ranks, plain DDP: rank 3 (node 1) was replaced, rank 4 (node 2) is behind
    sts = [st(0, 4), st(1, 4), st(2, 4), st(3, -1, replacement=True), st(4, 3), st(5, 4)]
    node = lambda r: r // 2  # noqa: E731
    p = plan_repair(sts, 1, AUTO_STRIPES, node)
    assert p.pairs == [[0, 3], [2, 3], [5, 3], [0, 4], [2, 4], [5, 4]]  # one per node, rank order
    # on one node (the default without a map, and every single-host job) one replica sends
    assert plan_repair(sts, 1, AUTO_STRIPES).pairs == [[0, 3], [0, 4]]
    assert plan_repair(sts, 1).pairs == [[0, 3], [0, 4]]  # AUTO is the default
    # per shard: only the shard's own up-to-date holders count, and a node without one adds none
    sts = [
        st(0, 4, shard="a"),
        st(1, 4, shard="b"),
        st(2, 4, shard="a"),
        st(3, 4, shard="b"),
        st(4, -1, shard="a", replacement=True),
        st(5, 4, shard="b"),
    ]
    assert plan_repair(sts, 1, AUTO_STRIPES, node).pairs == [[0, 4], [2, 4]]
    # never more than MAX_STRIPES senders, however many nodes hold a replica
    sts = [st(r, 4) for r in range(20)] + [st(20, -1, replacement=True)]
    p = plan_repair(sts, 1, AUTO_STRIPES, lambda r: r)
    assert [src for src, _ in p.pairs] == list(range(16))


def test_check_statuses_wants_one_report_per_rank_of_the_round() -> None:
    from launcher.control.repair_planning import check_statuses

    check_statuses([st(0, 1), st(1, 1)], 1)
    with pytest.raises(ValueError, match="at least one"):
        check_statuses([], 1)
    with pytest.raises(ValueError, match=r"duplicate ranks in statuses: \[1, 1\]"):
        check_statuses([st(1, 1), st(1, 1)], 1)
    with pytest.raises(ValueError, match=r"ranks \[1\] are not for generation 1"):
        check_statuses([st(0, 1), st(1, 1, gen=2)], 1)


def test_pick_senders_takes_up_to_date_replicas_per_shard_in_rank_order() -> None:
    from launcher.control.repair_planning import AUTO_STRIPES, pick_senders

    healthy = [st(3, 5, shard="a"), st(0, 5, shard="a"), st(1, 4, shard="a"), st(2, 5, shard="b")]
    assert pick_senders(healthy, 5, max_stripes=2) == {"a": [0, 3], "b": [2]}
    assert pick_senders(healthy, 5, max_stripes=1) == {"a": [0], "b": [2]}
    # auto: one sender per node (ranks 0, 1 on node 0; 2, 3 on node 1), one node without node_of
    assert pick_senders(healthy, 5, AUTO_STRIPES, lambda r: r // 2) == {"a": [0, 3], "b": [2]}
    assert pick_senders(healthy, 5, AUTO_STRIPES) == {"a": [0], "b": [2]}
    assert pick_senders(healthy, 6, max_stripes=2) == {}  # nobody at step 6: every shard missing
    with pytest.raises(ValueError, match="max_stripes=17"):
        pick_senders(healthy, 5, max_stripes=17)


def reference_plan(sts, max_stripes=0, node_of=None):
    """The plan by the definition, every survivor paired (the plan before the fast path)."""
    healthy = [s for s in sts if not (s.replacement or s.dirty)]
    top = max(s.committed_step for s in healthy)
    sources: dict[str, list[int]] = {}
    used: dict[str, set[int]] = {}
    for s in sorted(healthy, key=lambda s: s.rank):
        if s.committed_step != top:
            continue
        chosen = sources.setdefault(s.shard, [])
        node = node_of(s.rank) if node_of else 0
        if max_stripes == 0:
            if node in used.setdefault(s.shard, set()) or len(chosen) >= 16:
                continue
            used[s.shard].add(node)
        elif len(chosen) >= max_stripes:
            continue
        chosen.append(s.rank)
    if {s.shard for s in sts} - set(sources):
        return None
    targets = sorted(
        (s for s in sts if s.replacement or s.dirty or s.committed_step < top),
        key=lambda s: s.rank,
    )
    return [[src, s.rank] for s in targets for src in sources[s.shard]]


@pytest.mark.parametrize("seed", range(40))
def test_the_plan_pairs_exactly_as_the_definition_on_random_rounds(seed):
    import random

    rng = random.Random(seed)
    n, per = rng.choice([(8, 2), (64, 8), (256, 16)])
    shards = [f"s{i}" for i in range(rng.choice([1, 2, 4]))]
    sts = []
    for r in range(n):
        kind = rng.random()
        sts.append(
            st(
                r,
                rng.choice([6, 7, 7, 7]),
                shard=shards[r % len(shards)],
                replacement=kind < 0.03,
                dirty=0.03 <= kind < 0.05,
            )
        )
    stripes = rng.choice([0, 0, 1, 3])
    node_of = (lambda r: r // per) if rng.random() < 0.8 else None
    want = reference_plan(sts, max_stripes=stripes, node_of=node_of)
    p = plan_repair(sts, 1, max_stripes=stripes, node_of=node_of)
    if want is None:
        assert p.fallback == RESTART_ALL and p.pairs == []
    else:
        assert p.fallback is None and p.pairs == want


def test_survivors_all_at_the_same_step_are_not_walked_for_senders():
    """4096 ranks on 64 nodes, one replacement: its shard's 16 senders (the lowest rank of
    each of the first 16 nodes) are found without asking for every survivor's node."""
    asked: list[int] = []

    def node_of(rank: int) -> int:
        asked.append(rank)
        return rank // 64

    sts = [st(r, 9) for r in range(4095)] + [st(4095, -1, replacement=True)]
    p = plan_repair(sts, 1, node_of=node_of)
    assert p.pairs == [[64 * n, 4095] for n in range(16)] and p.resume_step == 10
    assert len(asked) == 15 * 64 + 1  # the walk ends at the 16th node's first rank
