"""Stack dumps of hung workers (real processes): faulthandler on SIGUSR1 for runtime-aware
workers (they carry on), SIGABRT with PYTHONFAULTHANDLER=1 for unmodified ones (they die), both
for a stopped process, read back from the worker's stderr file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from launcher.hang.stacks import Dump, dump_stacks

PLAIN = (
    "import time\ndef hung_here():\n    print('ready', flush=True)\n    time.sleep(60)\nhung_here()"
)
AWARE = (
    "import faulthandler, signal, time\nfaulthandler.register(signal.SIGUSR1, all_threads=True)\n"
    "def hung_here():\n    print('ready', flush=True)\n    time.sleep(60)\nhung_here()"
)


def start(code: str, err_path, **env: str) -> subprocess.Popen:
    err = open(err_path, "ab")
    try:
        p = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=err,
            env={**os.environ, **env},
        )
    finally:
        err.close()
    assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
    time.sleep(0.2)  # inside time.sleep
    os.kill(p.pid, signal.SIGSTOP)  # a real hang: stopped
    time.sleep(0.1)
    return p


def test_an_unmodified_worker_dumps_every_thread_on_sigabrt_and_dies(tmp_path) -> None:
    err = tmp_path / "stderr.log"
    err.write_bytes(b"earlier output\n")
    p = start(PLAIN, err, PYTHONFAULTHANDLER="1")
    d = dump_stacks(p.pid, aware=False, stderr_log=str(err), use_py_spy=False)
    assert p.wait(10) == -signal.SIGABRT
    assert d.how == "faulthandler (SIGABRT)" and d.where == str(err)
    assert "Fatal Python error: Aborted" in d.text and "in hung_here" in d.text
    assert "earlier output" not in d.text  # only what the dump wrote
    assert d.in_collective is False


def test_a_runtime_aware_worker_dumps_on_sigusr1_and_carries_on(tmp_path) -> None:
    err = tmp_path / "stderr.log"
    p = start(AWARE, err)
    try:
        d = dump_stacks(p.pid, aware=True, stderr_log=str(err), use_py_spy=False)
        assert d.how == "faulthandler (SIGUSR1)" and "most recent call first" in d.text
        assert "in hung_here" in d.text and p.poll() is None  # continued, still alive
    finally:
        p.kill()
        p.wait()
    d = dump_stacks(p.pid, aware=True, stderr_log=None, use_py_spy=False)  # gone: nothing to read
    assert d.text == "" and d.where == "the worker's stderr (console)" and d.in_collective is None


def test_stacks_inside_a_collective_are_recognised() -> None:
    text = (
        'Thread 0x1 (most recent call first):\n  File "/x/torch/distributed/distributed_c10d.py", '
        'line 2, in all_reduce\n  File "train.py", line 9, in step'
    )
    assert Dump("py-spy", text).in_collective is True
    assert Dump("py-spy", 'File "train.py", line 9, in step').in_collective is False
