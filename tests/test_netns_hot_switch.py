"""The hot switch on a real (namespace) cluster: two hosts, two ranks each, the same c10d
command on both; `ftctl migrate --node 1` (run inside host 0, against the job's store) moves
both ranks of node 1 to new processes started by node 1's agent, their state received over the
veths from their replicas on node 0: the other node's ranks keep their pids, nothing is
charged, and the parameters are bit-identical to a fault-free single-host run. Measured once
(load 7-8 on 2 cores): new processes (warm spares) ready 0.53 s after the request, cost_s
0.88 s (halt request to repair plan), every rank training again 0.73 s after the plan (both
transfers from rank 0 over the veth)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers_faults import assert_same_params
from helpers_launch import FTRUN, REPO, communicate_all, env_with, events, failed_worker_logs, run
from helpers_netns import Cluster, unavailable, wait_until
from helpers_ports import free_port
from helpers_runtime import load_params

_WHY = unavailable()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")
TRAIN = f"{REPO}/scripts/examples/ddp_train.py"
STEPS = 40  # 12 s of 0.3 s steps: the switch comes well before the end


def _train(tmp, tag: str) -> list[str]:
    return [TRAIN, "--steps", str(STEPS), "--out", str(tmp / f"{tag}{{rank}}.pt")]


def _hellos(log_dir) -> int:
    return sum(e["event"] == "hello" for e in events(str(log_dir))) if log_dir.exists() else 0


@pytest.mark.slow  # ~100 s on a loaded 2-core box: two clusters' start-ups and a reference run
def test_every_rank_of_a_node_moves_live_on_a_two_host_cluster(tmp_path) -> None:
    ref = run(
        FTRUN
        + ["--nproc_per_node", "4", "--log_dir", str(tmp_path / "logref")]
        + _train(tmp_path, "ref"),
        env=env_with(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1"),
        timeout=180,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    with Cluster(2) as c:
        endpoint = f"{c.hosts[0].addr}:{free_port()}"
        procs = [
            h.popen(
                FTRUN
                + [
                    "--nnodes",
                    "2",
                    "--nproc_per_node",
                    "2",
                    "--rdzv_backend",
                    "c10d",
                    "--rdzv_endpoint",
                    endpoint,
                    "--rdzv_id",
                    "hs",
                    "--max_restarts",
                    "3",
                    "--master_addr",
                    c.hosts[0].addr,
                    "--log_dir",
                    str(tmp_path / f"log{h.index}"),
                ]
                + _train(tmp_path, "out")
                + ["--step-time", "0.3"],
                env=h.env(env_with(OMP_NUM_THREADS="1")),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for h in c.hosts
        ]
        logs = [tmp_path / f"log{h.index}" for h in c.hosts]
        assert wait_until(lambda: all(_hellos(d) >= 2 for d in logs), 120)
        res = c.hosts[0].run(
            [
                sys.executable,
                "-m",
                "launcher.cli.ftctl",
                "migrate",
                "--addr",
                endpoint,
                "--node",
                "1",
                "--timeout",
                "90",
            ],
            timeout=120,
            env=c.hosts[0].env(env_with()),
        )
        outs = communicate_all(procs, 180)
        for p, d, (_, err) in zip(procs, logs, outs):
            assert p.returncode == 0, err[-3000:] + "\n" + failed_worker_logs(str(d))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ranks [2, 3] moved to new processes" in res.stdout, res.stdout
    evs = [e for d in logs for e in events(str(d))]
    done = [e for e in evs if e["event"] == "switch-done"]
    assert len(done) == 1 and done[0]["moved"] == [2, 3]
    assert all(e["charged"] is False for e in evs if e["event"] == "plan")
    spawns: dict[int, list[int]] = {}
    for e in evs:
        if e["event"] == "spawn":
            spawns.setdefault(e["rank"], []).append(e["pid"])
    assert {r: len(p) for r, p in spawns.items()} == {0: 1, 1: 1, 2: 2, 3: 2}
    got = [load_params(tmp_path / f"out{r}.pt") for r in range(4)]
    want = [load_params(tmp_path / f"ref{r}.pt") for r in range(4)]
    assert_same_params(got, want)
