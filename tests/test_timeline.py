"""launcher/observe/timeline.py (with run_view and round_phases): rounds, phases, faults and costs
rebuilt from events (synthetic events shaped like the agent's; the real ones are covered by
test_report and test_status)."""

from __future__ import annotations

from launcher.observe.timeline import Timeline

T = 1000.0


def ev(t: float, name: str, node: int = 0, generation: int = 0, **fields) -> dict:
    return {
        "time": T + t,
        "event": name,
        "node": node,
        "generation": generation,
        "host": "h",
        "message": fields.pop("message", name),
        **fields,
    }


def started(world: int = 2) -> list[dict]:
    out = [
        ev(
            0,
            "start",
            config={"rdzv_id": "job", "max_restarts": 3, "max_nodes": 1, "script": "t.py"},
        ),
        ev(0.1, "rendezvous", group_rank=0, world_size=world),
    ]
    out += [
        ev(0.2, "spawn", rank=r, local_rank=r, pid=100 + r, replacement=False) for r in range(world)
    ]
    out += [ev(0.3, "hello", rank=r, pid=100 + r) for r in range(world)]
    out += [
        ev(
            2.0,
            "progress",
            ranks={
                str(r): {"step": 5, "committed_step": 4, "phase": "forward", "steps_per_s": 2.0}
                for r in range(world)
            },
        )
    ]
    return out


def marks(t0: float) -> dict:
    return {"status": T + t0, "plan": T + t0 + 1, "rebuilt": T + t0 + 1.5, "repaired": T + t0 + 2}


def kill_round() -> list[dict]:
    return [
        ev(
            3.0,
            "worker-failed",
            rank=1,
            pid=101,
            fault_kind="signal",
            detect_ms=100.0,
            message="rank 1 (pid 101) signal: SIGKILL",
        ),
        ev(3.1, "decide", rank=1, fault_kind="signal", strategy="recover-in-place", reason="why"),
        ev(
            3.2,
            "plan",
            generation=1,
            strategy="recover-in-place",
            failed_ranks=[1],
            restart_ranks=[1],
        ),
        ev(3.3, "plan-received", generation=1, strategy="recover-in-place"),
        ev(3.4, "spawn", generation=1, rank=1, local_rank=1, pid=201, replacement=True, warm=True),
        ev(4.0, "repair-plan", generation=1, resume_step=5, action="rollback", pairs=[[0, 1]]),
        ev(5.5, "rank-recovered", generation=1, rank=0, resume_step=5, marks=marks(3.5)),
        ev(
            5.6,
            "rank-recovered",
            generation=1,
            rank=1,
            resume_step=5,
            marks=marks(3.6),
            transfer_bytes=4_000_000,
            transfer_s=0.5,
            source=0,
        ),
    ]


def test_process_level_round_phases_and_cost():
    events = (
        started()
        + kill_round()
        + [
            ev(6.0, "rank-resumed", generation=1, rank=0, step=5),
            ev(6.2, "rank-resumed", generation=1, rank=1, step=5),
        ]
    )
    v = Timeline().feed_all(events).view()
    (ro,) = v.rounds
    assert ro.outcome == "recovered" and ro.end == T + 6.2 and ro.mttr_s == 3.3  # from the exit
    assert ro.steps_lost == 0 and ro.transfer_bytes == 4_000_000
    got = {(b.rank, b.phase): (round(b.start - T, 3), round(b.end - T, 3)) for b in ro.bars}
    assert got[(1, "detect")] == (2.9, 3.0) and got[(1, "decide")] == (3.0, 3.2)
    assert got[(1, "respawn")] == (3.3, 3.6) and got[(0, "stop")] == (3.3, 3.5)
    assert got[(0, "wait")] == (3.5, 4.5) and got[(0, "rebuild")] == (4.5, 5.0)
    assert got[(1, "transfer")] == (5.1, 5.6) and got[(1, "resume")] == (5.6, 6.2)
    (f,) = v.faults
    assert f.kind == "signal" and f.strategy == "recover-in-place" and f.round == 1
    assert f.transfer_rate == 8_000_000 and f.mttr_s == 3.3
    assert v.restarts_used == 1 and [r.restarts for r in v.ranks] == [0, 1]


def test_striped_transfer_names_every_source():
    events = started() + [
        e if e["event"] != "repair-plan" else {**e, "pairs": [[0, 1], [2, 1]]} for e in kill_round()
    ]
    (ro,) = Timeline().feed_all(events).view().rounds
    notes = {(b.rank, b.phase): b.note for b in ro.bars}
    assert notes[(1, "transfer")] == "received 4.0 MB from ranks 0, 2 (striped) in 0.500 s"
    assert notes[(0, "transfer")] == "sent state to rank 1"


def test_round_in_progress_has_a_phase_and_open_bars():
    events = started() + kill_round()[:5]
    v = Timeline().feed_all(events).view(now=T + 3.5)
    cur = v.current_round
    assert cur is not None and cur.phase in ("respawn", "stop") and cur.end is None
    assert all(b.open for b in cur.bars if b.phase in ("stop", "respawn"))
    assert {r.rank: r.state for r in v.ranks} == {0: "recovering", 1: "replacement"}


def test_restart_all_counts_the_steps_lost_since_the_checkpoint():
    events = started() + [
        ev(3.0, "worker-failed", rank=0, pid=100, fault_kind="exit", detect_ms=1.0),
        ev(3.1, "decide", rank=0, fault_kind="exit", strategy="restart-all", reason="r"),
        ev(
            3.2,
            "plan",
            generation=1,
            strategy="restart-all",
            failed_ranks=[0],
            restart_ranks=[0, 1],
        ),
        ev(3.3, "plan-received", generation=1, strategy="restart-all"),
        ev(4.0, "restart-all-go", generation=1),
        *[
            ev(4.1, "spawn", generation=1, rank=r, local_rank=r, pid=300 + r, replacement=False)
            for r in (0, 1)
        ],
        ev(4.2, "restarted", generation=1),
        *[ev(6.0, "hello", generation=1, rank=r, pid=300 + r) for r in (0, 1)],
        *[ev(8.0, "rank-resumed", generation=1, rank=r, step=2) for r in (0, 1)],
    ]
    v = Timeline().feed_all(events).view()
    (ro,) = v.rounds
    assert ro.outcome == "restarted" and ro.steps_lost == 3  # steps 2, 3, 4 done again
    assert {b.phase for b in ro.bars if b.rank == 1} == {"stop", "respawn", "resume"}


def test_fallback_round_carries_the_same_fault():
    events = (
        started()
        + kill_round()[:5]
        + [
            ev(4.0, "fallback", strategy="restart-all", reason="no healthy replica"),
            ev(
                4.1,
                "plan",
                generation=2,
                strategy="restart-all",
                failed_ranks=[1],
                restart_ranks=[0, 1],
            ),
            ev(4.2, "job-done"),
        ]
    )
    v = Timeline().feed_all(events).view()
    assert [r.outcome for r in v.rounds][0] == "fallback"
    assert (
        v.rounds[1].fault is v.rounds[0].fault
        and v.rounds[1].reason == "fallback: no healthy replica"
    )
    (f,) = v.faults
    assert f.strategy == "recover-in-place -> restart-all" and f.round == 1
    assert v.restarts_used == 1  # the fallback is not counted twice


def test_a_fault_during_a_round_supersedes_it():
    events = (
        started(3)
        + kill_round()[:5]
        + [
            ev(
                3.6,
                "worker-failed",
                generation=1,
                rank=2,
                pid=102,
                fault_kind="signal",
                detect_ms=1.0,
            ),
            ev(3.7, "round-superseded", generation=1, message="rank 2 failed during recovery"),
            ev(
                3.8,
                "plan",
                generation=2,
                strategy="recover-in-place",
                failed_ranks=[1, 2],
                restart_ranks=[2],
            ),
        ]
    )
    v = Timeline().feed_all(events).view()
    assert [r.outcome for r in v.rounds] == ["superseded", "in-progress"]
    assert [f.rank for f in v.faults] == [1, 2] and v.faults[1].round == 2


def test_torn_last_line_is_skipped(tmp_path):
    from launcher.observe.logs import read_event_file

    p = tmp_path / "events.jsonl"
    p.write_text('{"time": 1, "event": "start"}\n{"time": 2, "ev')
    assert read_event_file(str(p)) == [{"time": 1, "event": "start"}]


def test_a_world_that_shrinks_shows_the_lost_node_its_round_and_the_smaller_world():
    """A lost node nobody took over: `world-shrink` (no `decide`) is the fault of the restart-all
    round that follows; after `round-joined` rows of the old numbering beyond the new world go."""
    events = started(world=3) + [
        ev(0.1, "rendezvous", node=2, group_rank=2, world_size=3),
        ev(3.0, "node-lost", lost_node=1),
        ev(
            5.0,
            "world-shrink",
            lost_node=1,
            reason="no heartbeat for 2s",
            strategy="restart-all",
            world_size=3,
            new_world_size=2,
            message="node 1 lost ...; continuing on 2 node(s)",
        ),
        ev(
            5.1,
            "plan",
            generation=1,
            strategy="restart-all",
            failed_ranks=[1],
            restart_ranks=[0, 1],
            new_round=1,
        ),
        ev(5.2, "plan-received", generation=1, strategy="restart-all"),
        ev(6.0, "round-joined", node=2, generation=1, group_rank=1, world_size=2, nnodes=2),
        ev(6.1, "rendezvous", node=1, generation=1, group_rank=1, world_size=2),
        ev(6.2, "spawn", node=1, generation=1, rank=1, local_rank=0, pid=301, replacement=False),
    ]
    v = Timeline().feed_all(events).view()
    (f,) = v.faults
    assert (f.kind, f.node, f.strategy, f.round) == ("node-lost", 1, "restart-all", 1)
    assert f.evidence == "no heartbeat for 2s"
    (ro,) = v.rounds
    assert ro.strategy == "restart-all" and ro.fault is f and v.restarts_used == 1
    # the controller says whether a plan was charged (a scale-up, a round continued): not here
    events = [{**e, "charged": False} if e["event"] == "plan" else e for e in events]
    assert Timeline().feed_all(events).view().restarts_used == 0
    assert v.world_size == 2 and [n.node for n in v.nodes] == [0, 1]
    assert [r.rank for r in v.ranks] == [0, 1] and v.nodes[1].state == "running"


def test_a_live_shrink_is_its_rank_faults_round_not_a_lost_node():
    """elastic-training's `world-shrink` (ranks dropped, no node lost) adds no fault of its own:
    the rank's fault is the round's, the world is smaller from then on (it was a node-lost row)."""
    events = started(world=4) + [
        ev(3.0, "worker-failed", rank=3, exitcode=-9, message="rank 3 signal: SIGKILL"),
        ev(3.01, "decide", generation=0, rank=3, strategy="elastic-training", fault_kind="signal"),
        ev(3.02, "plan", generation=1, strategy="elastic-training", failed_ranks=[3]),
        ev(
            3.2,
            "world-shrink",
            generation=1,
            strategy="elastic-training",
            dropped=[2, 3],
            world=[0, 1],
            world_size=4,
            new_world_size=2,
        ),
    ]
    v = Timeline().feed_all(events).view()
    assert [(f.rank, f.kind != "node-lost") for f in v.faults] == [(3, True)], v.faults
    assert v.world_size == 2


def test_a_live_grow_back_restores_the_world_size_and_the_shrink_round_recovered():
    """elastic-training's grow back: `world-grow` (naming `grown`) makes the world its original
    size again; the shrink's round, which its dropped rank never resumes in, is recovered (not
    cut short by a later fault) when the grow's plan comes."""
    events = started(world=4) + [
        ev(3.0, "worker-failed", rank=3, exitcode=-9, message="rank 3 signal: SIGKILL"),
        ev(3.01, "decide", generation=0, rank=3, strategy="elastic-training", fault_kind="signal"),
        ev(3.02, "plan", generation=1, strategy="elastic-training", failed_ranks=[3]),
        ev(3.2, "world-shrink", generation=1, dropped=[3], world_size=4, new_world_size=3),
        ev(6.0, "plan", generation=2, strategy="elastic-grow", restart_ranks=[3], charged=False),
        ev(6.2, "world-grow", generation=2, grown=[3], world_size=3, new_world_size=4),
    ]
    v = Timeline().feed_all(events).view()
    assert v.world_size == 4 and v.restarts_used == 1 and v.world_now()["size"] == 4
    shrink = next(r for r in v.rounds if r.generation == 1)
    assert shrink.outcome == "recovered"


def test_a_live_shrink_round_ends_when_the_survivors_train_again():
    """The dropped rank never resumes in its shrink's round: the survivors' resumption ends it
    (its time lost is theirs, not until a later round or the job's end)."""
    events = (
        started(world=4)
        + [
            ev(3.0, "worker-failed", rank=3, exitcode=-9, message="rank 3 signal: SIGKILL"),
            ev(
                3.01,
                "decide",
                generation=0,
                rank=3,
                strategy="elastic-training",
                fault_kind="signal",
            ),
            ev(3.02, "plan", generation=1, strategy="elastic-training", failed_ranks=[3]),
            ev(3.2, "world-shrink", generation=1, dropped=[3], world_size=4, new_world_size=3),
        ]
        + [ev(3.5 + r / 100, "rank-resumed", generation=1, rank=r, step=4) for r in range(3)]
    )
    v = Timeline().feed_all(events + [ev(9.0, "progress")]).view()
    (shrink,) = v.rounds
    assert shrink.outcome == "recovered" and v.world_now()["size"] == 3
    assert shrink.end == events[-1]["time"]  # rank 2's resumption, the last survivor's


def test_a_failed_rank_names_its_stderr_file_in_the_fault_table():
    from launcher.observe.report import fault_table

    v = (
        Timeline()
        .feed_all(
            started()
            + [
                ev(
                    3.0,
                    "worker-failed",
                    rank=1,
                    pid=101,
                    fault_kind="signal",
                    detect_ms=1.0,
                    message="rank 1 (pid 101) signal: Signal 6 (SIGABRT)",
                    stderr_file="/logs/attempt_0/1/stderr.log",
                ),
                ev(
                    3.1, "decide", rank=1, fault_kind="signal", strategy="restart-all", reason="why"
                ),
            ]
        )
        .view()
    )
    assert v.faults[0].stderr_file == "/logs/attempt_0/1/stderr.log"
    assert "(its stderr: /logs/attempt_0/1/stderr.log)" in fault_table(v)


def test_a_rank_that_died_in_its_teardown_after_its_goodbye_is_finished_not_stopped():
    v = (
        Timeline()
        .feed_all(
            started()
            + [
                ev(3.0, "exit", rank=0, pid=100, exitcode=0),
                ev(3.2, "exit", rank=1, pid=101, exitcode=-6, after_goodbye=True),
            ]
        )
        .view()
    )
    assert [(r.rank, r.state, r.phase) for r in v.ranks] == [
        (0, "finished", "done"),
        (1, "finished", "done"),
    ]
    assert v.faults == []


def test_a_rank_killed_for_hanging_at_exit_after_its_goodbye_is_finished_not_stopped():
    v = (
        Timeline()
        .feed_all(
            started()
            + [
                ev(3.0, "exit", rank=0, pid=100, exitcode=0),
                ev(9.0, "exit-hang", rank=1, pid=101, idle_s=5.0, timeout_s=5.0),
                ev(9.5, "exit", rank=1, pid=101, exitcode=-9, hung_at_exit=True),
            ]
        )
        .view()
    )
    assert [(r.rank, r.state, r.phase) for r in v.ranks] == [
        (0, "finished", "done"),
        (1, "finished", "done"),
    ]
    assert v.faults == []  # not a fault of the training


# ---------------------------------------------------------------------- time lost, one rule
def recoveries() -> list[dict]:
    """Three ranks; four rounds: rank 1 killed (round 1), rank 2 killed during it (round 2
    supersedes round 1), rank 0 hangs from just before round 2 ended (round 3 overlaps round 2)
    and its recover-in-place falls back to a restart-all (round 4)."""
    resumed = [(0, 8.8), (1, 8.9), (2, 9.0)]
    return (
        started(3)
        + kill_round()[:5]
        + [
            ev(5.0, "worker-failed", generation=1, rank=2, pid=102, fault_kind="signal"),
            ev(5.1, "round-superseded", generation=1, message="rank 2 failed during recovery"),
            ev(
                5.2,
                "plan",
                generation=2,
                strategy="recover-in-place",
                failed_ranks=[1, 2],
                restart_ranks=[1, 2],
            ),
            *[ev(t, "rank-resumed", generation=2, rank=r, step=5) for r, t in resumed],
            ev(12.0, "hang", rank=0, idle_s=3.2),  # last progress at 8.8
            ev(12.1, "worker-failed", rank=0, pid=100, fault_kind="hang", generation=2),
            ev(12.2, "decide", rank=0, fault_kind="hang", strategy="recover-in-place", reason="r"),
            ev(12.3, "plan", generation=3, strategy="recover-in-place", failed_ranks=[0]),
            ev(13.0, "fallback", strategy="restart-all", reason="no healthy replica"),
            ev(13.1, "plan", generation=4, strategy="restart-all", restart_ranks=[0, 1, 2]),
            ev(13.5, "restart-all-go", generation=4),
            *[ev(17.0, "rank-resumed", generation=4, rank=r, step=3) for r in range(3)],
            ev(20.0, "job-done"),
        ]
    )


# the rule by hand: round 1 from rank 1's exit (2.9) until round 2 ended (9.0); round 2 from
# rank 2's exit (5.0) to 9.0; round 3 from rank 0's last progress (8.8) until its fallback's
# round ended (17.0); round 4 from its plan (13.1) to 17.0. The job: their union, 2.9 -> 17.0.
ROUNDS_LOST = [6.1, 4.0, 8.2, 3.9]
JOB_LOST = 14.1


def observed(tmp_path, events: list[dict]):
    """An agent's observer (the leader's: the controller's events are in its log) fed `events`,
    with a metrics registry that is not served."""
    from launcher.observe.logs import AgentLog
    from launcher.observe.observer import NodeObserver

    tmp_path.mkdir(exist_ok=True)
    log = AgentLog(0, str(tmp_path / "events.jsonl"), quiet=True)
    obs = NodeObserver(log, str(tmp_path), max_restarts=3, port=0, progress_interval=1.0)
    obs._node, obs._leader = 0, True  # its place, as `attach` sets it (without publishing)
    for e in sorted(events, key=lambda e: e["time"]):
        obs.on_event(e)
    return log, obs


def published(obs, at: float, now: float):
    """`ftctl status`'s live view at `now` of the node status `obs` published at `at`."""
    import json

    from launcher.observe import status as S
    from launcher.protocol import plan as P
    from rendezvous.store.memory import LocalKV

    kv = LocalKV()
    kv.set(P.node_status_key(0), json.dumps(obs.snapshot(at), default=str).encode())
    return S.from_store(kv, now=now)


def sample(obs, name: str) -> float | None:
    return obs.metrics.registry.get_sample_value(name)


def test_time_lost_is_one_rule_for_every_consumer(tmp_path):
    import json
    import re

    from click.testing import CliRunner

    from launcher.observe import report
    from launcher.observe import status as S
    from launcher.observe.logs import read_event_file

    events = recoveries()
    v = Timeline().feed_all(events).view()
    assert [r.outcome for r in v.rounds] == ["superseded", "recovered", "fallback", "restarted"]
    assert [r.time_lost_s for r in v.rounds] == ROUNDS_LOST
    assert [(round(s.start - T, 4), round(s.end - T, 4)) for s in v.lost_spans] == [(2.9, 17.0)]
    assert v.time_lost_s == JOB_LOST  # neither the sum (22.2) nor without round 1 (12.2)
    # the fault table's MTTR: the time lost of the round each fault started
    assert [(f.rank, f.mttr_s) for f in v.faults] == [(1, 6.1), (2, 4.0), (0, 8.2)]

    # the report: its card, the fault table, the shaded time on the progress chart
    page = report.render(v, [])
    assert "time lost<b>14.10 s</b>" in page
    mttr = [re.findall(r"<td>([^<]*)</td>", row)[6] for row in page.split("<tr class=fault>")[1:]]
    assert mttr == ["6.10 s", "4.00 s", "8.20 s"]
    chart = report.progress_chart(v)
    shaded = [  # (x, width) of each round's rect, as the chart draws them
        (float(a), float(b))
        for a, b in re.findall(r'<rect class="lost" x="([\d.]+)" y="10" width="([\d.]+)"', chart)
    ]
    union, reached = 0.0, float("-inf")
    for a, b in sorted((a, a + w) for a, w in shaded):
        union, reached = union + max(0.0, b - max(a, reached)), max(reached, b)
    per_s = shaded[0][1] / ROUNDS_LOST[0]
    assert len(shaded) == 4 and abs(union / per_s - JOB_LOST) < 0.05  # shaded: the card's time
    tips = re.findall(r'<rect class="lost"[^>]*data-tip="([^"]*)"', chart)
    assert [re.search(r": ([\d.]+) s lost", t).group(1) for t in tips] == [
        "6.10",
        "4.00",
        "8.20",
        "3.90",
    ]
    assert "time lost (until every rank trained again): 6.10 s" in report.rounds_section(v)

    # ftctl status from the run directory: the screen and --json
    (tmp_path / "run").mkdir()
    with open(tmp_path / "run" / "events.jsonl", "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    screen = CliRunner().invoke(S.status, [str(tmp_path / "run")])
    assert screen.exit_code == 0 and "time lost to recovery: 14.10s" in screen.output
    d = json.loads(CliRunner().invoke(S.status, ["--json", str(tmp_path / "run")]).output)
    assert d["time_lost_s"] == JOB_LOST and [r["time_lost_s"] for r in d["rounds"]] == ROUNDS_LOST
    assert [f["mttr_s"] for f in d["faults"]] == [6.1, 4.0, 8.2]

    # the agent: ftctl status from its store, its metrics, its last line
    log, obs = observed(tmp_path / "agent", events)
    try:
        live = published(obs, at=T + 20.0, now=T + 25.0)
        assert live.time_lost_s == JOB_LOST and [r.time_lost_s for r in live.rounds] == ROUNDS_LOST
        assert [f.mttr_s for f in live.faults] == [6.1, 4.0, 8.2]
        obs._refresh_metrics(obs.snapshot(T + 20.0))
        assert sample(obs, "ftrun_time_lost_seconds") == JOB_LOST
        assert sample(obs, "ftrun_recovery_seconds_count") == 4
        assert round(sample(obs, "ftrun_recovery_seconds_sum"), 4) == round(sum(ROUNDS_LOST), 4)
        obs._refresh_metrics(obs.snapshot(T + 21.0))  # each round once
        assert sample(obs, "ftrun_recovery_seconds_count") == 4
    finally:
        obs.stop()
        log.close()
    (line,) = [e for e in read_event_file(str(tmp_path / "agent" / "events.jsonl"))]
    assert line["event"] == "report" and line["time_lost_s"] == JOB_LOST
    assert "4 recovery round(s), 14.10 s lost to recovery" in line["message"]


def test_time_lost_grows_while_a_round_runs(tmp_path):
    events = started() + kill_round()[:5]  # rank 1 exited at 2.9; its round runs
    v = Timeline().feed_all(events).view(now=T + 10.0)
    assert v.time_lost_s == 7.1 and v.current_round.time_lost_s == 7.1
    assert v.faults[0].mttr_s is None  # not recovered yet
    assert Timeline().feed_all(events).view(now=T + 17.6).time_lost_s == 14.7
    log, obs = observed(tmp_path, events)
    try:
        live = published(obs, at=T + 10.0, now=T + 17.6)  # read later: counted to its now
        assert live.time_lost_s == 14.7 and live.current_round is not None
        assert "time lost to recovery: 14.70s" in _screen(live)
        obs._refresh_metrics(obs.snapshot(T + 10.0))
        assert sample(obs, "ftrun_time_lost_seconds") == 7.1
        obs._refresh_metrics(obs.snapshot(T + 12.0))
        assert sample(obs, "ftrun_time_lost_seconds") == 9.1
        assert sample(obs, "ftrun_recovery_seconds_count") == 0  # known once it ended
    finally:
        obs.stop()
        log.close()


def _screen(view) -> str:
    """`ftctl status`'s screen of `view`, as text."""
    import io

    from rich.console import Console

    from launcher.observe.status import render

    console = Console(width=200, record=True, file=io.StringIO())
    console.print(render(view, "test"))
    return console.export_text()


def test_spares_ready_count_and_first_ready_time_and_an_overtaking_is_no_extra_restart():
    """Issue 32: `spare-ready` sets the node's ready spares (and the first one's time after the
    start); a warm spawn takes one; a spare overtaking a cold replacement is the same restart."""
    from launcher.observe.status import _spares

    tl = Timeline()
    for e in started():
        tl.feed(e)
    tl.feed(ev(3.0, "spare-ready", ready=2, count=2, since_job_s=2.8, since_pool_s=2.7))
    node = tl.view().nodes[0]
    assert (node.spares_ready, node.spare_ready_s, node.spare) == (2, 2.8, True)
    assert _spares(node) == "2 ready (first 2.8 s after start)"
    tl.feed(ev(4.0, "spawn", generation=1, rank=1, local_rank=1, pid=200, replacement=True))
    tl.feed(
        ev(
            4.5,
            "spawn",
            generation=1,
            rank=1,
            local_rank=1,
            pid=201,
            replacement=True,
            warm=True,
            overtook=200,
        )
    )
    view = tl.view()
    assert view.nodes[0].spares_ready == 1
    rank1 = next(r for r in view.ranks if r.rank == 1)
    assert rank1.restarts == 1 and rank1.pid == 201
    tl.feed(ev(5.0, "spare-ready", ready=2, count=2, since_job_s=4.8, since_pool_s=4.7))
    assert tl.view().nodes[0].spare_ready_s == 2.8  # the first time stays
