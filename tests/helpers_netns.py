"""The network-namespace cluster for the multi-node tests: re-exports scripts/netns_cluster.py
(where scripts/bench_multinode.py can import it too), names prefixed "ft"; `start_etcd_in`
runs a real etcd server inside one host of the cluster."""

from __future__ import annotations

import os
import sys

_SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
if _SCRIPTS not in sys.path:
    sys.path.insert(0, _SCRIPTS)

from helpers_etcd import ETCD_BIN, free_port  # noqa: E402
from netns_cluster import IFNAME, Cluster, Host, start_etcd, unavailable, wait_until  # noqa: E402

__all__ = ["IFNAME", "Cluster", "Host", "start_etcd_in", "unavailable", "wait_until"]


def start_etcd_in(host: Host, port: int, data_dir: str) -> str:
    """Start etcd in `host` on its bridge address, `port`; wait until healthy; its client URL.
    The process belongs to the host (the cluster's close() stops it)."""
    return start_etcd(host, port, free_port(), data_dir, ETCD_BIN)
