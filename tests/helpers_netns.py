"""The network-namespace cluster for the multi-node tests: re-exports scripts/netns_cluster.py
(where scripts/bench_multinode.py can import it too), names prefixed "ft"."""
from __future__ import annotations

import os
import sys

_SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
if _SCRIPTS not in sys.path:
    sys.path.insert(0, _SCRIPTS)

from netns_cluster import IFNAME, Cluster, Host, unavailable, wait_until  # noqa: E402

__all__ = ["IFNAME", "Cluster", "Host", "unavailable", "wait_until"]
