"""launcher/observe/run_view.py: the records of a run's view, and the one rule for time lost
(`Round.time_lost_s`, summed by `RunView.time_lost_s`, observed by the metrics)."""

from __future__ import annotations

from launcher.observe.run_view import Round, RunView


def ended(generation: int, start: float, end: float | None, outcome: str) -> Round:
    return Round(
        generation=generation,
        strategy="recover-in-place",
        plan_time=start,
        start=start,
        end=end,
        outcome=outcome,
    )


def test_a_rounds_time_lost_is_its_mttr_once_ended_and_none_when_superseded_or_running() -> None:
    assert ended(1, 10.0, 12.5, "recovered").time_lost_s == 2.5
    assert ended(1, 10.0, 12.5, "recovered").mttr_s == 2.5
    assert ended(2, 10.0, 11.0, "superseded").time_lost_s is None
    assert ended(2, 10.0, 11.0, "superseded").mttr_s == 1.0  # its MTTR is still shown
    assert ended(3, 10.0, None, "in-progress").time_lost_s is None


def test_the_jobs_time_lost_sums_its_rounds_and_is_in_the_json() -> None:
    v = RunView(
        rounds=[
            ended(1, 10.0, 11.0, "superseded"),
            ended(2, 11.0, 13.25, "recovered"),
            ended(3, 20.0, 20.5, "restarted"),
            ended(4, 30.0, None, "in-progress"),
        ]
    )
    assert v.time_lost_s == 2.75
    d = v.to_dict()
    assert d["time_lost_s"] == 2.75 and [r["mttr_s"] for r in d["rounds"]] == [1.0, 2.25, 0.5, None]
    assert RunView().time_lost_s == 0.0 and RunView().current_round is None
    assert v.current_round is v.rounds[-1]
