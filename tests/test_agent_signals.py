"""SIGTERM/SIGINT/SIGHUP in every phase of an agent's life: the agent ends within
--shutdown-timeout + 1 s with torchrun's exit code (1: torchrun's SignalException is uncaught),
stops its workers and proxy, and leaves the membership at once so the other nodes see a leave,
not a death after the liveness timeout."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import time

from tests.helpers_launch import FTRUN, env_with, free_port, pid_alive, script

GRACE = 1  # --shutdown_timeout of the signalled agent
BOUND = GRACE + 1.0


def _events(log_dir: str) -> list[dict]:
    out = []
    for path in glob.glob(os.path.join(log_dir, "*", "events.jsonl")):
        with open(path, encoding="utf-8") as f:
            out += [json.loads(line) for line in f if line.strip()]
    return out


def _wait_event(log_dir: str, pred, timeout: float = 60.0) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for e in _events(log_dir):
            if pred(e):
                return e
        time.sleep(0.05)
    raise AssertionError(f"no such event in {log_dir}: {[e['event'] for e in _events(log_dir)]}")


def _agent(
    tmp, tag: str, port: int, worker: list[str], *extra: str, grace: int = GRACE, nnodes: str = "2"
) -> subprocess.Popen:
    out = tmp / f"out{tag}"
    out.mkdir(exist_ok=True)
    cmd = FTRUN + [
        "--nnodes",
        nnodes,
        "--nproc_per_node",
        "1",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"127.0.0.1:{port}",
        "--rdzv_id",
        "sig",
        "--shutdown_timeout",
        str(grace),
        "--log_dir",
        str(tmp / f"log{tag}"),
        *extra,
        script("phase_worker.py"),
        *worker,
    ]
    return subprocess.Popen(
        cmd,
        env=env_with(OUT_DIR=str(out)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _signal_and_time(p: subprocess.Popen, sig: int = signal.SIGTERM) -> float:
    t0 = time.monotonic()
    p.send_signal(sig)
    try:
        p.wait(timeout=BOUND + 5)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise AssertionError(f"agent still alive {BOUND + 5:g}s after {sig!r}")
    return time.monotonic() - t0


def _worker_pid(tmp, tag: str) -> int:
    end = time.monotonic() + 60
    while time.monotonic() < end:
        files = glob.glob(str(tmp / f"out{tag}" / "pid.*"))
        if files:
            with open(files[0], encoding="utf-8") as f:
                raw = f.read().strip()
            if raw:
                return int(raw)
        time.sleep(0.05)
    raise AssertionError(f"no worker of {tag} started")


def _cleanup(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate()


def test_sigterm_in_the_rendezvous_wait_ends_the_agent(tmp_path) -> None:
    port = free_port()
    a = _agent(tmp_path, "a", port, [])
    try:
        _wait_event(str(tmp_path / "loga"), lambda e: "joined rendezvous in slot" in e["message"])
        took = _signal_and_time(a)
        _, err = a.communicate()
        assert a.returncode == 1 and took < BOUND, (took, err[-2000:])
        assert "received SIGTERM during the rendezvous" in err and "Traceback" not in err
    finally:
        _cleanup(a)


def test_sigint_while_waiting_for_an_absent_store_host(tmp_path) -> None:
    port = free_port()
    a = _agent(tmp_path, "a", port, [], "--rdzv_conf", "is_host=false")
    try:
        _wait_event(str(tmp_path / "loga"), lambda e: e["event"] == "start")
        time.sleep(1.0)
        took = _signal_and_time(a, signal.SIGINT)
        _, err = a.communicate()
        assert a.returncode == 1 and took < BOUND, (took, err[-2000:])
    finally:
        _cleanup(a)


def test_sigterm_to_the_store_host_while_running_is_a_leave(tmp_path) -> None:
    port = free_port()
    a = _agent(tmp_path, "a", port, ["--ignore-term"])
    b = None
    try:
        _wait_event(str(tmp_path / "loga"), lambda e: "hosting the store" in e["message"])
        # b learns the store host is gone after the liveness timeout, then tries to rejoin for
        # read_timeout before it ends with the one line naming etcd
        b = _agent(tmp_path, "b", port, [], "--rdzv_conf", "read_timeout=8", grace=5)
        pid = _worker_pid(tmp_path, "a")
        _worker_pid(tmp_path, "b")
        took = _signal_and_time(a)
        _, err = a.communicate()
        assert a.returncode == 1 and took < BOUND, (took, err[-2000:])
        assert not pid_alive(pid)  # a worker ignoring SIGTERM is killed after the grace
        assert _events(str(tmp_path / "loga"))  # and the agent's own log says why
        assert any(e["event"] == "signal" for e in _events(str(tmp_path / "loga")))
        _, berr = b.communicate(timeout=40)  # the store is gone with its host: b ends too
        assert b.returncode != 0 and "store" in berr.strip().splitlines()[-1], berr[-2000:]
    finally:
        _cleanup(a, *([b] if b else []))


def test_sighup_while_waiting_for_the_restart_all_go(tmp_path) -> None:
    port = free_port()
    # a's worker fails at once; b's worker ignores SIGTERM and b waits 20 s before killing it,
    # so a sits in the restart-all barrier waiting for the controller's go.
    a = _agent(
        tmp_path,
        "a",
        port,
        ["--sleep", "1", "--code", "3", "--first-only"],
        "--max_restarts",
        "1",
        "--recover_strategy",
        "restart-all",
    )
    b = None
    try:
        _wait_event(str(tmp_path / "loga"), lambda e: "hosting the store" in e["message"])
        b = _agent(
            tmp_path,
            "b",
            port,
            ["--ignore-term"],
            "--max_restarts",
            "1",
            "--recover_strategy",
            "restart-all",
            grace=20,
        )
        _wait_event(str(tmp_path / "loga"), lambda e: e["event"] == "plan-received")
        time.sleep(0.5)
        took = _signal_and_time(a, signal.SIGHUP)
        _, err = a.communicate()
        assert a.returncode == 1 and took < BOUND, (took, err[-2000:])
    finally:
        _cleanup(a, *([b] if b else []))


def test_sigterm_in_the_exit_barrier(tmp_path) -> None:
    port = free_port()
    a = _agent(tmp_path, "a", port, [])
    b = None
    try:
        _wait_event(str(tmp_path / "loga"), lambda e: "hosting the store" in e["message"])
        b = _agent(tmp_path, "b", port, ["--sleep", "0.5"])
        _wait_event(str(tmp_path / "logb"), lambda e: e["event"] == "node-done")
        took = _signal_and_time(b)
        _, err = b.communicate()
        assert b.returncode == 1 and took < BOUND, (took, err[-2000:])
        # the host sees b leave at once, not after the liveness timeout
        _wait_event(str(tmp_path / "loga"), lambda e: "node 1 left" in e["message"], timeout=3.0)
    finally:
        _cleanup(a, *([b] if b else []))
