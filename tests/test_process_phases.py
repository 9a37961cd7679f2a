"""launcher/observe/process_phases.py (through the Timeline that feeds it): a process-level round
drawn as it happened on every rank, from synthetic events shaped like the agents': superseded
rounds with the survivors' stops and the replacement's respawn and start-up, the phases named
from the replacement's marks (respawn, imports, start-up, wait, rebuild, transfer, resume), the
start-up never drawn as transfer, and the live phase from the round's state."""

from __future__ import annotations

from helpers_observe import event_at

from launcher.observe.process_phases import live_phase
from launcher.observe.run_view import Bar
from launcher.observe.timeline import Timeline

T = 1000.0


def ev(t: float, name: str, generation: int = 0, **fields) -> dict:
    return event_at(T + t, name, generation, **fields)


def started(world: int = 3) -> list[dict]:
    out = [
        ev(0, "start", config={"rdzv_id": "job", "max_restarts": 3, "max_nodes": 1}),
        ev(0.1, "rendezvous", group_rank=0, world_size=world),
    ]
    out += [ev(0.2, "spawn", rank=r, local_rank=r, pid=100 + r) for r in range(world)]
    out += [ev(0.3, "hello", rank=r, pid=100 + r) for r in range(world)]
    return out


def kill(t: float, rank: int, generation: int, pid: int) -> list[dict]:
    return [
        ev(
            t,
            "worker-failed",
            generation,
            rank=rank,
            pid=pid,
            fault_kind="signal",
            detect_ms=100.0,
            message=f"rank {rank} (pid {pid}) signal: SIGKILL",
        )
    ]


def round_one() -> list[dict]:
    """Rank 1 killed at +2.9; generation 1 planned at +3.2, its node has the plan at +3.3."""
    return kill(3.0, 1, 0, 101) + [
        ev(3.1, "decide", rank=1, fault_kind="signal", strategy="recover-in-place", reason="r"),
        ev(3.2, "plan", 1, strategy="recover-in-place", failed_ranks=[1], restart_ranks=[1]),
        ev(3.3, "plan-received", 1, strategy="recover-in-place"),
        ev(3.4, "spawn", 1, rank=1, local_rank=1, pid=201, replacement=True),
    ]


def bars(ro) -> dict:
    return {(b.rank, b.phase): (round(b.start - T, 3), round(b.end - T, 3)) for b in ro.bars}


def test_a_superseded_round_shows_every_ranks_stop_and_the_replacements_respawn_and_start_up():
    events = (
        started()
        + round_one()
        + [
            ev(3.45, "rank-stopped", 1, rank=0, at=T + 3.45),
            ev(3.46, "rank-stopped", 1, rank=2, at=T + 3.46),
            ev(5.0, "hello", 1, rank=1, pid=201),
            ev(5.2, "rank-stopped", 1, rank=1, at=T + 5.2),
            *kill(6.0, 1, 1, 201),  # the replacement dies during its round
            ev(6.05, "round-superseded", 1, message="rank 1 failed during recovery"),
            ev(6.1, "plan", 2, strategy="recover-in-place", failed_ranks=[1], restart_ranks=[1]),
        ]
    )
    v = Timeline().feed_all(events).view()
    first = v.rounds[0]
    assert (first.outcome, round(first.end - T, 3)) == ("superseded", 6.1)
    got = bars(first)
    assert got[(0, "stop")] == (3.3, 3.45) and got[(0, "wait")] == (3.45, 6.1)
    assert got[(2, "stop")] == (3.3, 3.46) and got[(2, "wait")] == (3.46, 6.1)
    assert got[(1, "respawn")] == (3.3, 5.0) and got[(1, "start-up")] == (5.0, 5.2)
    assert got[(1, "wait")] == (5.2, 6.1)
    assert not any(b.open for b in first.bars)
    assert v.rounds[0].time_lost_s is not None


def marks(**at: float) -> dict:
    return {k: T + t for k, t in at.items()}


def recovered_with_marks(exec_marks: bool) -> list[dict]:
    rep = marks(status=5.0, plan=5.1, rebuilt=5.2, registered=7.0, received=7.4, repaired=7.45)
    if exec_marks:
        rep.update(marks(exec=3.5, imported=4.5))
    return [
        ev(3.45, "rank-stopped", 1, rank=0, at=T + 3.45),
        ev(3.46, "rank-stopped", 1, rank=2, at=T + 3.46),
        ev(4.8, "hello", 1, rank=1, pid=201),
        ev(5.15, "repair-plan", 1, resume_step=5, action="rollback", pairs=[[0, 1]]),
        ev(
            7.5,
            "rank-recovered",
            1,
            rank=0,
            resume_step=5,
            transfer_s=0.35,
            marks=marks(stopped=3.42, status=3.45, plan=5.1, rebuilt=5.2, repaired=7.45),
        ),
        ev(
            7.5,
            "rank-recovered",
            1,
            rank=2,
            resume_step=5,
            transfer_s=0.0,
            marks=marks(stopped=3.43, status=3.46, plan=5.1, rebuilt=5.2, repaired=7.45),
        ),
        ev(
            7.5,
            "rank-recovered",
            1,
            rank=1,
            resume_step=5,
            replacement=True,
            marks=rep,
            transfer_bytes=8_000_000,
            transfer_s=0.3,
            source=0,
        ),
        *[ev(8.0, "rank-resumed", 1, rank=r, step=5) for r in range(3)],
    ]


def test_the_replacements_phases_come_from_its_marks_and_transfer_is_only_the_transfer():
    v = Timeline().feed_all(started() + round_one() + recovered_with_marks(True)).view()
    (ro,) = v.rounds
    got = bars(ro)
    assert [b.phase for b in ro.bars if b.rank == 1] == [
        "detect",
        "decide",
        "respawn",
        "imports",
        "start-up",
        "wait",
        "rebuild",
        "start-up",
        "transfer",
        "resume",
    ]
    assert got[(1, "respawn")] == (3.3, 3.5) and got[(1, "imports")] == (3.5, 4.5)
    starts = [
        (round(b.start - T, 3), round(b.end - T, 3))
        for b in ro.bars
        if b.rank == 1 and b.phase == "start-up"
    ]
    assert starts == [(4.5, 5.0), (5.2, 7.1)]  # the script's start-up, before and after joining
    assert got[(1, "transfer")] == (7.1, 7.45)  # received at 7.4 after 0.3 s on the wire
    # the sender: its 0.35 s of sending included waiting for the receiver, which took 0.3 s
    assert got[(0, "transfer")] == (7.15, 7.45)
    assert got[(0, "wait")] == (5.2, 7.15)  # waited for the replacement's start-up
    assert (2, "transfer") not in got and (2, "wait") in got  # neither sent nor received
    assert [b.phase for b in ro.bars if b.rank == 2] == [
        "stop",
        "wait",
        "rebuild",
        "wait",
        "resume",
    ]
    assert max(b.end - b.start for b in ro.bars if b.phase == "transfer") <= 0.35 + 1e-6
    assert (2, "transfer") not in got


def test_an_older_run_without_exec_marks_draws_respawn_to_its_hello_and_no_start_up_as_transfer():
    v = Timeline().feed_all(started() + round_one() + recovered_with_marks(False)).view()
    (ro,) = v.rounds
    got = bars(ro)
    assert got[(1, "respawn")] == (3.3, 4.8) and (1, "imports") not in got
    phases = [(b.phase, round(b.start - T, 3)) for b in ro.bars if b.rank == 1]
    assert ("start-up", 4.8) in phases and ("start-up", 5.2) in phases
    assert got[(1, "transfer")] == (7.1, 7.45)


def phase_at(events: list[dict], upto: float) -> str:
    v = Timeline().feed_all([e for e in events if e["time"] <= T + upto]).view(now=T + upto)
    cur = v.current_round
    assert cur is not None
    return cur.phase


def test_the_live_phase_follows_the_rounds_state_without_flipping_back():
    events = started() + round_one() + recovered_with_marks(True)
    seen = [phase_at(events, t) for t in (3.35, 3.44, 3.5, 4.9, 5.16, 6.5, 7.6)]
    assert seen == ["stop", "stop", "respawn", "start-up", "start-up", "start-up", "resume"]
    v = Timeline().feed_all([e for e in events if e["time"] <= T + 4.0]).view(now=T + 4.0)
    stop = [b for b in v.current_round.bars if b.rank == 0 and b.phase == "stop"]
    assert [(round(b.end - T, 3), b.open) for b in stop] == [(3.45, False)]  # its real stop


def test_the_live_phase_of_bars():
    def bar(phase: str, open_: bool) -> Bar:
        return Bar(rank=0, phase=phase, start=0.0, end=1.0, open=open_)

    assert live_phase([bar("wait", True), bar("respawn", True)]) == "respawn"
    assert live_phase([bar("decide", False), bar("stop", False)]) == "resume"
    assert live_phase([]) == "stop"
