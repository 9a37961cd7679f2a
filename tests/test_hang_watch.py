"""The hang watch: progress (not liveness) resets a rank's clock; the allowance adapts to the step
times (floor, multiplier, first step, checkpoints); waiting ranks are spared unless their process
is frozen; the policy's fixed timeout (--hang-timeout) and knobs (FTRUN_HANG_*)."""

from __future__ import annotations

from launcher.hang.hang_watch import HangPolicy, HangWatch
from launcher.protocol.messages import Heartbeat

AUTO = HangPolicy(None, floor=3.0, multiplier=10.0, first_step=50.0, unmodified=600.0)


def beat(rank=1, step=3, phase="forward", committed=2, waiting=False, generation=-1) -> Heartbeat:
    return Heartbeat(
        rank=rank,
        step=step,
        phase=phase,
        committed_step=committed,
        waiting=waiting,
        generation=generation,
    )


def steps(h: HangWatch, times: list[float], rank: int = 1, start: float = 0.0) -> float:
    """Feed steps 0.. with the given durations; returns when the last one started."""
    t = start
    for i, d in enumerate([0.0] + times):
        t += d
        h.on_heartbeat(beat(rank, step=i, phase="step", committed=i - 1), now=t)
        h.on_heartbeat(beat(rank, step=i, phase="forward", committed=i - 1), now=t)
    return t


def ranks(found) -> list[int]:
    return [h.rank for h in found]


def test_only_progress_resets_the_clock() -> None:
    h = HangWatch(HangPolicy(10.0))
    steps(h, [1.0])
    h.on_heartbeat(beat(step=1, phase="backward", committed=0), now=100.0)
    h.on_heartbeat(beat(step=1, phase="backward", committed=0), now=108.0)  # alive, same place
    assert h.overdue([1], now=109.0) == []
    found = h.overdue([1], now=111.0)
    assert ranks(found) == [1] and found[0].idle_s == 11.0 and found[0].timeout_s == 10.0
    assert "not waiting in a collective" in found[0].basis
    h.on_heartbeat(beat(step=1, phase="optimizer", committed=0), now=111.5)
    assert h.overdue([1], now=112.0) == []
    assert h.overdue([2], now=500.0) == []  # a rank without heartbeats has no clock


def test_auto_timeout_is_the_floor_or_ten_times_the_slowest_recent_step() -> None:
    h = HangWatch(AUTO)
    t = steps(h, [0.1, 0.1, 0.1])  # fast steps: the floor (3 s)
    assert h.overdue([1], now=t + 2.9) == []
    assert [x.timeout_s for x in h.overdue([1], now=t + 3.1)] == [3.0]
    h2 = HangWatch(AUTO)
    t = steps(h2, [0.5, 1.0, 0.5])  # slowest 1.0 s: 10 s
    assert h2.overdue([1], now=t + 9.9) == []
    assert [x.timeout_s for x in h2.overdue([1], now=t + 10.1)] == [10.0]
    # only the last 20 steps count: an old slow step ages out
    h3 = HangWatch(AUTO)
    t = steps(h3, [2.0] + [0.1] * 20)
    assert [x.timeout_s for x in h3.overdue([1], now=t + 3.5)] == [3.0]


def test_first_step_and_checkpoints_get_the_longer_allowance() -> None:
    h = HangWatch(AUTO)
    h.on_heartbeat(beat(step=0, phase="forward", committed=-1), now=0.0)  # no step time known
    assert h.overdue([1], now=49.0) == []
    assert [x.timeout_s for x in h.overdue([1], now=51.0)] == [50.0]
    t = steps(h, [0.1, 0.1], start=60.0)
    h.on_heartbeat(beat(step=2, phase="checkpoint", committed=1), now=t + 0.1)
    assert h.overdue([1], now=t + 40.0) == []  # a save: first-step allowance, not the floor
    h.on_heartbeat(beat(step=3, phase="step", committed=2), now=t + 45.0)  # the save took ~45 s
    h.on_heartbeat(beat(step=3, phase="checkpoint", committed=2), now=t + 46.0)
    assert h.overdue([1], now=t + 46.0 + 448.0) == []  # 10 x the slowest save (44.9 s)
    assert ranks(h.overdue([1], now=t + 46.0 + 451.0)) == [1]


def test_explicit_timeout_replaces_the_step_rule_but_keeps_the_first_step_allowance() -> None:
    pol = HangPolicy(2.0, first_step=50.0)
    assert pol.step_timeout([5.0]) == 2.0 and pol.first_timeout() == 50.0
    assert HangPolicy(80.0, first_step=50.0).first_timeout() == 80.0
    h = HangWatch(pol)
    t = steps(h, [0.1])
    assert ranks(h.overdue([1], now=t + 2.5)) == [1]


def test_waiting_ranks_are_spared_unless_frozen_or_silent() -> None:
    h = HangWatch(AUTO)
    t = steps(h, [0.1, 0.1])
    h.on_heartbeat(beat(step=2, phase="backward", committed=1, waiting=True), now=t + 0.1)
    for k in range(1, 60):  # heartbeats keep coming, no progress: it waits on a peer
        h.on_heartbeat(beat(step=2, phase="backward", committed=1, waiting=True), now=t + k)
    assert h.overdue([1], now=t + 60.0, state_of=lambda r: "S") == []
    stopped = h.overdue([1], now=t + 60.0, state_of=lambda r: "T")
    assert ranks(stopped) == [1] and "SIGSTOP" in stopped[0].basis and stopped[0].state == "T"
    assert ranks(h.overdue([1], now=t + 60.0, state_of=lambda r: "D")) == [1]
    # heartbeats stopped (the whole process is frozen), state unknown
    silent = h.overdue([1], now=t + 90.0, state_of=lambda r: "")
    assert ranks(silent) == [1] and "heartbeats stopped" in silent[0].basis


def test_untimed_phases_only_count_when_frozen() -> None:
    h = HangWatch(AUTO)
    for phase in ("init", "recovering"):
        h.on_heartbeat(beat(step=5, phase=phase), now=70.0)
        for k in range(1, 100):
            h.on_heartbeat(beat(step=5, phase=phase), now=70.0 + k)
        assert h.overdue([1], now=170.0) == [], phase
        assert ranks(h.overdue([1], now=170.0, state_of=lambda r: "T")) == [1], phase
    h.stop_clock(1)
    assert h.overdue([1], now=1e6, state_of=lambda r: "T") == []  # said goodbye


def test_a_new_process_starts_a_new_clock_and_zero_turns_it_off() -> None:
    h = HangWatch(AUTO)
    steps(h, [0.1])
    h.forget(1)
    assert h.overdue([1], now=1000.0) == []
    h.on_heartbeat(beat(step=0, phase="forward", committed=-1), now=1000.0)
    assert h.overdue([1], now=1040.0) == []  # a new process: its first step again
    off = HangWatch(HangPolicy(0.0))
    off.on_heartbeat(beat(), now=0.0)
    assert not off.enabled and off.overdue([1], now=1e9, state_of=lambda r: "T") == []
    assert off.policy.describe() == "off"


def test_a_killed_rank_exits_as_a_hang_once() -> None:
    h = HangWatch(HangPolicy(1.0))
    t = steps(h, [0.1])
    (hang,) = h.overdue([1], now=t + 10.0)
    h.killed(hang)
    assert h.overdue([1], now=t + 20.0) == []  # not killed twice
    assert h.take_killed(1) is hang and h.take_killed(1) is None and h.take_killed(2) is None
    assert hang.evidence()["basis"] == hang.basis and hang.evidence()["weak"] is False


def test_policy_describes_itself_in_one_line() -> None:
    """(The FTRUN_HANG_* knobs are read by launcher.config: test_config.)"""
    assert "max(30s, 10 x slowest of the last 20 steps)" in HangPolicy().describe()
    assert "after a recovery stop 3s" in HangPolicy().describe()
    assert HangPolicy(7.0).unmodified_timeout() == 7.0 and HangPolicy(0.0).describe() == "off"


def test_step_times_the_rank_sent_count_even_when_the_agent_never_saw_two_step_starts() -> None:
    """Bug (CI): a fast loop's heartbeats are coalesced (0.2 s), so the agent's first timed beat
    can already show step 3 hung in forward; with no step time known it allowed the first-step
    300 s, and the hang went unseen until the 60 s collective timeout."""
    h = HangWatch(HangPolicy(2.0, first_step=300.0))
    h.on_heartbeat(Heartbeat(rank=1, step=-1, phase="init"), now=0.0)
    hb = Heartbeat(rank=1, step=3, phase="forward", committed_step=2, step_s=0.01)
    h.on_heartbeat(hb, now=1.0)
    found = h.overdue([1], now=3.5)
    assert ranks(found) == [1] and found[0].timeout_s == 2.0
    auto = HangWatch(AUTO)  # auto: max(floor, multiplier x the rank's own step times)
    auto.on_heartbeat(Heartbeat(rank=1, step=-1, phase="init"), now=0.0)
    auto.on_heartbeat(
        Heartbeat(rank=1, step=3, phase="forward", committed_step=2, step_s=0.5), now=1.0
    )
    assert auto.overdue([1], now=5.9) == [] and ranks(auto.overdue([1], now=6.1)) == [1]
    # a rank's repeated beats carry the same step time: it counts once per committed step
    auto.on_heartbeat(
        Heartbeat(rank=1, step=3, phase="backward", committed_step=2, step_s=0.5), now=2.0
    )
    assert list(auto.clocks[1].steps) == [0.5]


def test_leaving_a_collective_wait_restarts_the_clock() -> None:
    # A survivor waits 4 s on a hung peer; the agent's stop makes it leave the wait: its first
    # heartbeat after the stop still shows the phase it waited in, no longer waiting. The time
    # it waited is not its own idleness (before: found hung right away, idle 4 s > 3 s).
    h = HangWatch(AUTO)
    t = steps(h, [0.1, 0.1])
    h.on_heartbeat(beat(step=2, phase="backward", committed=1), now=t + 0.05)
    for k in range(1, 5):
        h.on_heartbeat(beat(step=2, phase="backward", committed=1, waiting=True), now=t + k)
    h.on_heartbeat(beat(step=2, phase="backward", committed=1, waiting=False), now=t + 4.1)
    assert h.overdue([1], now=t + 4.15) == []
    # from then on it is timed like any rank: no progress for the allowance is a hang (liveness
    # beats that do not leave a wait do not restart the clock)
    h.on_heartbeat(beat(step=2, phase="backward", committed=1), now=t + 6.0)
    found = h.overdue([1], now=t + 4.1 + 3.1)
    assert ranks(found) == [1] and "not waiting in a collective" in found[0].basis


def test_a_survivor_still_waiting_in_a_collective_after_a_stop_is_hung() -> None:
    """A CI run: a survivor sat in DDP's C++ all-reduce after the round's stop (which shuts down
    the sockets such waits use) for the controller's whole 120 s phase timeout. Still waiting
    `stop_answer` seconds after the stop, without entering the round, it is hung."""
    h = HangWatch(HangPolicy(None, floor=30.0, stop_answer=10.0))
    t = steps(h, [0.1, 0.1])
    waiting = beat(step=2, phase="backward", committed=1, waiting=True)
    h.on_heartbeat(waiting, now=t + 0.1)
    h.stop_sent(1, 4, now=t + 1.0)
    for k in range(2, 12):
        h.on_heartbeat(waiting, now=t + k)
    assert h.overdue([1], now=t + 10.5) == []  # within the allowance
    (hang,) = h.overdue([1], now=t + 11.5, state_of=lambda r: "S")
    assert hang.waiting and hang.timeout_s == 10.0 and hang.state == "S"
    assert "after the stop for generation 4" in hang.basis and "FTRUN_HANG_STOP" in hang.basis

    # one that entered the round answered the stop: its waits there are the round's (untimed)
    h2 = HangWatch(HangPolicy(None, floor=30.0, stop_answer=10.0))
    t = steps(h2, [0.1, 0.1])
    h2.on_heartbeat(waiting, now=t + 0.1)
    h2.stop_sent(1, 4, now=t + 1.0)
    h2.on_heartbeat(beat(step=2, phase="recovering", committed=1, waiting=True), now=t + 1.1)
    assert h2.overdue([1], now=t + 60.0) == []
    # a stop sent to a rank already in a round, or not waiting at all, starts nothing
    h2.stop_sent(1, 5, now=t + 61.0)
    assert h2.overdue([1], now=t + 80.0) == []
    h3 = HangWatch(HangPolicy(None, floor=30.0, stop_answer=10.0))
    t = steps(h3, [0.1, 0.1])
    h3.on_heartbeat(beat(step=2, phase="forward", committed=1), now=t + 0.1)
    h3.stop_sent(1, 4, now=t + 0.2)
    assert h3.overdue([1], now=t + 20.0) == []  # computing: it sees the stop at its next phase edge


def test_a_stop_answered_by_a_heartbeat_of_its_generation_is_not_held_against_a_later_wait() -> (
    None
):
    """CI on 9c0c29b: a survivor's quick round left no 'recovering' heartbeat (the channel
    coalesces progress), the stop stayed recorded, and when the survivor later waited on a peer
    the fault plan had hung it was killed 10 s after the old stop, in the hung peer's place. A
    heartbeat of the stop's generation (or a newer one) answers the stop whatever its phase."""
    h = HangWatch(HangPolicy(None, floor=30.0, stop_answer=10.0))
    t = steps(h, [0.1, 0.1])
    h.on_heartbeat(
        beat(step=2, phase="backward", committed=1, waiting=True, generation=0), now=t + 0.1
    )
    h.stop_sent(1, 1, now=t + 0.2)
    # next heartbeat: already back at work in generation 1, waiting on a hung peer from then on
    later = beat(step=3, phase="backward", committed=2, waiting=True, generation=1)
    for k in range(1, 30):
        h.on_heartbeat(later, now=t + k)
    assert h.overdue([1], now=t + 29.5) == []  # a peer's hang: the step rule waits on it

    # without the generation (an older sender) the same heartbeats leave the stop unanswered
    h2 = HangWatch(HangPolicy(None, floor=30.0, stop_answer=10.0))
    t = steps(h2, [0.1, 0.1])
    h2.on_heartbeat(beat(step=2, phase="backward", committed=1, waiting=True), now=t + 0.1)
    h2.stop_sent(1, 1, now=t + 0.2)
    for k in range(1, 30):
        h2.on_heartbeat(beat(step=3, phase="backward", committed=2, waiting=True), now=t + k)
    assert ranks(h2.overdue([1], now=t + 29.5)) == [1]

    # a stop sent after the rank already said it is in that generation records nothing
    h3 = HangWatch(HangPolicy(None, floor=30.0, stop_answer=10.0))
    t = steps(h3, [0.1, 0.1])
    h3.on_heartbeat(
        beat(step=2, phase="backward", committed=1, waiting=True, generation=1), now=t + 0.1
    )
    h3.stop_sent(1, 1, now=t + 0.2)
    assert h3.overdue([1], now=t + 20.0) == []
    # while a rank still in an older generation is held to the stop
    h3.stop_sent(1, 2, now=t + 20.0)
    assert ranks(h3.overdue([1], now=t + 31.0)) == [1]


def test_a_survivor_that_reports_its_wait_stuck_after_a_stop_is_hung_at_once() -> None:
    """The runtime's own check (StuckWaitAlarm): its C++ wait outlived the stop's socket
    shutdown by a second. Hung then, without waiting FTRUN_HANG_STOP; the flag alone, with no
    stop recorded, blames nobody."""
    h = HangWatch(HangPolicy(None, floor=30.0, stop_answer=10.0))
    t = steps(h, [0.1, 0.1])
    h.on_heartbeat(
        beat(step=2, phase="backward", committed=1, waiting=True, generation=0), now=t + 0.1
    )
    h.stop_sent(1, 1, now=t + 0.2)
    assert h.overdue([1], now=t + 1.0) == []
    stuck = Heartbeat(
        rank=1, step=2, phase="backward", committed_step=1, waiting=True, generation=0, stuck=True
    )
    h.on_heartbeat(stuck, now=t + 1.3)
    (hang,) = h.overdue([1], now=t + 1.4)
    assert "after the stop for generation 1" in hang.basis and "its own check" in hang.basis

    h2 = HangWatch(HangPolicy(None, floor=30.0, stop_answer=10.0))
    t = steps(h2, [0.1, 0.1])
    h2.on_heartbeat(stuck, now=t + 0.1)
    assert h2.overdue([1], now=t + 5.0) == []
