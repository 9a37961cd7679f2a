"""Test worker: an unmodified gloo script in which one rank hangs (sleeps, no progress) in the
first attempt while its peers wait in an all_reduce with a short backend timeout.

--hang-rank R: rank R sleeps instead of joining the all_reduce (first attempt only); the others
work for --work seconds first (so R is the first to go silent), then time out after --timeout s.
Rank 0 writes the restart count to --out when everyone finished.
"""

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--timeout", type=float, default=4.0)
    p.add_argument("--work", type=float, default=2.0)
    p.add_argument("--out", default="")
    a = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.timeout))
    rank = dist.get_rank()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.barrier()
    if rank == a.hang_rank and restart == 0:
        time.sleep(3600)  # hangs: no CPU, no I/O
    t0 = time.time()
    while time.time() - t0 < a.work:  # busy: progress the agent can see
        pass
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 0 and a.out:
        with open(a.out, "w") as f:
            json.dump({"sum": t.item(), "restart_count": restart}, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
