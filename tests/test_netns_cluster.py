"""The network-namespace cluster the multi-node tests run on (tests/helpers_netns.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from helpers_launch import communicate_all, free_port
from helpers_netns import Cluster, unavailable, wait_until

_WHY = unavailable()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")

SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(8)
    print("ready", flush=True)
    while True:
        c, _ = s.accept(); c.sendall(b"hello"); c.close()
""")
CLIENT = textwrap.dedent("""
    import socket, sys
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    print(c.recv(5).decode())
""")
ALLREDUCE = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    rank, addr, port = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=2)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print(int(t.item()))
    dist.destroy_process_group()
""")


def _connect(host, addr: str, port: int, timeout: float = 2.0) -> subprocess.CompletedProcess[str]:
    return host.run([sys.executable, "-c", CLIENT, addr, str(port), str(timeout)], timeout=30)


def test_hosts_reach_each_other_by_address_and_a_cut_link_partitions():
    with Cluster(2) as c:
        a, b = c.hosts
        assert a.addr != b.addr
        port = free_port()
        srv = a.popen(
            [sys.executable, "-c", SERVER, a.addr, str(port)], stdout=subprocess.PIPE, text=True
        )
        assert srv.stdout.readline().strip() == "ready"
        assert _connect(b, a.addr, port).stdout.strip() == "hello"
        # the server listens on a's address only: b's own loopback has nothing there
        assert _connect(b, "127.0.0.1", port).returncode != 0
        a.link(False)
        cut = _connect(b, a.addr, port, timeout=1.0)
        assert cut.returncode != 0
        a.link(True)
        assert wait_until(lambda: _connect(b, a.addr, port).stdout.strip() == "hello", 10)


def test_gloo_all_reduce_runs_over_the_veths():
    with Cluster(2) as c:
        port = free_port()
        procs = [
            h.popen(
                [sys.executable, "-c", ALLREDUCE, str(i), c.hosts[0].addr, str(port)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i, h in enumerate(c.hosts)
        ]
        outs = communicate_all(procs, 120)
        assert [p.returncode for p in procs] == [0, 0], outs
        assert [o[0].strip() for o in outs] == ["3", "3"]


def test_close_removes_everything_even_after_a_failure_and_kill_all_crashes_a_host():
    c = Cluster(2)
    with pytest.raises(RuntimeError):
        with c:
            h = c.hosts[1]
            p = h.popen([sys.executable, "-c", "import time; time.sleep(600)"])
            assert wait_until(lambda: p.pid in h.pids() or len(h.pids()) > 0, 10)
            assert h.kill_all() >= 1
            assert p.wait(10) != 0
            h.popen(
                [sys.executable, "-c", "import time; time.sleep(600)"]
            )  # left running on purpose
            raise RuntimeError("test failed midway")
    assert c.leftovers() == []


def test_a_prefix_names_everything_and_close_removes_it():
    with Cluster(1, prefix="bm") as c:
        h = c.hosts[0]
        assert h.name.startswith("bm") and h.veth.startswith("bmv") and c.bridge.startswith("bmbr")
        assert c.leftovers() == sorted([h.name, h.veth, c.bridge])
        assert h.run(["ip", "-o", "-4", "addr", "show", "eth0"]).stdout.count(h.addr) == 1
    assert c.leftovers() == []
    with pytest.raises(ValueError, match="prefix"):
        Cluster(1, prefix="Bad-1")
