"""The job's fault history (launcher.control.fault_history): one entry per fault, the strategies
tried for it in order, and how it ended."""

from __future__ import annotations

from launcher.control.decision import Decision
from launcher.control.fault_history import IN_PROGRESS, FaultHistory, entry
from launcher.protocol import plan as P


def cause(rank: int, kind: str = "signal", **evidence) -> P.Fault:
    return P.Fault(kind=kind, rank=rank, node=0, generation=0, message="m" * 600, evidence=evidence)


def test_a_new_entry_records_the_fault_and_its_first_strategy() -> None:
    e = entry(cause(2, "hang", consequences=[{"rank": 0}, {"rank": 1}]), P.RETRY, 3)
    assert (e["rank"], e["kind"], e["handling"], e["outcome"]) == (
        2,
        "hang",
        [[P.RETRY, 3]],
        IN_PROGRESS,
    )
    assert len(e["message"]) == 500 and e["consequences"] == 2


def test_a_fallback_continues_the_fault_and_a_new_fault_supersedes_it() -> None:
    h = FaultHistory()
    h.note(Decision(P.RETRY, "r", cause(1)), 1)
    h.note(Decision(P.RESTART_ALL, "fallback", cause(1), continues=True), 2)
    assert [x["handling"] for x in h.entries] == [[[P.RETRY, 1], [P.RESTART_ALL, 2]]]
    h.note(Decision(P.RECOVER_IN_PLACE, "r", cause(3)), 3)
    assert h.entries[0]["outcome"] == "superseded by rank 3 signal in generation 3"
    assert h.entries[1]["outcome"] == IN_PROGRESS


def test_exit_and_dump_fail_at_once_and_a_completed_round_sets_the_outcome_once() -> None:
    h = FaultHistory()
    h.note(Decision(P.RECOVER_IN_PLACE, "r", cause(1)), 1)
    assert not h.outcome(2, "recovered")  # not this fault's latest round
    assert h.outcome(1, "recovered") and h.entries[0]["outcome"] == "recovered"
    assert not h.outcome(1, "recovered again")  # no longer in progress
    h.note(Decision(P.EXIT, "budget spent", cause(2)), 2)
    assert h.entries[0]["outcome"] == "recovered"  # ended before: not superseded
    assert h.entries[1]["outcome"] == "failed: budget spent"
    copy = h.copy()
    copy[1]["outcome"] = "changed"
    assert h.entries[1]["outcome"] == "failed: budget spent"
    assert FaultHistory(copy).entries == copy
