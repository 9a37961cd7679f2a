"""Prometheus metrics of the agent (launcher/observe/metrics.py, fed by
launcher/observe/observer.py).

The port setting is read by launcher.config (test_config); here: a bad one ends ftrun with
exit 2 and one line, and one real 4-rank job with `--rdzv-conf metrics_port=PORT`,
scraped over HTTP while it trains, then again after `ftctl inject` killed a rank: the fault,
round, phase and budget metrics move."""

from __future__ import annotations

import time
import urllib.request

import pytest
from helpers_launch import FTRUN, free_port, run
from helpers_observe import ObservedJob, ftctl, job_env
from prometheus_client.parser import text_string_to_metric_families

from launcher.observe.logs import AgentLog
from launcher.observe.observer import NodeObserver


def test_bad_port_exits_2_with_one_line(tmp_path):
    res = run(
        FTRUN
        + [
            "--nproc_per_node",
            "1",
            "--log_dir",
            str(tmp_path),
            "--rdzv-conf",
            "metrics_port=-3",
            "-m",
            "json.tool",
            "--help",
        ],
        env=job_env(),
        timeout=60,
    )
    assert res.returncode == 2, res.stderr
    assert "metrics_port='-3': must be a port number" in res.stderr


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def total(m: dict, name: str) -> float:
    return sum(v for (n, _), v in m.items() if n == name)


def test_metrics_move_with_an_injected_fault(tmp_path):
    port = free_port()
    job = ObservedJob(
        tmp_path, steps=2000, step_time=0.03, launcher_args=["--rdzv-conf", f"metrics_port={port}"]
    )
    try:
        assert job.wait_for("metrics")[0]["port"] == port
        addr = job.store_addr()
        deadline = time.monotonic() + 120
        while True:  # training: every rank has a speed
            m = scrape(port)
            if all(value(m, "ftrun_steps_per_second", rank=str(r)) > 0 for r in range(4)):
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.5)
        assert value(m, "ftrun_workers_alive") == 4 and value(m, "ftrun_recovery_in_progress") == 0
        assert value(m, "ftrun_restarts_left") == 3 and value(m, "ftrun_generation") == 0
        assert total(m, "ftrun_faults_total") == 0 and total(m, "ftrun_recovery_rounds_total") == 0
        assert value(m, "ftrun_store_served_requests_total") > 0
        assert value(m, "ftrun_store_requests_total", op="set") > 0
        assert value(m, "ftrun_store_request_seconds_count", op="set") > 0
        served = value(m, "ftrun_store_served_requests_total")

        res = ftctl("inject", "--addr", addr, "--rank", "1", "--kind", "kill")
        assert res.returncode == 0, res.stderr
        deadline = time.monotonic() + 120
        while True:
            m = scrape(port)
            if (
                value(
                    m,
                    "ftrun_recovery_rounds_total",
                    strategy="recover-in-place",
                    outcome="recovered",
                )
                == 1
            ):
                break
            assert time.monotonic() < deadline, {k: v for k, v in m.items() if "recovery" in k[0]}
            time.sleep(0.5)
        assert value(m, "ftrun_faults_total", kind="signal", injected="true") == 1  # a drill
        assert total(m, "ftrun_faults_total") == 1
        assert value(m, "ftrun_recovery_in_progress") == 0
        assert value(m, "ftrun_recovery_lost_seconds_total") >= value(m, "ftrun_time_lost_seconds")
        assert value(m, "ftrun_state_transfer_bytes_total") > 0
        assert value(m, "ftrun_state_transfer_seconds_total") > 0
        assert [r for r in range(4) if value(m, "ftrun_rank_alive", rank=str(r)) == 1] == [
            0,
            1,
            2,
            3,
        ]
        (info,) = [k for k in m if k[0] == "ftrun_job_info"]
        assert dict(info[1])["world_size"] == "4" and dict(info[1])["run_id"]
        assert value(m, "ftrun_restarts_used") == 1 and value(m, "ftrun_restarts_left") == 2
        assert value(m, "ftrun_generation") == 1 and value(m, "ftrun_workers_alive") == 4
        for phase in ("detect", "decide", "stop", "respawn", "rebuild", "transfer", "resume"):
            assert value(m, "ftrun_recovery_phase_seconds_count", phase=phase) >= 1, phase
        assert value(m, "ftrun_recovery_seconds_count") == 1
        # one round: the job's time lost is that round's (the histogram's only observation)
        assert value(m, "ftrun_time_lost_seconds") == value(m, "ftrun_recovery_seconds_sum") > 0
        assert value(m, "ftrun_store_served_requests_total") > served
    finally:
        job.stop()


def metered(tmp_path):
    log = AgentLog(0, str(tmp_path / "events.jsonl"), quiet=True)
    obs = NodeObserver(log, str(tmp_path), max_restarts=3, port=0, progress_interval=1.0)
    log.add_sink(obs.on_event)
    return log, obs, obs.metrics


def sample(m, name: str, **labels: str):
    return m.registry.get_sample_value(name, labels)


def test_faults_are_labelled_injected_and_transfers_counted(tmp_path):
    log, obs, m = metered(tmp_path)
    log.warning("inject", "[injected] kill into rank 1", rank=1, fault_kind="kill", injected=True)
    log.error("worker-failed", "rank 1 signal", rank=1, fault_kind="signal")
    log.error("worker-failed", "rank 2 signal", rank=2, fault_kind="signal")
    log.error("worker-fault", "rank 3 uce", rank=3, fault_kind="uce-high", injected=True)
    assert sample(m, "ftrun_faults_total", kind="signal", injected="true") == 1
    assert sample(m, "ftrun_faults_total", kind="signal", injected="false") == 1
    assert sample(m, "ftrun_faults_total", kind="uce-high", injected="true") == 1
    log.info("rank-recovered", "r", rank=1, generation=1, transfer_bytes=5000, transfer_s=0.25)
    log.info("rank-recovered", "r", rank=0, generation=1, transfer_bytes=0, transfer_s=0.2)
    assert sample(m, "ftrun_state_transfer_bytes_total") == 5000
    assert sample(m, "ftrun_state_transfer_seconds_total") == 0.25


def test_a_dead_ranks_step_is_dropped_and_store_errors_counted(tmp_path):
    log, obs, m = metered(tmp_path)
    rows = [
        {"rank": 0, "state": "training", "committed_step": 7, "steps_per_s": 2.0},
        {"rank": 1, "state": "training", "committed_step": 7, "steps_per_s": 2.0},
    ]
    snap = {"time": time.time(), "generation": 0, "ranks": rows, "spare": True}
    obs._refresh_metrics(snap)
    assert sample(m, "ftrun_step", rank="1") == 7 and sample(m, "ftrun_rank_alive", rank="1") == 1
    assert sample(m, "ftrun_warm_spares_ready") == 1
    rows[1] = {"rank": 1, "state": "failed", "committed_step": 7, "steps_per_s": None}
    obs._refresh_metrics({**snap, "spare": False})
    assert sample(m, "ftrun_step", rank="1") is None  # no stale step for a dead rank
    assert sample(m, "ftrun_steps_per_second", rank="1") is None
    assert sample(m, "ftrun_rank_alive", rank="1") == 0 and sample(m, "ftrun_step", rank="0") == 7
    assert sample(m, "ftrun_warm_spares_ready") == 0 and sample(m, "ftrun_workers_alive") == 1

    def refused():
        raise ConnectionRefusedError("store gone")

    with pytest.raises(ConnectionRefusedError):
        obs._timed("get", refused)
    assert sample(m, "ftrun_store_request_errors_total", op="get") == 1


def test_a_running_round_is_in_progress_and_its_lost_seconds_only_grow(tmp_path):
    log, obs, m = metered(tmp_path)
    t = 1000.0
    for e in (
        {"event": "rendezvous", "time": t, "node": 0, "group_rank": 0, "world_size": 2},
        *[{"event": "spawn", "time": t, "node": 0, "rank": r, "pid": 10 + r} for r in (0, 1)],
        {
            "event": "worker-failed",
            "time": t + 10,
            "node": 0,
            "rank": 1,
            "pid": 11,
            "fault_kind": "signal",
            "detect_ms": 0.0,
        },
        {"event": "decide", "time": t + 10.1, "rank": 1, "strategy": "recover-in-place"},
        {
            "event": "plan",
            "time": t + 10.2,
            "generation": 1,
            "strategy": "recover-in-place",
            "failed_ranks": [1],
            "restart_ranks": [1],
        },
    ):
        obs.timeline.feed(e)
    m.note_view(obs.timeline.view(t + 14.0))
    assert sample(m, "ftrun_recovery_in_progress") == 1
    assert sample(m, "ftrun_recovery_lost_seconds_total") == 4.0
    for r in (0, 1):
        obs.timeline.feed(
            {"event": "rank-resumed", "time": t + 13.0, "rank": r, "generation": 1, "step": 5}
        )
    m.note_view(obs.timeline.view(t + 15.0))
    assert sample(m, "ftrun_recovery_in_progress") == 0
    assert sample(m, "ftrun_time_lost_seconds") == 3.0  # settled: the round ended at +13
    assert sample(m, "ftrun_recovery_lost_seconds_total") == 4.0  # a counter never goes back
    assert sample(m, "ftrun_job_info", version=sample_version(m), run_id="", world_size="2") == 1


def sample_version(m) -> str:
    (fam,) = [f for f in m.registry.collect() if f.name == "ftrun_job"]
    return fam.samples[0].labels["version"]


def test_the_world_size_and_each_shrink_and_grow_once(tmp_path):
    from helpers_observe import event_at

    log, obs, m = metered(tmp_path)
    t = 1000.0
    assert sample(m, "ftrun_world_changes_total", kind="shrink") == 0  # series from the start
    for e in [
        event_at(t, "rendezvous", group_rank=0, world_size=4),
        *[event_at(t, "spawn", rank=r, pid=10 + r) for r in range(4)],
    ]:
        obs.timeline.feed(e)
    m.note_view(obs.timeline.view(t + 1))
    assert sample(m, "ftrun_world_size") == 4 and sample(m, "ftrun_original_world_size") == 4
    for e in [
        event_at(t + 2, "worker-failed", rank=3, pid=13, fault_kind="signal"),
        event_at(t + 2.1, "decide", rank=3, strategy="elastic-training"),
        event_at(t + 2.2, "plan", 1, strategy="elastic-training", failed_ranks=[3]),
        event_at(t + 2.3, "world-shrink", 1, world=[0, 1, 2], world_size=4, new_world_size=3),
    ]:
        obs.timeline.feed(e)
    for now in (t + 3, t + 4):  # every publication: counted once
        m.note_view(obs.timeline.view(now))
    assert sample(m, "ftrun_world_size") == 3 and sample(m, "ftrun_original_world_size") == 4
    assert sample(m, "ftrun_world_changes_total", kind="shrink") == 1
    assert sample(m, "ftrun_world_changes_total", kind="grow") == 0
    assert sample(m, "ftrun_job_info", version=sample_version(m), run_id="", world_size="4") == 1
    obs.timeline.feed(
        event_at(t + 9, "world-grow", 2, world=[0, 1, 2, 3], world_size=3, new_world_size=4)
    )
    m.note_view(obs.timeline.view(t + 10))
    assert sample(m, "ftrun_world_size") == 4
    assert sample(m, "ftrun_world_changes_total", kind="grow") == 1
    assert sample(m, "ftrun_world_changes_total", kind="shrink") == 1
