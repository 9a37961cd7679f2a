"""launcher/observe/run_view.py: the records of a run's view, and the one rule for time lost
(`settle_time_lost`: a round's span from its fault until every rank trains again, whatever its
outcome; `lost_spans`: the job's time lost as their union). Every consumer of the rule, fed from
events: test_timeline."""

from __future__ import annotations

from launcher.observe.run_view import LostSpan, Round, RunView, lost_spans, settle_time_lost


def ended(generation: int, start: float, end: float | None, outcome: str) -> Round:
    return Round(
        generation=generation,
        strategy="recover-in-place",
        plan_time=start,
        start=start,
        end=end,
        outcome=outcome,
    )


def test_a_round_that_ended_the_recovery_loses_its_mttr() -> None:
    ro = ended(1, 10.0, 12.5, "recovered")
    assert ro.time_lost_s is None  # not settled yet
    settle_time_lost([ro], now=30.0)
    assert (ro.time_lost_s, ro.mttr_s, ro.lost_until, ro.lost_open) == (2.5, 2.5, 12.5, False)


def test_a_superseded_round_loses_until_the_round_that_took_over_ended() -> None:
    first, second = ended(1, 10.0, 11.0, "superseded"), ended(2, 10.8, 14.0, "recovered")
    settle_time_lost([second, first], now=30.0)  # in any order: generations decide
    assert (first.time_lost_s, first.mttr_s, first.lost_open) == (4.0, 1.0, False)
    assert second.time_lost_s == 3.2


def test_a_chain_of_rounds_taken_over_follows_to_its_last_round() -> None:
    rounds = [
        ended(1, 10.0, 11.0, "superseded"),
        ended(2, 10.9, 12.0, "fallback"),
        ended(3, 12.0, 15.0, "restarted"),
    ]
    settle_time_lost(rounds, now=30.0)
    assert [r.time_lost_s for r in rounds] == [5.0, 4.1, 3.0]
    assert [r.lost_until for r in rounds] == [15.0, 15.0, 15.0]


def test_while_nothing_ended_the_recovery_time_lost_runs_to_now() -> None:
    first, second = ended(1, 10.0, 11.0, "superseded"), ended(2, 10.8, None, "in-progress")
    settle_time_lost([first, second], now=20.0)
    assert (first.time_lost_s, first.lost_open) == (10.0, True)
    assert (second.time_lost_s, second.lost_open) == (9.2, True)
    settle_time_lost([first, second], now=25.0)  # it grows
    assert (first.time_lost_s, second.time_lost_s) == (15.0, 14.2)
    exit_round = ended(3, 40.0, None, "exit")  # ends with the job, which still runs
    settle_time_lost([exit_round], now=41.5)
    assert (exit_round.time_lost_s, exit_round.lost_open) == (1.5, True)


def test_the_jobs_time_lost_is_the_union_of_the_rounds_spans() -> None:
    v = RunView(
        now=35.0,
        rounds=[
            ended(1, 10.0, 11.0, "superseded"),  # 10 -> 13.25 (round 2's end)
            ended(2, 11.0, 13.25, "recovered"),  # inside round 1's span
            ended(3, 13.0, 14.0, "recovered"),  # overlaps the end of round 1's span
            ended(4, 20.0, 20.5, "restarted"),
            ended(5, 30.0, None, "in-progress"),  # to now
        ],
    )
    v.settle_time_lost()
    assert [r.time_lost_s for r in v.rounds] == [3.25, 2.25, 1.0, 0.5, 5.0]
    assert v.lost_spans == [
        LostSpan(10.0, 14.0, (1, 2, 3)),
        LostSpan(20.0, 20.5, (4,)),
        LostSpan(30.0, 35.0, (5,), open=True),
    ]
    assert v.time_lost_s == 4.0 + 0.5 + 5.0  # not the rounds' sum (12.0)
    d = v.to_dict()
    assert d["time_lost_s"] == 9.5
    assert [r["mttr_s"] for r in d["rounds"]] == [1.0, 2.25, 1.0, 0.5, None]
    assert [r["time_lost_s"] for r in d["rounds"]] == [3.25, 2.25, 1.0, 0.5, 5.0]
    assert [r["lost_open"] for r in d["rounds"]] == [False] * 4 + [True]
    assert RunView().time_lost_s == 0.0 and RunView().current_round is None
    assert v.current_round is v.rounds[-1]


def test_lost_spans_skip_rounds_not_settled_and_merge_touching_ones() -> None:
    a, b = ended(1, 1.0, 2.0, "recovered"), ended(2, 2.0, 3.0, "recovered")
    assert lost_spans([a, b]) == []
    settle_time_lost([a, b], now=None)
    assert lost_spans([b, a]) == [LostSpan(1.0, 3.0, (1, 2))]
    assert lost_spans([b, a])[0].seconds == 2.0
