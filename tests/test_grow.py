"""launcher.control.grow: when the world grows back after a live shrink, and the grow round's
repair plan; the rules alone, then a running controller on an in-process store (LocalKV) with
the ranks played by the test: shrink 4 -> 3, rank 3's returning process posts its status, the
survivors halt at one step boundary, the grow round takes rank 3 back (or, when it cannot, the
world stays shrunk and the job goes on)."""

from __future__ import annotations

import threading
import time

import pytest

from launcher.control.controller import Controller
from launcher.control.controller_settings import ControllerSettings
from launcher.control.fault_intake import post_fault
from launcher.control.grow import grow_plan, returning
from launcher.control.round_phase import RoundPhase
from launcher.observe.logs import AgentLog, read_event_file
from launcher.protocol import plan as P
from rendezvous.store.memory import LocalKV


def status(rank: int, g: int, committed: int = 5, back: bool = False, shard: str = "dp"):
    return P.RankStatus(
        rank=rank,
        generation=g,
        replacement=back,
        committed_step=-1 if back else committed,
        step=-1 if back else committed,
        shard=shard,
        shrinkable=True,
    )


# ---- the rules ------------------------------------------------------------------------------
def test_returning_lists_the_dropped_ranks_whose_process_posted_its_status() -> None:
    kv = LocalKV()
    assert returning(kv, 2, set()) == []
    kv.set(P.status_key(2, 3), status(3, 2, back=True).to_json())
    kv.set(P.status_key(1, 1), status(1, 1, back=True).to_json())  # another generation
    assert returning(kv, 2, {1, 3}) == [3]


def test_a_grow_takes_the_returning_rank_back_with_its_replicas_state() -> None:
    sts = [status(0, 2), status(1, 2), status(2, 2), status(3, 2, back=True)]
    got, why = grow_plan(sts, 2, [0, 1, 2, 3], [3])
    assert why == "" and got.world == [0, 1, 2, 3] and got.pairs == [[0, 3]]
    assert got.resume_step == 6 and got.action == "commit" and not got.fallback


@pytest.mark.parametrize(
    "statuses, world, back, because",
    [
        # the returning rank reports a state of its own: not a returning process
        ([status(0, 2), status(1, 2), status(2, 2), status(3, 2)], [0, 1, 2, 3], [3], "own"),
        # its shard has no replica among the survivors
        (
            [status(0, 2), status(1, 2), status(2, 2), status(3, 2, back=True, shard="tp1")],
            [0, 1, 2, 3],
            [3],
            "no healthy replica",
        ),
        # a grow into a renumbered world (rank 1 still dropped) would transfer across numbers
        ([status(0, 2), status(2, 2), status(3, 2, back=True)], [0, 2, 3], [3], "renumbered"),
    ],
)
def test_a_grow_that_cannot_be_made_keeps_the_shrunk_world(statuses, world, back, because):
    got, why = grow_plan(statuses, 2, world, back)
    assert because in why
    assert got.world == [r for r in world if r not in back] and not got.fallback
    assert got.pairs == [] and got.reason.startswith("no grow: ")


# ---- a running controller -------------------------------------------------------------------
def _controller(kv, tmp_path, phase_timeout: float = 5.0) -> Controller:
    for r in range(4):
        kv.set(P.aware_key(r), b"1")
    log = AgentLog(0, str(tmp_path / "events.jsonl"), quiet=True)
    settings = ControllerSettings(
        4, 1, 3, (P.ELASTIC, P.RESTART_ALL, P.EXIT), phase_timeout=phase_timeout, window=0.1
    )
    c = Controller(kv, log, settings)
    c.start()
    return c


def _events(tmp_path, name: str) -> list[dict]:
    return [e for e in read_event_file(str(tmp_path / "events.jsonl")) if e["event"] == name]


def _shrink(kv) -> None:
    """Rank 3 is killed; the survivors report; the world is [0, 1, 2]."""
    post_fault(kv, P.Fault(kind="signal", rank=3, node=0, generation=0, message="killed"))
    plan = P.Plan.from_json(kv.get(P.plan_key(1), 10.0))
    assert plan.strategy == P.ELASTIC
    for r in range(3):
        kv.set(P.status_key(1, r), status(r, 1, committed=2).to_json())
    rp = P.RepairPlan.from_json(kv.get(P.repair_key(1), 10.0))
    assert rp.world == [0, 1, 2]


def _halt_after(kv, step: int, ranks=(0, 1, 2), newer_than: int = 0) -> threading.Thread:
    """The survivors: once a pause newer than `newer_than` is requested, each halts after
    `step`."""

    def run() -> None:
        seq, deadline = 0, time.monotonic() + 10.0
        while seq <= newer_than and time.monotonic() < deadline:
            raw = kv.try_get(P.PAUSE_KEY)
            seq = P.PauseRequest.from_json(raw).seq if raw else 0
            time.sleep(0.01)
        for r in ranks:
            kv.set(P.pause_halted_key(seq, r), str(step).encode())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_the_world_grows_back_once_the_returning_process_is_ready(tmp_path) -> None:
    kv = LocalKV()
    c = _controller(kv, tmp_path)
    try:
        _shrink(kv)
        time.sleep(0.6)
        assert kv.try_get(P.plan_key(2)) is None  # nothing returned yet: no grow
        halted = _halt_after(kv, 5)
        kv.set(P.status_key(2, 3), status(3, 2, back=True).to_json())
        plan = P.Plan.from_json(kv.get(P.plan_key(2), 10.0))
        halted.join(5.0)
        assert plan.strategy == P.GROW and plan.restart_ranks == [3] and plan.failed_ranks == []
        assert plan.restarts_used == 1  # the grow is not charged
        assert c.phase is RoundPhase.COLLECTING
        for r in range(3):  # the survivors enter the round at the boundary after step 5
            kv.set(P.status_key(2, r), status(r, 2).to_json())
        rp = P.RepairPlan.from_json(kv.get(P.repair_key(2), 10.0))
        assert rp.world == [0, 1, 2, 3] and rp.pairs == [[0, 3]]
        assert (rp.resume_step, rp.action) == (6, "commit")
        seq = P.PauseRequest.from_json(kv.get(P.PAUSE_KEY, 1.0)).seq
        assert kv.try_get(P.resume_key(seq)) == b"world grow: generation 2"
        assert c.driver.dropped == set()
        (grow,) = _events(tmp_path, "world-grow")
        assert (grow["world_size"], grow["new_world_size"], grow["grown"]) == (3, 4, [3])
        assert grow["cost_s"] > 0
    finally:
        c.stop()


def test_ranks_that_do_not_halt_leave_the_world_as_it_is(tmp_path) -> None:
    kv = LocalKV()
    c = _controller(kv, tmp_path, phase_timeout=0.5)
    try:
        _shrink(kv)
        kv.set(P.status_key(2, 3), status(3, 2, back=True).to_json())
        _halt_after(kv, 5, ranks=(0, 1))  # rank 2 never halts
        deadline = time.monotonic() + 10.0
        while not _events(tmp_path, "grow-abandoned") and time.monotonic() < deadline:
            time.sleep(0.05)
        (gave_up,) = _events(tmp_path, "grow-abandoned")
        assert "ranks [2] did not halt" in gave_up["message"]
        seq = P.PauseRequest.from_json(kv.get(P.PAUSE_KEY, 1.0)).seq
        assert kv.try_get(P.resume_key(seq)).startswith(b"abandoned: world grow")
        assert kv.try_get(P.plan_key(2)) is None and c.driver.dropped == {3}
    finally:
        c.stop()


def test_a_fault_during_the_halt_is_decided_and_the_pause_ends(tmp_path) -> None:
    kv = LocalKV()
    c = _controller(kv, tmp_path)
    try:
        _shrink(kv)
        kv.set(P.status_key(2, 3), status(3, 2, back=True).to_json())
        assert kv.wait([P.PAUSE_KEY], 10.0)
        post_fault(kv, P.Fault(kind="signal", rank=1, node=0, generation=1, message="killed"))
        plan = P.Plan.from_json(kv.get(P.plan_key(2), 10.0))
        assert plan.strategy == P.ELASTIC and plan.failed_ranks == [1]  # the fault, not a grow
        seq = P.PauseRequest.from_json(kv.get(P.PAUSE_KEY, 1.0)).seq
        assert b"a fault came first" in kv.try_get(P.resume_key(seq))
    finally:
        c.stop()


def test_an_ftctl_pause_in_effect_holds_the_grow(tmp_path) -> None:
    kv = LocalKV()
    c = _controller(kv, tmp_path)
    try:
        _shrink(kv)
        kv.set(P.PAUSE_SEQ, b"1")
        kv.set(P.PAUSE_KEY, P.PauseRequest(seq=1, max_s=60.0).to_json())
        kv.set(P.status_key(2, 3), status(3, 2, back=True).to_json())
        time.sleep(1.2)
        assert kv.try_get(P.plan_key(2)) is None
        assert P.PauseRequest.from_json(kv.get(P.PAUSE_KEY, 1.0)).seq == 1  # no pause of its own
        assert "the grow waits for" in _events(tmp_path, "grow-waits")[0]["message"]
        _halt_after(kv, 7, newer_than=1)
        kv.set(P.resume_key(1), b"ftctl resume")
        plan = P.Plan.from_json(kv.get(P.plan_key(2), 10.0))
        assert plan.strategy == P.GROW
    finally:
        c.stop()


def test_a_grow_round_that_cannot_take_the_rank_back_keeps_the_shrunk_world(tmp_path) -> None:
    kv = LocalKV()
    c = _controller(kv, tmp_path)
    try:
        _shrink(kv)
        _halt_after(kv, 5)
        kv.set(P.status_key(2, 3), status(3, 2, back=True, shard="other").to_json())
        assert P.Plan.from_json(kv.get(P.plan_key(2), 10.0)).strategy == P.GROW
        for r in range(3):
            kv.set(P.status_key(2, r), status(r, 2).to_json())
        rp = P.RepairPlan.from_json(kv.get(P.repair_key(2), 10.0))
        assert rp.world == [0, 1, 2] and rp.pairs == [] and not rp.fallback
        assert rp.reason.startswith("no grow: ")
        assert c.driver.dropped == {3} and c.phase is RoundPhase.DONE
        assert not _events(tmp_path, "world-grow") and _events(tmp_path, "grow-abandoned")
    finally:
        c.stop()
