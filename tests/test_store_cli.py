"""`ftctl store serve|get|set|ls` against a real standalone store, as a user drives it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.helpers_launch import env_with, free_port

FTCTL = [sys.executable, "-m", "launcher.cli.ftctl"]


def ftctl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        FTCTL + list(args), capture_output=True, text=True, timeout=60, env=env or env_with()
    )


def test_serve_set_get_ls_and_stop(tmp_path) -> None:
    port = free_port()
    srv = subprocess.Popen(
        FTCTL + ["store", "serve", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env_with(),
    )
    try:
        addr = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            r = ftctl("store", "set", "--addr", addr, "job/a", "1")
            if r.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.returncode == 0, r.stderr
        assert ftctl("store", "set", "--addr", addr, "job/b", "two").returncode == 0
        got = ftctl("store", "get", "--addr", addr, "job/b")
        assert got.returncode == 0 and got.stdout.strip() == "two"
        ls = ftctl("store", "ls", "--addr", addr, "job/")
        assert ls.returncode == 0 and ls.stdout.split() == ["job/a", "job/b"]
        missing = ftctl("store", "get", "--addr", addr, "job/none")
        assert missing.returncode != 0 and len(missing.stderr.strip().splitlines()) == 1
    finally:
        srv.send_signal(signal.SIGINT)
        srv.wait(timeout=10)
    assert srv.returncode == 0


def test_bad_address_is_one_line() -> None:
    r = ftctl("store", "get", "--addr", "nonsense", "k")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_serve_refuses_a_busy_port() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = ftctl("store", "serve", "--host", "127.0.0.1", "--port", str(port))
    assert r.returncode != 0 and "in use" in r.stderr and "Traceback" not in r.stderr


def test_serve_rejects_a_bad_store_nice_in_one_line() -> None:
    r = ftctl(
        "store",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        env=env_with(FTRUN_STORE_NICE="high"),
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "FTRUN_STORE_NICE='high'" in r.stderr and "-20" in r.stderr


def test_serve_reads_ftrun_store_accel_and_rejects_a_bad_one_in_one_line() -> None:
    """`--accel/--no-accel`, default from FTRUN_STORE_ACCEL (ftrun's agent reads the same
    variable in launcher.config); a value that is not a switch ends with one line."""
    r = ftctl(
        "store",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        env=env_with(FTRUN_STORE_ACCEL="fast"),
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "FTRUN_STORE_ACCEL" in r.stderr or "'fast'" in r.stderr
    assert "--no-accel" in ftctl("store", "serve", "--help").stdout
