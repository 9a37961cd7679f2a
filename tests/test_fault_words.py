"""launcher/observe/fault_words.py: a fault and what ftrun did, in an operator's words (built from
the records a Timeline makes of real-shaped events, so the fields are the ones the agents fill)."""

from __future__ import annotations

from helpers_observe import event_at

from launcher.observe.fault_words import describe
from launcher.observe.run_view import FaultRow, Round
from launcher.observe.timeline import Timeline

T = 1000.0


def ev(t: float, name: str, generation: int = 0, **fields) -> dict:
    return event_at(T + t, name, generation, **fields)


def killed_and_repaired() -> list[dict]:
    return [
        ev(0, "rendezvous", group_rank=0, world_size=4),
        *[ev(0.1, "spawn", rank=r, local_rank=r, pid=100 + r) for r in range(4)],
        ev(1, "inject", rank=2, fault_kind="kill", injected=True),
        ev(
            1.1,
            "worker-failed",
            rank=2,
            pid=102,
            exitcode=-9,
            signal="SIGKILL",
            fault_kind="signal",
            message="rank 2 (pid 102) signal: Signal 9 (SIGKILL) received",
        ),
        ev(
            1.2,
            "decide",
            rank=2,
            fault_kind="signal",
            strategy="recover-in-place",
            reason="retry: retry handles network, uce-high, uce-low, unsafe-data, not signal; "
            "restart only the failed rank and repair it from a replica",
        ),
        ev(1.3, "plan", 1, strategy="recover-in-place", failed_ranks=[2], restart_ranks=[2]),
        ev(1.5, "repair-plan", 1, resume_step=17, action="rollback", pairs=[[0, 2]]),
    ]


def test_a_killed_rank_repaired_from_a_replica_in_words():
    v = Timeline().feed_all(killed_and_repaired()).view()
    (f,) = v.faults
    assert f.summary == (
        "rank 2 was killed (SIGKILL) (a drill: injected); ftrun restarted only rank 2 and copied "
        "its state from rank 0; every rank went on at step 17 (still running)."
    )
    assert "retry handles" in f.reason  # the controller's words stay for engineers


def test_a_fault_during_a_round_and_a_fallback_in_words():
    events = killed_and_repaired() + [
        ev(
            2.0,
            "worker-failed",
            1,
            rank=1,
            pid=101,
            exitcode=1,
            fault_kind="exit",
            message="exited with code 1 (no error file: ...)",
        ),
        ev(2.1, "round-superseded", 1, message="rank 1 failed during recovery"),
        ev(2.2, "plan", 2, strategy="recover-in-place", failed_ranks=[1, 2], restart_ranks=[1, 2]),
        ev(2.5, "fallback", 2, strategy="restart-all", reason="no healthy replica"),
        ev(2.6, "plan", 3, strategy="restart-all", failed_ranks=[1, 2], restart_ranks=[0, 1, 2, 3]),
        ev(9.0, "job-done"),
    ]
    v = Timeline().feed_all(events).view()
    first, second = v.faults
    assert first.summary.endswith("(a later fault cut that round short).")
    assert second.summary == (
        "rank 1's process exited with code 1, during the recovery of an earlier fault; ftrun "
        "restarted only ranks 1 and 2, which could not complete (fallback), so it then stopped "
        "and restarted every rank (from the last checkpoint, if any)."
    )


def test_every_kind_reads_as_words():
    def row(kind: str, **kw) -> FaultRow:
        return FaultRow(
            time=0,
            rank=3,
            node=1,
            host="h",
            kind=kind,
            evidence=kw.pop("ev", ""),
            generation=0,
            **kw,
        )

    retry = Round(generation=1, strategy="retry", plan_time=0, resume_step=9, outcome="recovered")
    assert describe(row("uce-low"), [retry]) == (
        "rank 3 hit an uncorrectable memory error on its device (UCE, repairable in place); "
        "ftrun retried in place on every rank, no process restarted, going on at step 9."
    )
    assert describe(row("signal", ev="Signal 11 (SIGSEGV) received"), []).startswith(
        "rank 3 crashed (SIGSEGV, a segmentation fault)"
    )
    assert describe(row("hang"), []) == "rank 3 hung (no progress) and was killed by ftrun."
    lost = FaultRow(
        time=0, rank=None, node=1, host="n1", kind="node-lost", evidence="", generation=0
    )
    assert describe(lost, []) == "node 1 (n1) was lost (its agent stopped answering)."


def test_a_round_that_restarted_no_rank_reads_without_failing():
    """A lost node's fault (no rank) in a process-level round that restarted nobody (the
    c10d shrink of a lost node: the survivors carry on): words, not an IndexError."""
    f = FaultRow(
        time=T, rank=None, node=1, host="h", kind="node-lost", evidence="no heartbeat", generation=0
    )
    ro = Round(generation=1, strategy="recover-in-place", plan_time=T + 1, fault=f)
    text = describe(f, [ro])
    assert "repaired the failed ranks" in text, text


def test_an_elastic_training_round_and_its_fallback_in_words():
    f = FaultRow(time=T, rank=3, node=0, host="h", kind="signal", evidence="", generation=0)
    f.signal = "SIGKILL"
    shrunk = Round(
        generation=1,
        strategy="elastic-training",
        plan_time=T,
        failed_ranks=[3],
        resume_step=17,
        outcome="recovered",
    )
    assert describe(f, [shrunk]) == (
        "rank 3 was killed (SIGKILL); ftrun let rank 3 leave the world with its replica, "
        "restarting no process: the other ranks went on live in a smaller world at step 17."
    )
    fell = Round(
        generation=1, strategy="elastic-training", plan_time=T, failed_ranks=[3], outcome="fallback"
    )
    restart = Round(generation=2, strategy="restart-all", plan_time=T + 1, outcome="restarted")
    assert describe(f, [fell, restart]) == (
        "rank 3 was killed (SIGKILL); ftrun tried to go on live without rank 3 and its replica "
        "(elastic-training), which could not complete (fallback), so it then stopped and "
        "restarted every rank (from the last checkpoint, if any)."
    )
