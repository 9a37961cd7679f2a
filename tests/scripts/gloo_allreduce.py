"""Test worker: one gloo all_reduce of (rank + 1) over the job; writes $OUT_DIR/rank.<RANK>.json
with the sum and where `launcher.runtime` was imported from (the wheel test checks it is the
installed copy, not the checkout)."""

import json
import os

import torch
import torch.distributed as dist

import launcher.runtime

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
out = {"rank": dist.get_rank(), "sum": t.item(), "runtime_file": launcher.runtime.__file__}
dist.destroy_process_group()
with open(os.path.join(os.environ["OUT_DIR"], f"rank.{out['rank']}.json"), "w") as f:
    json.dump(out, f)
