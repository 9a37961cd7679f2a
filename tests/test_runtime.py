"""launcher.runtime.runtime: the `Runtime` facade's own behaviour (its parts have their own test
files: test_runtime_recovery, test_runtime_checkpoint, ...)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

from tests.helpers_launch import REPO, env_with
from tests.helpers_ports import free_port

FINISH = textwrap.dedent(
    """
    import gc, sys, torch
    import launcher.runtime as ftr
    rt = ftr.init(backend="gloo")
    model = torch.nn.Linear(4, 1)
    rt.register(model=model)
    for step in rt.steps(1):
        with step:
            model(torch.ones(2, 4)).sum().backward()
            rt.allreduce_gradients(model)
    import atexit
    atexit.register(lambda: print(gc.get_freeze_count(), flush=True))  # runs after finish's
    rt.finish()
    print(gc.get_freeze_count(), gc.isenabled(), flush=True)
    """
)


def test_finish_freezes_the_heap_so_the_interpreter_exits_without_walking_it() -> None:
    """rt.finish() has the interpreter's exit collect once and freeze what survives (gc.freeze)
    before its final collections, which then skip torch's object graph (1-3 s per rank on a busy
    node); until then (code after finish()) the collector works as usual."""
    env = env_with(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    r = subprocess.run(
        [sys.executable, "-c", FINISH],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    at_finish, enabled, at_exit = r.stdout.split()[-3:]
    assert int(at_finish) == 0 and enabled == "True", r.stdout
    assert int(at_exit) > 10_000, r.stdout


def test_finish_without_an_agent_stops_the_store_the_rank_hosted(monkeypatch) -> None:
    """Under plain torchrun rank 0 hosts torch's env:// store itself; atexit keeps the runtime
    alive, so finish() drops its reference and the store stops with the job, not with the
    interpreter (an in-process test would otherwise leave it listening)."""
    import launcher.runtime as ftr

    port = free_port()
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("FTRUN_AGENT_SOCKET", raising=False)
    ftr.init(backend="gloo").finish()
    deadline = time.monotonic() + 5.0
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                break
        assert time.monotonic() < deadline, f"port {port} still listens after finish()"
        time.sleep(0.05)


def test_without_an_agent_the_phase_edges_stop_reading_the_heap_after_the_first_step(
    monkeypatch,
) -> None:
    """The first step's phase edges note the heap's peak for the agent's spares (~0.1 ms each);
    with no agent to tell, they must stop after the first commit like with one, not cost every
    step of a plain-torchrun job."""
    import torch

    import launcher.runtime as ftr
    from launcher.runtime import heap

    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.delenv("FTRUN_AGENT_SOCKET", raising=False)
    reads: list[int] = []
    real = heap.in_use_bytes
    monkeypatch.setattr(heap, "in_use_bytes", lambda: reads.append(1) or real())
    rt = ftr.init(backend="gloo")
    try:
        model = torch.nn.Linear(4, 1)
        rt.register(model=model)
        counts = []
        for step in rt.steps(3):
            with step:
                with step.phase("forward"):
                    loss = model(torch.ones(2, 4)).sum()
                with step.phase("backward"):
                    loss.backward()
                with step.optimizer_update():
                    model.zero_grad()
            counts.append(len(reads))
        assert counts[0] > 0 and counts[2] == counts[0], counts  # none after the first step
    finally:
        rt.finish()
