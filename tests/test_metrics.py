"""Prometheus metrics of the agent (launcher/observe/metrics.py, fed by
launcher/observe/observer.py).

The port setting is read by launcher.config (test_config); here: a bad one ends ftrun with
exit 2 and one line, and one real 4-rank job with `--rdzv-conf metrics_port=PORT`,
scraped over HTTP while it trains, then again after `ftctl inject` killed a rank: the fault,
round, phase and budget metrics move."""

from __future__ import annotations

import time
import urllib.request

from helpers_launch import FTRUN, free_port, run
from helpers_observe import ObservedJob, ftctl, job_env
from prometheus_client.parser import text_string_to_metric_families


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
        assert value(m, "ftrun_workers_alive") == 4
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
        assert value(m, "ftrun_faults_total", kind="signal") == 1
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
