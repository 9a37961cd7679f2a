"""launcher/observe/world_history.py: the world's size over time rebuilt from events (the start,
each live `world-shrink` and `world-grow`, a lost node's shrink and a `scale_up=restart` grow by
restart-all, a restart-all that brings every rank back), each change's first step and cost (its
round's time lost, a live grow's `cost_s`), the ranks a round after a shrink waits for, and the
words; from hand-written events shaped like the controller's (`world-grow` of the live grow with
the fields it will carry). End to end: a real 4-rank elastic-training job whose rank 3 is killed
shows the shrink 4 -> 3 in `ftctl status --json` and `ftctl report` of the finished run."""

from __future__ import annotations

import json
import subprocess

from helpers_launch import FTRUN, env_with, script
from helpers_observe import event_at, ftctl

from launcher.observe.run_view import WorldChange
from launcher.observe.timeline import Timeline
from launcher.observe.world_history import change_words, ranks_now, world_words

T = 1000.0


def ev(t: float, name: str, generation: int = 0, **fields) -> dict:
    return event_at(T + t, name, generation, **fields)


def started(world: int = 4) -> list[dict]:
    return [
        ev(0.1, "rendezvous", group_rank=0, world_size=world),
        *[ev(0.2, "spawn", rank=r, local_rank=r, pid=100 + r) for r in range(world)],
        *[ev(0.3, "hello", rank=r, pid=100 + r) for r in range(world)],
    ]


def resumed(t: float, generation: int, ranks, step: int = 18) -> list[dict]:
    return [ev(t, "rank-resumed", generation, rank=r, step=step) for r in ranks]


def live_shrink() -> list[dict]:
    """Rank 3 killed at +3.0; elastic-training drops it; ranks 0-2 train again at +3.5."""
    return started() + [
        ev(3.0, "worker-failed", rank=3, pid=103, fault_kind="signal", detect_ms=0.0),
        ev(3.01, "decide", rank=3, fault_kind="signal", strategy="elastic-training"),
        ev(3.02, "plan", 1, strategy="elastic-training", failed_ranks=[3], restart_ranks=[]),
        ev(
            3.1,
            "world-shrink",
            1,
            strategy="elastic-training",
            dropped=[3],
            world=[0, 1, 2],
            world_size=4,
            new_world_size=3,
        ),
        ev(3.12, "repair-plan", 1, resume_step=17, action="rollback", pairs=[], world=[0, 1, 2]),
        *resumed(3.5, 1, (0, 1, 2)),
    ]


def test_a_live_shrink_is_a_change_with_its_rounds_time_lost_and_its_first_step():
    v = Timeline().feed_all(live_shrink()).view()
    start, shrink = v.world_history
    assert (start.kind, start.world_size, start.time) == ("start", 4, T + 0.1)
    assert (shrink.kind, shrink.before, shrink.world_size, shrink.ranks) == ("shrink", 4, 3, [3])
    assert (shrink.step, shrink.round, shrink.live, shrink.time) == (17, 1, True, T + 3.1)
    (ro,) = v.rounds
    # the round is over once the world's ranks train again: rank 3 left, nobody waits for it
    assert (ro.outcome, ro.time_lost_s) == ("recovered", 0.5)
    assert (shrink.cost_s, shrink.cost_open) == (ro.time_lost_s, False)
    assert (v.world_size, v.original_world_size) == (3, 4)
    assert change_words(shrink) == "shrink 4 -> 3 at step 17 (rank 3's replica left): 0.50 s lost"
    assert {b.phase for b in ro.bars if b.rank == 3} == {"detect", "decide"}  # not waited for
    assert v.world_now() == {
        "size": 3,
        "original": 4,
        "since": T + 3.1,
        "step": 17,
        "kind": "shrink",
        "changes": 1,
    }


def test_while_the_shrinks_round_runs_its_cost_grows_with_it():
    events = live_shrink()[:-3]  # nobody resumed yet
    (_, shrink) = Timeline().feed_all(events).view(now=T + 4.0).world_history
    assert (shrink.cost_s, shrink.cost_open) == (1.0, True)
    assert change_words(shrink).endswith(": 1.00 s lost so far")


def test_a_live_grow_reports_its_cost_and_the_next_round_waits_for_every_rank_again():
    events = live_shrink() + [
        ev(10.0, "world-grow", 2, world=[0, 1, 2, 3], world_size=3, new_world_size=4, cost_s=1.25),
        ev(20.0, "worker-failed", rank=0, pid=100, fault_kind="signal", detect_ms=0.0),
        ev(20.01, "decide", 2, rank=0, fault_kind="signal", strategy="recover-in-place"),
        ev(20.02, "plan", 3, strategy="recover-in-place", failed_ranks=[0], restart_ranks=[0]),
        *resumed(21.0, 3, (0, 1, 2)),
    ]
    v = Timeline().feed_all(events).view()
    grow = v.world_history[-1]
    assert (grow.kind, grow.before, grow.world_size, grow.ranks) == ("grow", 3, 4, [3])
    assert (grow.cost_s, grow.live, v.world_size) == (1.25, True, 4)
    assert change_words(grow) == "grow 3 -> 4 (rank 3 joined): 1.25 s lost"
    # rank 3 is back in the world: the round after the grow is not over without it
    assert v.rounds[-1].outcome == "in-progress"
    v = Timeline().feed_all(events + resumed(21.2, 3, (3,))).view()
    assert (v.rounds[-1].outcome, v.rounds[-1].time_lost_s) == ("recovered", 1.2)
    assert [c.kind for c in v.world_history] == ["start", "shrink", "grow"]  # a fault: no change


def test_a_grow_without_its_cost_takes_its_rounds_or_says_none_is_known():
    grow = ev(10.0, "world-grow", 2, new_world_size=4)  # the optional fields left out
    (*_, c) = Timeline().feed_all(live_shrink() + [grow]).view().world_history
    assert (c.kind, c.before, c.world_size, c.ranks, c.cost_s) == ("grow", 3, 4, [], None)
    assert change_words(c) == "grow 3 -> 4 (ranks joined): cost not known"
    with_round = [
        ev(9.9, "plan", 2, strategy="elastic-training", failed_ranks=[], restart_ranks=[3]),
        ev(10.0, "world-grow", 2, world=[0, 1, 2, 3], world_size=3, new_world_size=4),
        *resumed(11.0, 2, range(4)),
    ]
    (*_, c) = Timeline().feed_all(live_shrink() + with_round).view().world_history
    assert (c.cost_s, c.round, c.ranks) == (1.1, 2, [3])


def test_a_restart_all_after_a_shrink_brings_every_rank_back():
    events = live_shrink() + [
        ev(6.0, "worker-failed", rank=0, pid=100, fault_kind="exit", detect_ms=0.0),
        ev(6.01, "decide", 1, rank=0, fault_kind="exit", strategy="restart-all"),
        ev(6.02, "plan", 2, strategy="restart-all", failed_ranks=[0], restart_ranks=[0, 1, 2, 3]),
        ev(6.5, "restart-all-go", 2),
        *[ev(6.6, "spawn", 2, rank=r, local_rank=r, pid=200 + r) for r in range(4)],
        *resumed(9.0, 2, range(3)),
    ]
    v = Timeline().feed_all(events).view()
    back = v.world_history[-1]
    assert (back.kind, back.before, back.world_size, back.ranks) == ("restart-all", 3, 4, [3])
    assert (back.round, back.live, back.cost_open) == (2, False, True)  # rank 3 not back yet
    v = Timeline().feed_all(events + resumed(9.5, 2, (3,))).view()
    back = v.world_history[-1]
    assert (back.cost_s, back.cost_open, v.world_size) == (3.5, False, 4)
    assert v.rounds[-1].outcome == "restarted"
    assert [c.kind for c in v.world_changes] == ["shrink", "restart-all"]


def test_a_lost_nodes_shrink_and_a_scale_up_grow_are_restart_alls():
    lost = [
        ev(0.1, "rendezvous", group_rank=0, world_size=8),
        ev(
            5.0, "world-shrink", lost_node=1, strategy="restart-all", world_size=8, new_world_size=4
        ),
        ev(5.1, "plan", 1, strategy="restart-all", failed_ranks=[4], restart_ranks=list(range(4))),
        ev(6.0, "round-joined", 1, group_rank=0, world_size=4, nnodes=1),
        *resumed(8.0, 1, range(4)),
        ev(20.0, "world-grow", 1, strategy="restart-all", nodes=1, world_size=4),  # scale_up
        ev(20.1, "plan", 2, strategy="restart-all", failed_ranks=[], new_round=1),
        ev(21.0, "rendezvous", 2, group_rank=0, world_size=8),
    ]
    v = Timeline().feed_all(lost).view(now=T + 22.0)
    _, shrink, grow = v.world_history
    assert (shrink.kind, shrink.before, shrink.world_size, shrink.node) == ("shrink", 8, 4, 1)
    assert (shrink.live, shrink.round, shrink.why) == (False, 1, "node 1 lost; restart-all")
    assert (grow.kind, grow.before, grow.world_size, grow.round) == ("grow", 4, 8, 2)
    assert grow.cost_open and grow.cost_s == 1.9  # its round runs: from its plan until now
    assert (v.world_size, v.original_world_size) == (8, 8)
    assert (shrink.cost_s, shrink.cost_open) == (3.0, False)  # until its restart-all ended


def test_a_shrink_with_only_its_new_size_is_still_a_change():
    events = started() + [ev(3.0, "world-shrink", 1, new_world_size=2)]
    (_, c) = Timeline().feed_all(events).view().world_history
    assert (c.kind, c.before, c.world_size, c.ranks, c.cost_s) == ("shrink", 4, 2, [], None)


def test_the_world_in_words_for_ftctl_status():
    clock = lambda t: f"t{t - T:.0f}"  # noqa: E731
    v = Timeline().feed_all(started()).view()
    assert world_words(v, clock) == "world 4 ranks (as started)"
    v = Timeline().feed_all(live_shrink()).view()
    assert world_words(v, clock) == "world 3 of 4 ranks since t3 (shrunk at step 17)"
    v.world_history.append(WorldChange(T + 9, 4, "grow", "rank 3 joined", before=3))
    assert world_words(v, clock) == "world 4 of 4 ranks since t9 (grew)"
    assert world_words(Timeline().view(), clock) == ""


def test_an_elastic_shrink_shows_in_status_and_report_of_the_finished_run(tmp_path):
    plan = [{"rank": 3, "step": 3, "phase": "backward", "kind": "kill"}]
    # no warm spares: a live shrink restarts nobody, and their torch imports cost the 2 cores
    cmd = FTRUN + ["--nproc_per_node", "4", "--max_restarts", "3", "--warm-spares", "0"]
    cmd += ["--recover-strategy", "elastic-training", "--log_dir", str(tmp_path / "logs")]
    cmd += [script("elastic_loop.py"), "--steps", "6", "--step-time", "0.05"]
    cmd += ["--consumed", str(tmp_path / "c{rank}.jsonl"), "--out", str(tmp_path / "p.pt")]
    res = subprocess.run(
        cmd,
        env=env_with(FTRUN_FAULT_PLAN=json.dumps(plan), FTRUN_STORE_TIMEOUT="60"),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    shown = ftctl("status", "--json", str(tmp_path / "logs"))
    assert shown.returncode == 0, shown.stderr
    d = json.loads(shown.stdout)
    assert (d["world"]["size"], d["world"]["original"], d["world"]["kind"]) == (3, 4, "shrink")
    shrink = d["world_history"][-1]
    (ro,) = d["rounds"]
    assert (shrink["before"], shrink["world_size"], shrink["ranks"]) == (4, 3, [3])
    assert shrink["cost_s"] == ro["time_lost_s"] and 0 < shrink["cost_s"] < 10
    assert ro["outcome"] == "recovered" and shrink["step"] == 3
    text = ftctl("status", str(tmp_path / "logs")).stdout
    assert "world 3 of 4 ranks since" in text and "(shrunk at step 3)" in text
    out = tmp_path / "report.html"
    assert ftctl("report", str(tmp_path / "logs"), "-o", str(out)).returncode == 0
    page = out.read_text()
    assert 'class="world-mark" data-kind="shrink" data-size="3"' in page
    assert "shrink 4 -&gt; 3 at step 3 (rank 3&#x27;s replica left)" in page
    assert "3 of 4 ranks (1 change)" in page


def test_the_ranks_in_the_world_after_its_changes():
    from launcher.observe.world_history import ranks_now

    v = Timeline().feed_all(live_shrink()).view()
    assert ranks_now(v.world_history) == [0, 1, 2]
    v.world_history.append(WorldChange(T + 9, 4, "grow", "rank 3 joined", before=3, ranks=[3]))
    assert ranks_now(v.world_history) == [0, 1, 2, 3]
    v.world_history.append(WorldChange(T + 20, 2, "shrink", "node 1 lost", before=4, live=False))
    assert ranks_now(v.world_history) == [0, 1] and ranks_now([]) == []


def test_a_hot_switch_is_a_change_of_the_same_size_with_its_cost_and_ranks():
    events = started() + [
        ev(5.0, "switch-start", 1, seq=1, ranks=[1]),
        ev(5.6, "plan", 1, strategy="hot-switch", failed_ranks=[], restart_ranks=[1]),
        ev(5.7, "switch-done", 1, moved=[1], sources=[0], resume_step=9, cost_s=0.42),
        ev(5.71, "repair-plan", 1, resume_step=9, action="commit", pairs=[[0, 1]]),
        *resumed(5.8, 1, range(4), step=9),
    ]
    v = Timeline().feed_all(events).view()
    start, switch = v.world_history
    assert (switch.kind, switch.before, switch.world_size, switch.ranks) == ("switch", 4, 4, [1])
    assert (switch.cost_s, switch.step, switch.round, switch.live) == (0.42, 9, 1, True)
    assert change_words(switch) == (
        "switch 4 -> 4 at step 9 (rank 1 moved to new processes): 0.42 s lost"
    )
    assert world_words(v, lambda t: "09:00:05") == (
        "world 4 of 4 ranks since 09:00:05 (ranks moved by a hot switch at step 9)"
    )
    assert ranks_now(v.world_history) == [0, 1, 2, 3]
