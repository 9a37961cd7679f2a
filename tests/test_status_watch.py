"""`ftctl status --watch` (launcher/observe/status_watch.py): frames rendered then put in place of
the last one on a terminal (never a cleared, blank screen), and a clean last frame and exit 0
when the job ends while watched (its store goes away with it)."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time

import click
import pytest
from helpers_launch import env_with
from helpers_observe import FTCTL, ObservedJob

from launcher.observe.run_view import RunView
from launcher.observe.status_watch import watch


def test_the_last_frame_after_the_store_went_away_is_the_finished_run_from_its_directory():
    live = RunView(run_id="j", outcome="running", log_dirs=["/gone", "/run"])
    finished = RunView(run_id="j", outcome="succeeded")
    answers = [(live, "live, store h:1"), (live, "live, store h:1")]

    def load():
        if answers:
            return answers.pop(0)
        raise click.ClickException("store h:1: [Errno 111] Connection refused")

    def from_dir(path):
        if path != "/run":
            raise click.ClickException(f"{path}: no events.jsonl")
        return finished

    shown = []
    watch(load, from_dir, lambda v, src: shown.append((v.outcome, src)), 0.0, 0)
    assert shown == [
        ("running", "live, store h:1"),
        ("running", "live, store h:1"),
        ("succeeded", "job ended; events of /run"),
    ]


def test_without_a_directory_the_last_live_frame_says_the_job_ended():
    answers = [(RunView(outcome="running"), "live, store h:1")]

    def load():
        if answers:
            return answers.pop(0)
        raise click.ClickException("store h:1: Connection refused")

    shown = []
    watch(load, lambda p: RunView(), lambda v, src: shown.append((v.outcome, src)), 0.0, 0)
    assert shown[-1][0] == "ended" and shown[-1][1].startswith("job ended")


def test_a_store_never_reached_is_an_error_and_a_finished_run_ends_the_watch():
    def refused():
        raise click.ClickException("store h:1: Connection refused")

    with pytest.raises(click.ClickException):
        watch(refused, lambda p: RunView(), lambda v, s: None, 0.0, 0)
    views = [RunView(outcome="running"), RunView(outcome="running"), RunView(outcome="failed")]
    shown = []
    watch(lambda: (views.pop(0), "live"), lambda p: RunView(), lambda v, s: shown.append(v), 0, 0)
    assert [v.outcome for v in shown] == ["running", "running", "failed"]


def read_all(fd: int, proc: subprocess.Popen, timeout: float) -> bytes:
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the other end closed
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    return out


def test_watching_a_job_on_a_terminal_redraws_in_place_and_exits_0_when_it_ends(tmp_path):
    job = ObservedJob(tmp_path, steps=40, step_time=0.05, env={"FTRUN_WARM_SPARE": "0"})
    watcher = None
    try:
        addr = job.store_addr()
        job.wait_for("progress")
        master, slave = pty.openpty()
        env = env_with(COLUMNS="150", LINES="60", TERM="xterm")
        watcher = subprocess.Popen(
            FTCTL + ["status", "--watch", "--interval", "0.3", "--addr", addr],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            close_fds=True,
        )
        os.close(slave)
        assert job.finish() == 0, job.output()[-4000:]
        out = read_all(master, watcher, timeout=60)
        assert watcher.wait(30) == 0, out[-3000:]
        os.close(master)
    finally:
        job.stop()
        if watcher is not None and watcher.poll() is None:
            watcher.kill()
            watcher.wait(10)
    text = out.decode(errors="replace")
    assert "Connection refused" not in text and "error" not in text.lower()
    assert "\x1b[2J" not in text and "\x1b[H\x1b[2J" not in text  # never a cleared screen
    assert text.count("restart budget") >= 2 and "\x1b[1A" in text  # the cursor back up
    tail = text[text.rindex("ftrun job") :]
    assert "succeeded" in tail and "job ended" in tail  # the finished run, from its directory
