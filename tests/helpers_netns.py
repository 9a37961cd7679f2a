"""The network-namespace cluster for the multi-node tests: re-exports scripts/netns_cluster.py
(where scripts/bench_multinode.py can import it too), names prefixed "ft"; `start_etcd_in`
runs a real etcd server inside one host of the cluster."""
from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

_SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
if _SCRIPTS not in sys.path:
    sys.path.insert(0, _SCRIPTS)

from netns_cluster import IFNAME, Cluster, Host, unavailable, wait_until  # noqa: E402

from helpers_etcd import ETCD_BIN, free_port  # noqa: E402

__all__ = ["IFNAME", "Cluster", "Host", "start_etcd_in", "unavailable", "wait_until"]


def start_etcd_in(host: Host, port: int, data_dir: str) -> str:
    """Start etcd in `host` on its bridge address, `port`; wait until healthy; its client URL.
    The process belongs to the host (the cluster's close() stops it)."""
    url = f"http://{host.addr}:{port}"
    peer = f"http://127.0.0.1:{free_port()}"
    host.popen([ETCD_BIN, "--name", "t", "--data-dir", data_dir, "--listen-client-urls", url,
                "--advertise-client-urls", url, "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer, "--initial-cluster", f"t={peer}",
                "--log-level", "error", "--heartbeat-interval", "10", "--election-timeout", "100"],
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=0.5) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    assert wait_until(healthy, 20), f"etcd in host {host.addr} did not become healthy"
    return url
