"""Node loss repaired from peers, on a real (namespace) cluster: the same c10d command on every
host, a node crashes (its agent and workers SIGKILLed), and
  * with a hot spare waiting: the spare takes the lost node's ranks, they are repaired from the
    surviving replica (recover-in-place), the survivor keeps its process, and the final
    parameters are bit-identical to a fault-free run;
  * without one: after node_replace_timeout the job ends with one line naming the lost node and
    why (shrinking to the remaining nodes is not supported).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers_launch import FTRUN, REPO, env_with, free_port, run
from helpers_netns import Cluster, Host, unavailable, wait_until
from helpers_runtime import assert_bit_identical, load_params

_WHY = unavailable()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")
TRAIN = f"{REPO}/scripts/examples/ddp_train.py"
CONF = "keep_alive_interval=0.5,heartbeat_timeout=2"


def _events(log_dir: Path) -> list[dict]:
    out: list[dict] = []
    for path in log_dir.glob("*/events.jsonl"):
        with open(path, encoding="utf-8") as f:
            out += [json.loads(line) for line in f if line.strip()]
    return out


def _agent(
    h: Host, endpoint: str, tmp: Path, tag: str, conf: str, train: list[str]
) -> subprocess.Popen:
    cmd = FTRUN + [
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        endpoint,
        "--rdzv_id",
        "nl",
        "--rdzv_conf",
        conf,
        "--max_restarts",
        "3",
        "--log_dir",
        str(tmp / f"log{tag}"),
        TRAIN,
        *train,
    ]
    return h.popen(
        cmd,
        env=h.env(env_with(OMP_NUM_THREADS="1", FTRUN_STORE_TIMEOUT="60")),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _training(tmp: Path, tag: str) -> bool:
    """Rank `tag`'s worker said hello (it runs the runtime's step loop)."""
    return any(e["event"] == "hello" for e in _events(tmp / f"log{tag}"))


def test_a_hot_spare_takes_a_crashed_nodes_ranks_repaired_from_peers(tmp_path) -> None:
    steps = ["--steps", "40", "--step-time", "0.15"]
    ref = run(
        FTRUN
        + [
            "--nproc_per_node",
            "2",
            "--log_dir",
            str(tmp_path / "logref"),
            TRAIN,
            *steps[:2],
            "--out",
            str(tmp_path / "ref{rank}.pt"),
        ],
        env=env_with(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1"),
        timeout=120,
    )
    assert ref.returncode == 0, ref.stderr[-2000:]
    train = [*steps, "--out", str(tmp_path / "out{rank}.pt")]
    with Cluster(3, prefix="nl") as c:
        h0, h1, h2 = c.hosts
        endpoint = f"{h0.addr}:{free_port()}"
        conf = f"{CONF},node_replace_timeout=60"
        a0 = _agent(h0, endpoint, tmp_path, "0", conf, train)
        a1 = _agent(h1, endpoint, tmp_path, "1", conf, train)
        assert wait_until(lambda: _training(tmp_path, "0") and _training(tmp_path, "1"), 60), (
            "the two nodes did not start training"
        )
        spare = _agent(h2, endpoint, tmp_path, "s", conf, train)
        assert wait_until(
            lambda: any(e["event"] == "hot-spare" for e in _events(tmp_path / "logs")), 30
        ), "no hot spare"
        time.sleep(1.0)
        t_kill = time.time()
        assert h1.kill_all() >= 2  # node 1 crashes: its agent and its worker
        a1.wait(10)
        out0, err0 = a0.communicate(timeout=90)
        outs, errs = spare.communicate(timeout=30)
    assert a0.returncode == 0, err0[-4000:]
    assert spare.returncode == 0, errs[-4000:]
    ev0, evs = _events(tmp_path / "log0"), _events(tmp_path / "logs")
    # node 0 saw the loss, with why and who takes over; the spare took node 1's ranks
    lost = [e for e in ev0 if e["event"] == "node-lost"]
    assert lost and lost[0]["lost_node"] == 1 and "no heartbeat for 2s" in lost[0]["message"], lost
    assert any(e["event"] == "spare-takes-over" and e["group_rank"] == 1 for e in evs)
    # peers repaired it: no restart-all, the survivor kept its process
    strategies = [e["strategy"] for e in ev0 if e["event"] == "plan"]
    assert "recover-in-place" in strategies and "restart-all" not in strategies, strategies
    spawns0 = [e for e in ev0 if e["event"] == "spawn"]
    assert [e["rank"] for e in spawns0] == [0], spawns0
    spawns = [e for e in evs if e["event"] == "spawn"]
    assert [(e["rank"], e.get("replacement")) for e in spawns] == [(1, True)], spawns
    assert any(e["event"] == "rank-recovered" and e.get("source") == 0 for e in evs), (
        "rank 1 was not repaired from rank 0"
    )
    assert spawns[0]["time"] > t_kill
    recovered = next(e for e in evs if e["event"] == "rank-recovered")
    took = {
        "scenario": "node-loss-hot-spare",
        "detect_s": round(lost[0]["time"] - t_kill, 3),
        "mttr_s": round(recovered["time"] - t_kill, 3),
    }
    print(json.dumps(took))
    assert took["mttr_s"] < 30, took
    for r in (0, 1):
        assert_bit_identical(
            load_params(tmp_path / f"ref{r}.pt"), load_params(tmp_path / f"out{r}.pt")
        )


@pytest.mark.parametrize(
    "fault, why",
    [
        ("crash", "no heartbeat for 2s"),  # every process of node 1 SIGKILLed
        ("sigterm", "its agent left on a signal (stopped or preempted)"),  # preempted
    ],
)
def test_without_a_spare_the_job_ends_after_node_replace_timeout_with_one_line(
    tmp_path, fault: str, why: str
) -> None:
    train = ["--steps", "400", "--step-time", "0.1"]
    with Cluster(2, prefix="nl") as c:
        h0, h1 = c.hosts
        endpoint = f"{h0.addr}:{free_port()}"
        conf = f"{CONF},node_replace_timeout=3"
        a0 = _agent(h0, endpoint, tmp_path, "0", conf, train)
        a1 = _agent(h1, endpoint, tmp_path, "1", conf, train)
        assert wait_until(lambda: _training(tmp_path, "0") and _training(tmp_path, "1"), 60), (
            "the two nodes did not start training"
        )
        t0 = time.monotonic()
        if fault == "crash":
            h1.kill_all()
        else:
            a1.send_signal(signal.SIGTERM)
        a1.wait(10)
        _, err0 = a0.communicate(timeout=40)
        took = time.monotonic() - t0
    assert a0.returncode == 1, err0[-4000:]
    # heartbeat timeout (2 s) + node_replace_timeout (3 s) + stopping the survivor
    assert took < 20, took
    # one line: the lost node, why, the timeout, and why the job does not go on without it
    line = next(
        (
            ln
            for ln in err0.splitlines()
            if f"node 1 lost ({why}): no hot spare or "
            "replacement agent took it over within node_replace_timeout=3s" in ln
        ),
        None,
    )
    assert line is not None, err0[-4000:]
    assert "--nnodes MIN=2 does not allow continuing on 1 node(s)" in line, line
    assert f"reason: node 1 lost ({why})" in err0, err0[-4000:]
    ev0 = _events(tmp_path / "log0")
    assert [e["strategy"] for e in ev0 if e["event"] == "plan"][-1] == "exit"
