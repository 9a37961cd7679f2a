"""launcher.control.handoff with a live shrink behind it (issue 33): a controller elected after
the leader's loss knows the world is shrunk (the dropped ranks are in the saved state) and grows
it back; a grow in progress (its pause requested, its round published) is taken up, its pause
ended. A running controller on an in-process store (LocalKV), the ranks played by the test."""

from __future__ import annotations

import time

from launcher.control import controller_state as CS
from launcher.control.controller import Controller
from launcher.control.controller_settings import ControllerSettings
from launcher.observe.logs import AgentLog, read_event_file
from launcher.protocol import plan as P
from rendezvous.store.memory import LocalKV

CHAIN = (P.ELASTIC, P.RESTART_ALL, P.EXIT)


def status(rank: int, g: int, committed: int = 5, back: bool = False) -> P.RankStatus:
    return P.RankStatus(
        rank=rank,
        generation=g,
        replacement=back,
        committed_step=-1 if back else committed,
        step=-1 if back else committed,
        shard="dp",
        shrinkable=True,
    )


def controller(kv, start: bool = True) -> Controller:
    """Two nodes of two runtime-aware ranks; node 1 may be lost (--nnodes 1:2)."""
    for r in range(4):
        kv.set(P.aware_key(r), b"1")
    settings = ControllerSettings(4, 2, 3, CHAIN, phase_timeout=5.0, window=0.1, min_nodes=1)
    c = Controller(kv, AgentLog(0, None, quiet=True), settings)
    if start:
        c.start()
    return c


def plan_of(kv, g: int) -> P.Plan:
    return P.Plan.from_json(kv.get(P.plan_key(g), 10.0))


def report(kv, g: int, ranks, **kw) -> None:
    for r in ranks:
        kv.set(P.status_key(g, r), status(r, g, **kw).to_json())


def halted(kv, step: int, ranks, newer_than: int = 0) -> int:
    """The survivors halt after `step` at the first pause newer than `newer_than`: its seq."""
    deadline, seq = time.monotonic() + 10.0, 0
    while seq <= newer_than and time.monotonic() < deadline:
        raw = kv.try_get(P.PAUSE_KEY)
        seq = P.PauseRequest.from_json(raw).seq if raw else 0
        time.sleep(0.01)
    for r in ranks:
        kv.set(P.pause_halted_key(seq, r), str(step).encode())
    return seq


def shrunk(kv) -> Controller:
    """Node 1 lost: its ranks 2 and 3 left the world live (generation 1)."""
    c = controller(kv)
    c.note_node(1, lost=True, why="no heartbeat for 2s")
    assert plan_of(kv, 1).strategy == P.ELASTIC
    report(kv, 1, (0, 1))
    kv.get(P.repair_key(1), 10.0)
    return c


def test_the_dropped_ranks_are_saved_and_a_successor_grows_the_world_back() -> None:
    kv = LocalKV()
    c1 = shrunk(kv)
    c1.stop()  # the leader's node is lost; a controller is elected elsewhere
    saved = CS.load(kv)
    assert saved is not None and saved.dropped == [2, 3] and saved.grow_pause == 0
    c2 = controller(kv, start=False)
    assert c2.driver.dropped == {2, 3} and c2.situation().dropped == (2, 3)
    c2.start()
    try:
        report(kv, 2, (2, 3), back=True)  # the node's agent is back: returning processes
        halted(kv, 6, (0, 1))
        p2 = plan_of(kv, 2)
        assert (p2.strategy, p2.restart_ranks) == (P.GROW, [2, 3])
        report(kv, 2, (0, 1), committed=6)
        rp = P.RepairPlan.from_json(kv.get(P.repair_key(2), 10.0))
        assert rp.world == [0, 1, 2, 3] and not rp.fallback
        assert c2.driver.dropped == set()
        deadline = time.monotonic() + 5.0
        while CS.load(kv).dropped and time.monotonic() < deadline:
            time.sleep(0.02)
        assert CS.load(kv).dropped == []  # grown: saved for the next successor too
    finally:
        c2.stop()


def test_a_successor_takes_up_a_grow_in_progress_and_ends_its_pause() -> None:
    kv = LocalKV()
    c1 = shrunk(kv)
    try:
        report(kv, 2, (2, 3), back=True)
        seq = halted(kv, 6, (0, 1))
        assert plan_of(kv, 2).strategy == P.GROW
        assert CS.load(kv).grow_pause == seq  # the grow's pause, saved
    finally:
        c1.stop()  # lost between the grow's plan and its repair plan
    assert kv.try_get(P.repair_key(2)) is None and kv.try_get(P.resume_key(seq)) is None
    c2 = controller(kv, start=False)
    assert c2.round is not None and c2.round.strategy == P.GROW and c2.round.collecting
    c2.start()
    try:
        report(kv, 2, (0, 1), committed=6)
        rp = P.RepairPlan.from_json(kv.get(P.repair_key(2), 10.0))
        assert rp.world == [0, 1, 2, 3] and sorted(d for _, d in rp.pairs) == [2, 3]
        assert kv.get(P.resume_key(seq), 5.0) == b"world grow: generation 2"
        assert c2.driver.dropped == set()
    finally:
        c2.stop()


def test_a_successor_ends_the_pause_of_a_grow_whose_round_never_started() -> None:
    """The leader was lost while the survivors halted for its grow (no grow round yet): the
    successor ends that pause (the ranks go on) and grows the world itself."""
    kv = LocalKV()
    c1 = shrunk(kv)
    report(kv, 2, (2, 3), back=True)
    deadline = time.monotonic() + 10.0
    while kv.try_get(P.PAUSE_KEY) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    seq = P.PauseRequest.from_json(kv.get(P.PAUSE_KEY, 1.0)).seq
    c1.stop()  # before anyone halted: its halt is given up
    kv.delete(P.resume_key(seq))  # as if it died before it could end the pause
    saved = CS.load(kv)
    CS.save(kv, CS.SavedState(**{**saved.__dict__, "grow_pause": seq}))
    c2 = controller(kv)
    try:
        assert kv.get(P.resume_key(seq), 5.0) == b"the grow round ended"  # ended by c2
        halted(kv, 8, (0, 1), newer_than=seq)  # the successor's own grow
        p2 = plan_of(kv, 2)
        assert (p2.strategy, p2.restart_ranks) == (P.GROW, [2, 3])
    finally:
        c2.stop()


# ---- a hot switch across a controller handoff ------------------------------------------------
def switch_requested(kv, rank: int = 1) -> int:
    seq = kv.add(P.MIGRATE_SEQ, 1)
    kv.set(P.migrate_key(seq), P.MigrateRequest(seq=seq, ranks=[rank]).to_json())
    return seq


def saved_switch(kv, seq: int) -> CS.SavedState:
    """The saved state once it names switch `seq` with its pause (the controller saves it)."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        saved = CS.load(kv)
        if saved is not None and saved.switch_seq == seq and saved.switch_pause:
            return saved
        time.sleep(0.01)
    raise AssertionError(f"switch #{seq} and its pause not saved: {CS.load(kv)}")


def lost_mid_switch(kv, c1: Controller, saved: CS.SavedState, seq: int) -> None:
    """`c1` stops as if it died: what its own stop wrote about the switch is undone and the
    state it saved mid-switch is the last one."""
    c1.stop()
    for key in (
        P.resume_key(saved.switch_pause),
        P.switch_ended_key(seq),
        P.migrate_outcome_key(seq),
    ):
        kv.delete(key)
    CS.save(kv, CS.SavedState(**{**saved.__dict__, "term": CS.take_term(kv)}))


def test_a_successor_abandons_a_halted_switch_and_ends_its_pause(tmp_path) -> None:
    """The leader was lost while the ranks halted for a hot switch (no switch round yet): the
    successor ends the pause at once (the ranks go on where they were, not after the pause's
    300 s), tells the agents to stop the new processes and answers the request, one line."""
    kv = LocalKV()
    c1 = controller(kv)
    seq = switch_requested(kv)
    order = P.SwitchOrder.from_json(kv.get(P.SWITCH_KEY, 10.0))
    kv.set(P.status_key(order.generation, 1), status(1, order.generation, back=True).to_json())
    saved = saved_switch(kv, seq)  # the halt is requested (ranks 2, 3 never halt here)
    assert kv.try_get(P.plan_key(1)) is None
    lost_mid_switch(kv, c1, saved, seq)
    log = AgentLog(0, str(tmp_path / "events.jsonl"), quiet=True)
    settings = ControllerSettings(4, 2, 3, CHAIN, phase_timeout=5.0, window=0.1, min_nodes=1)
    c2 = Controller(kv, log, settings)
    try:
        ended = kv.get(P.resume_key(saved.switch_pause), 1.0)
        assert ended.startswith(b"abandoned: hot switch #1: the controller that started it")
        assert kv.try_get(P.switch_ended_key(seq)) is not None  # the agents stop theirs
        out = P.SwitchOutcome.from_json(kv.get(P.migrate_outcome_key(seq), 1.0))
        assert out.outcome == "abandoned" and out.ranks == [1]
        assert CS.load(kv).switch_seq == 0  # nothing left in progress
        c2.start()
        time.sleep(0.3)
        assert kv.try_get(P.plan_key(1)) is None  # not carried out a second time
    finally:
        c2.stop()
    lines = read_event_file(str(tmp_path / "events.jsonl"))
    said = [e["message"] for e in lines if e["event"] == "switch-abandoned"]
    assert len(said) == 1 and said[0].startswith("hot switch #1 abandoned: the controller")
    assert said[0].endswith("ranks [1] keep running where they were")


def test_a_successor_takes_up_a_switch_round_and_its_repair_plan_ends_the_pause() -> None:
    kv = LocalKV()
    c1 = controller(kv)
    seq = switch_requested(kv)
    g = P.SwitchOrder.from_json(kv.get(P.SWITCH_KEY, 10.0)).generation
    kv.set(P.status_key(g, 1), status(1, g, back=True).to_json())
    pause = halted(kv, 6, (0, 1, 2, 3))
    assert plan_of(kv, g).strategy == P.SWITCH
    saved = saved_switch(kv, seq)
    assert saved.switch_pause == pause
    lost_mid_switch(kv, c1, saved, seq)  # between the switch plan and its repair plan
    c2 = controller(kv, start=False)
    assert c2.round is not None and c2.round.strategy == P.SWITCH and c2.round.collecting
    assert kv.try_get(P.resume_key(pause)) is None  # held for the round
    c2.start()
    try:
        report(kv, g, (0, 2, 3), committed=6)
        rp = P.RepairPlan.from_json(kv.get(P.repair_key(g), 10.0))
        assert {d for _, d in rp.pairs} == {1} and rp.resume_step == 7  # to rank 1 only
        assert (
            kv.get(P.resume_key(pause), 5.0)
            == f"done: hot switch #{seq}: generation {g} (taken up)".encode()
        )
        out = P.SwitchOutcome.from_json(kv.get(P.migrate_outcome_key(seq), 1.0))
        assert out.outcome == "done"
    finally:
        c2.stop()
