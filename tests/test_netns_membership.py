"""Membership across real hosts: the network-namespace cluster (tests/helpers_netns.py) with
the store (etcd, or the embedded store) on host 0's bridge address and one membership agent
per host. A host cut off for twice the liveness timeout is seen lost by the others within the
timeout, notices it on its own, rejoins as a fresh node when its link returns, and its stale
writes are refused."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from helpers_etcd import ETCD_BIN, AgentProc, etcd_available, free_port
from helpers_netns import Cluster, start_etcd_in, unavailable, wait_until

_WHY = unavailable()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")

HB_INTERVAL, HB_TIMEOUT = 0.25, 1.5


def _start_store(host, port: int) -> None:
    host.popen(
        [
            sys.executable,
            "-m",
            "rendezvous.store.store_cli",
            "serve",
            "--host",
            host.addr,
            "--port",
            str(port),
        ],
        env=host.env(PYTHONPATH=os.getcwd()),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def up() -> bool:
        try:
            socket.create_connection((host.addr, port), timeout=0.5).close()
            return True
        except OSError:
            return False

    assert wait_until(up, 20), "the embedded store in host 0 did not start"


@pytest.mark.parametrize("backend", ["etcd", "tcp"])
def test_cut_host_is_lost_notices_alone_and_rejoins_fresh(backend: str) -> None:
    if backend == "etcd" and not etcd_available():
        pytest.skip(f"etcd binary not found at {ETCD_BIN}")
    limit = float(int(HB_TIMEOUT) + 1) if backend == "etcd" else HB_TIMEOUT  # lease TTL: whole s
    with tempfile.TemporaryDirectory(prefix="ftrun-netns-") as tmp, Cluster(3) as c:
        port = free_port()
        if backend == "etcd":
            start_etcd_in(c.hosts[0], port, os.path.join(tmp, "etcd"))
        else:
            _start_store(c.hosts[0], port)
        endpoint = f"{c.hosts[0].addr}:{port}"
        agents = []
        try:
            for i, h in enumerate(c.hosts):  # no node rank: ranks come from arrival order
                agents.append(
                    AgentProc(
                        backend,
                        endpoint,
                        "netns",
                        None,
                        "3",
                        name=h.addr,
                        hb_interval=HB_INTERVAL,
                        hb_timeout=HB_TIMEOUT,
                        rejoin=True,
                        hosts_store=(i == 0 and backend == "tcp"),
                        wrap=h.argv,
                        base_env=h.env(),
                    )
                )
                time.sleep(0.3)
            worlds = [a.expect("world", 30) for a in agents]
            assert sorted(w["group_rank"] for w in worlds) == [0, 1, 2]
            assert len({tuple(w["hosts"]) for w in worlds}) == 1  # one world, seen by all
            assert sorted(worlds[0]["hosts"]) == sorted(h.addr for h in c.hosts)
            assert [worlds[0]["hosts"][w["group_rank"]] for w in worlds] == [
                h.addr for h in c.hosts
            ]
            cut, gr = c.hosts[2], worlds[2]["group_rank"]
            time.sleep(0.5)
            t0 = time.time()
            cut.link(False)
            for a in agents[:2]:
                dead = a.expect("dead", limit + 3, node=gr)
                assert dead["t"] - t0 <= limit + 1.0, (dead["t"] - t0, limit)
            lost = agents[2].expect("lost", limit + 3)
            assert lost["kind"] == "store-unreachable"
            assert limit - 0.3 <= lost["t"] - t0 <= limit + 1.0, (lost["t"] - t0, limit)
            time.sleep(max(0.0, t0 + 2 * limit - time.time()))
            cut.link(True)
            again = agents[2].expect("world", 30, rejoined=True)
            assert again["group_rank"] == gr and again["incarnation"] == 2
            for a in agents[:2]:
                a.expect("join", 10, node=gr)
            refused = [agents[2].expect("fenced", 10) for _ in range(2)]
            assert {r["what"] for r in refused} == {"checked_set", "advance_generation"}
            assert all("is stale: write to" in r["error"] for r in refused)
        finally:
            for a in agents:
                a.stop()
