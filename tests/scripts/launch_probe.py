"""Benchmark worker: records when it started, when its process group was ready, and crashes once.

Writes `$OUT_DIR/<attempt>.<rank>.json` with {"start", "ready"} wall times. Rank 1 of attempt 0
writes `$OUT_DIR/crash.json` with the time and exits 1 after --crash-after seconds of training.
"""

import json
import os
import sys
import time

t_start = time.time()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
t = torch.ones(1)
dist.all_reduce(t)
out = os.environ["OUT_DIR"]
with open(os.path.join(out, f"{attempt}.{rank}.json"), "w") as f:
    json.dump({"start": t_start, "ready": time.time()}, f)
crash_after = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 40
t0 = time.time()
for i in range(steps):
    if rank == 1 and attempt == 0 and time.time() - t0 > crash_after:
        with open(os.path.join(out, "crash.json"), "w") as f:
            json.dump({"time": time.time()}, f)
        os._exit(1)
    dist.all_reduce(t)
    time.sleep(0.05)
dist.destroy_process_group()
