#!/usr/bin/env python3
"""The ftrun demo: a 4-rank training job, one worker killed with SIGKILL mid-run, recovered.

1. runs scripts/examples/ddp_train.py under ftrun (4 ranks, gloo, CPU);
2. after a few steps, sends SIGKILL to rank 1's process from outside (as a crash would);
3. ftrun restarts only rank 1, the survivors rebuild their process groups, rank 1 receives its
   state from a replica and the interrupted step is re-run;
4. a fault-free run with the same seed follows, and the final parameters are compared;
5. the demo writes the recovery report of the faulty run (`ftctl report`) and prints its path.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launcher.observe.logs import read_events as events  # noqa: E402  (the repo, not only an install)
from launcher.observe.report import build as build_report  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "scripts", "examples", "ddp_train.py")


def ftrun(log_dir: str, out: str, steps: int, ckpt: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "launcher",
        "--nproc_per_node",
        "4",
        "--max_restarts",
        "3",
        "--log_dir",
        log_dir,
        TRAIN,
        "--steps",
        str(steps),
        "--step-time",
        "0.1",
        "--out",
        out,
        "--checkpoint-dir",
        ckpt,
        "--checkpoint-every",
        "10",
    ]
    env = dict(os.environ, PYTHONPATH=REPO, GLOO_SOCKET_IFNAME="lo")
    print("$ ftrun " + " ".join(cmd[3:]), flush=True)
    return subprocess.Popen(cmd, env=env)


def main() -> int:
    work = tempfile.mkdtemp(prefix="ftrun_demo_")
    steps = 60
    print(
        f"== 1. training under ftrun, 4 ranks; a worker will be killed (logs: {work})", flush=True
    )
    ckpt = os.path.join(work, "ckpt")
    job = ftrun(os.path.join(work, "faulty"), os.path.join(work, "faulty.pt"), steps, ckpt)
    victim = None
    latest = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
    deadline = time.monotonic() + 180
    while victim is None and time.monotonic() < deadline and job.poll() is None:
        # strike mid-run: a few steps after the checkpoint of step 20
        if os.path.exists(latest) and int(open(latest).read().strip() or 0) >= 20:
            time.sleep(0.5)
            ev = events(os.path.join(work, "faulty"))
            victim = next(e["pid"] for e in ev if e["event"] == "spawn" and e["rank"] == 1)
        time.sleep(0.05)
    if victim is None:
        print("demo: the job did not start", file=sys.stderr)
        job.kill()
        return 1
    print(f"== 2. kill -9 {victim} (rank 1)", flush=True)
    os.kill(victim, signal.SIGKILL)
    code = job.wait(timeout=300)
    ev = events(os.path.join(work, "faulty"))
    spawns = [e for e in ev if e["event"] == "spawn"]
    rp = next((e for e in ev if e["event"] == "repair-plan"), None)
    if rp is not None:
        print(f"== recovery: {rp['message']}", flush=True)
    print(
        f"== 3. job exited with {code}; processes started: "
        + ", ".join(
            f"rank {e['rank']} pid {e['pid']}{' (replacement)' if e.get('replacement') else ''}"
            for e in spawns
        ),
        flush=True,
    )
    print("== 4. fault-free run with the same seed, for comparison", flush=True)
    ref = ftrun(
        os.path.join(work, "clean"),
        os.path.join(work, "clean.pt"),
        steps,
        os.path.join(work, "ckpt_clean"),
    )
    ref_code = ref.wait(timeout=300)
    import torch

    a = torch.load(os.path.join(work, "faulty.pt"))["params"]
    b = torch.load(os.path.join(work, "clean.pt"))["params"]
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    restarted = sorted({e["rank"] for e in spawns if e.get("replacement")})
    print(
        f"== result: exit codes {code}/{ref_code}; restarted ranks {restarted}; "
        f"final parameters bit-identical to the fault-free run: {'yes' if same else 'NO'}",
        flush=True,
    )
    report = build_report(os.path.join(work, "faulty"), os.path.join(work, "report.html"))
    print(
        f"== 5. the recovery report of the faulty run: {report}\n"
        f"   (open it in a browser; made by: ftctl report {os.path.join(work, 'faulty')})",
        flush=True,
    )
    return 0 if code == 0 and ref_code == 0 and same and restarted == [1] else 1


if __name__ == "__main__":
    sys.exit(main())
