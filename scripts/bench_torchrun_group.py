"""The benchmark workers' default process group when they run under plain torchrun.

Owns: `init_attempt_group()`. torch 2.13's torchrun keeps its store across a restart-all, and a
restarted gloo job that builds its group on it with `init_process_group()` can read the dead
attempt's addresses (seen here: "Gloo connectFullMesh failed ... Connection refused", or ranks
waiting forever on a peer of the old attempt). The group is built on a store prefix that counts
this rank's starts instead (membership restarts keep TORCHELASTIC_RESTART_COUNT, so the prefix
counts the starts; every rank starts once per restart-all, so the prefixes agree), as
bench_recovery_torchrun_worker.py does. Under ftrun (FTRUN_AGENT_SOCKET set) it does nothing:
the runtime builds its groups itself.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist


def init_attempt_group(backend: str = "gloo", timeout_s: float = 300.0) -> bool:
    """Build the default group on a per-start prefix under plain torchrun; False under ftrun."""
    if os.environ.get("FTRUN_AGENT_SOCKET") or dist.is_initialized():
        return False
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    starts = store.add(f"bench/starts/{rank}", 1)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"attempt{starts}", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    return True
