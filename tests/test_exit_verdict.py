"""exit_verdict: what a worker's exit means, every branch, without processes."""

from __future__ import annotations

import dataclasses

import pytest

from launcher.agent.exit_verdict import ExitFacts, FaultClass, Verdict, exit_verdict, fault_kind
from launcher.protocol import plan as P
from launcher.protocol.faults import FaultKind

PLAIN = ExitFacts(
    code=1,
    current=True,
    stopping=False,
    aware=False,
    hung_at_exit=False,
    after_goodbye=False,
)


def facts(**changes: object) -> ExitFacts:
    return dataclasses.replace(PLAIN, **changes)


def test_an_older_process_of_the_rank_is_superseded_whatever_else_holds() -> None:
    assert exit_verdict(facts(current=False)) is Verdict.SUPERSEDED
    assert exit_verdict(facts(current=False, code=0, stopping=True)) is Verdict.SUPERSEDED


def test_a_process_ftrun_was_stopping_is_stopped_even_when_it_failed_or_finished() -> None:
    assert exit_verdict(facts(stopping=True)) is Verdict.STOPPED
    assert exit_verdict(facts(stopping=True, code=0)) is Verdict.STOPPED
    assert exit_verdict(facts(stopping=True, code=-9, hung_at_exit=True)) is Verdict.STOPPED


def test_the_fallback_code_is_a_fallback_only_for_a_runtime_rank() -> None:
    assert exit_verdict(facts(code=P.EXIT_FALLBACK, aware=True)) is Verdict.FALLBACK
    assert exit_verdict(facts(code=P.EXIT_FALLBACK, aware=False)) is Verdict.FAULT


def test_exit_zero_is_finished() -> None:
    assert exit_verdict(facts(code=0)) is Verdict.FINISHED
    assert exit_verdict(facts(code=0, aware=True, hung_at_exit=True)) is Verdict.FINISHED


def test_killed_after_hanging_at_exit_counts_as_finished() -> None:
    v = exit_verdict(facts(code=-9, hung_at_exit=True, after_goodbye=True))
    assert v is Verdict.HUNG_AT_EXIT and v.done_with_the_job


def test_a_signal_in_the_teardown_after_goodbye_counts_as_finished() -> None:
    v = exit_verdict(facts(code=-6, after_goodbye=True))
    assert v is Verdict.AFTER_GOODBYE and v.done_with_the_job


@pytest.mark.parametrize("code", [1, -9, -11, 2])
def test_anything_else_is_a_fault(code: int) -> None:
    assert exit_verdict(facts(code=code)) is Verdict.FAULT
    assert exit_verdict(facts(code=code, aware=True)) is Verdict.FAULT


def test_only_finishing_verdicts_are_done_with_the_job() -> None:
    done = {v for v in Verdict if v.done_with_the_job}
    assert done == {Verdict.FINISHED, Verdict.HUNG_AT_EXIT, Verdict.AFTER_GOODBYE}


def test_fault_kind_hang_wins_over_everything() -> None:
    broken = "RuntimeError: Connection closed by peer"
    assert fault_kind(-9, True, False, broken) == FaultClass(FaultKind.HANG)
    assert fault_kind(1, True, True, "") == FaultClass(FaultKind.HANG)


def test_fault_kind_by_code() -> None:
    assert fault_kind(-11, False, False, "Segmentation fault") == FaultClass(FaultKind.SIGNAL)
    assert fault_kind(3, False, True, "ValueError: boom") == FaultClass(FaultKind.EXIT)


def test_a_broken_collective_makes_a_rank_without_the_runtime_a_network_fault() -> None:
    from launcher.protocol.faults import COLLECTIVE_FAILURE_TEXT

    needle = COLLECTIVE_FAILURE_TEXT[0][0]
    text = f"Traceback ...\nRuntimeError: {needle}\n"
    found = fault_kind(1, False, False, text)
    assert found.kind is FaultKind.NETWORK and found.collective
    # a runtime rank reports its own collectives: its exit keeps its kind
    assert fault_kind(1, False, True, text) == FaultClass(FaultKind.EXIT)
    assert fault_kind(-6, False, True, text) == FaultClass(FaultKind.SIGNAL)
