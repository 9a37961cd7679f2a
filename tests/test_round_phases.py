"""launcher/observe/round_phases.py: one round's outcome, phase bars and steps lost from its raw
edges (`RoundData`), and each fault charged with its round's cost. (Rounds built from whole
event streams: test_timeline.)"""

from __future__ import annotations

from launcher.observe.round_phases import RoundBuilder, charge_faults
from launcher.observe.run_view import FaultRow, RankRow, Round, RoundData, RunView


def fault(t: float, rank: int = 1) -> FaultRow:
    return FaultRow(
        time=t, rank=rank, node=0, host="h", kind="signal", evidence="SIGKILL", generation=0
    )


def restart_all(resumed_at: dict[int, float] | None = None) -> tuple[RoundBuilder, RoundData]:
    ranks = {r: RankRow(rank=r, node=0, state="training") for r in (0, 1)}
    run = RunView(progress={0: [[5.0, 7]], 1: [[5.0, 7]]})
    rd = RoundData(Round(generation=1, strategy="restart-all", plan_time=10.0, start=10.0))
    rd.node_plan[0] = 10.1
    rd.go = 11.0
    for r in (0, 1):
        rd.spawned[r] = {"time": 11.2, "rank": r}
        rd.hello[r] = 11.5
    for r, t in (resumed_at or {}).items():
        rd.resumed[r] = {"time": t, "step": 5}
    return RoundBuilder(ranks, {0, 1}, run), rd


def test_a_restart_all_round_ends_when_every_rank_resumed_with_its_phases_and_steps_lost() -> None:
    builder, rd = restart_all({0: 12.0, 1: 12.5})
    ro = builder.build(rd, now=20.0)
    assert (ro.outcome, ro.end, ro.mttr_s, ro.phase) == ("restarted", 12.5, 2.5, "")
    assert [(b.rank, b.phase, b.start, b.end) for b in ro.bars if b.rank == 1] == [
        (1, "stop", 10.1, 11.0),
        (1, "respawn", 11.0, 11.5),
        (1, "resume", 11.5, 12.5),
    ]
    assert ro.steps_lost == 3  # committed 7 before the plan, the ranks went on from step 5
    assert not any(b.open for b in ro.bars)


def test_a_round_still_running_has_open_bars_up_to_now() -> None:
    builder, rd = restart_all({0: 12.0})
    ro = builder.build(rd, now=14.0)
    assert (ro.outcome, ro.end, ro.phase) == ("in-progress", None, "resume")
    last = [b for b in ro.bars if b.rank == 1][-1]
    assert (last.phase, last.end, last.open) == ("resume", 14.0, True)


def test_faults_carry_their_rounds_cost_and_a_fallback_to_the_end() -> None:
    f, g = fault(9.0), fault(30.0, rank=0)
    first = Round(
        generation=1,
        strategy="retry",
        plan_time=10.0,
        start=9.0,
        end=12.0,
        fault=f,
        outcome="fallback",
    )
    first.steps_lost, first.transfer_bytes, first.transfer_s = 2, 1000, 0.5
    f.round = 1
    fallback = Round(
        generation=2,
        strategy="restart-all",
        plan_time=12.0,
        start=12.0,
        end=15.0,
        outcome="restarted",
    )
    fallback.fault = f  # the fallback round of the same fault
    other = Round(generation=3, strategy="retry", plan_time=30.5, start=30.0, fault=g)
    g.round = 3
    v = RunView(rounds=[first, fallback, other], faults=[f, g], now=31.0)
    v.settle_time_lost()
    charge_faults(v)
    assert (f.mttr_s, f.steps_lost, f.transfer_bytes, f.transfer_rate) == (6.0, 2, 1000, 2000.0)
    assert (g.mttr_s, g.transfer_rate) == (None, None)  # its round still runs
