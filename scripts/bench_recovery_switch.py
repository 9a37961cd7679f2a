"""The recovery benchmark's hot-switch row (`bench_recovery.py --scenarios native:switch`): what
moving a healthy rank to a new process costs (`ftctl migrate --rank 1`: halt at a step boundary,
state sent from a replica, no rollback) against torchrun, whose only way to move a rank is to
restart every worker from the checkpoint (rank 1 killed at the same step), in the same run.

Owns: `Migrator` (the scenario's trigger: once ftrun's warm spares are ready and --kill-after-step
steps are done, `ftctl migrate RUN_DIR --rank 1` on a thread it owns, bounded by its --timeout,
instead of a kill), `switch_split` (ftrun's numbers from the job: the switch's `cost_s`,
`prepare_s` and `halted_s` as `switch-done` says them; `halt_to_resume_s` from the step boundary
the world halted at, the last commit of the step before the switch, until every rank, the moved
one's new process too, committed the first step after it; `lost_s` that minus one fault-free
step, the work that step is anyway; `steps_redone`: steps committed again, 0 without rollback;
the moved rank's pids and whether the other ranks kept theirs) and `switch_row`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

from bench_recovery_scenarios import (
    REPO,
    Killer,
    Scenario,
    fault_free_step_s,
    lost_split,
    regained_at,
    run_scenario_job,
    trains_again_s,
)

MOVED = 1  # the rank the scenario moves
MIGRATE_TIMEOUT_S = 120.0


class Migrator(Killer):
    """As the `warm` kill point, but moving rank 1 with `ftctl migrate` instead of killing it."""

    answer: str = ""

    def _kill(self, pid: int, step: int) -> None:
        self.steps.append(step)
        self.times.append(time.time())
        cmd = [sys.executable, "-m", "launcher.cli.ftctl", "migrate"]
        cmd += [os.path.join(self.out, "logs"), "--rank", str(MOVED)]
        cmd += ["--timeout", str(MIGRATE_TIMEOUT_S)]

        def run() -> None:
            env = dict(os.environ, PYTHONPATH=REPO)
            res = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=MIGRATE_TIMEOUT_S + 30
            )
            self.answer = (res.stdout + res.stderr).strip()

        self.thread = threading.Thread(target=run, name="bench-migrate", daemon=True)
        self.thread.start()


def switch_split(job: dict) -> dict:
    """ftrun's numbers of one switch job (module docstring)."""
    done = next((e for e in job["events"] if e["event"] == "switch-done"), None)
    if done is None:
        why = next((e for e in job["events"] if e["event"] == "switch-abandoned"), {})
        return {"switched": False, "why": why.get("message", "no switch-done event")}
    steps, resume, cost = job["steps"], done["resume_step"], float(done["cost_s"])
    t_halt = done["time"] - cost
    boundary = max(
        max(r["time"] for r in recs if r["step"] == resume - 1)
        for recs in steps.values()
        if any(r["step"] == resume - 1 for r in recs)
    )
    resumed = regained_at(steps, t_halt, resume)
    step_s = fault_free_step_s(steps, job["kill_times"][0], resumed)
    redone = sum(
        1
        for recs in steps.values()
        for r in recs
        if r["time"] > t_halt
        and any(o["step"] == r["step"] and o["time"] < r["time"] for o in recs)
    )
    others = {r: {x["pid"] for x in recs} for r, recs in steps.items() if r != MOVED}
    return {
        "switched": True,
        "moved": done.get("moved"),
        "resume_step": resume,
        "cost_s": round(cost, 4),
        "prepare_s": done.get("prepare_s"),
        "halted_s": done.get("halted_s"),
        "halt_to_resume_s": round(resumed - boundary, 4),
        "lost_s": round(resumed - boundary - step_s, 4),
        "step_s": round(step_s, 4),
        "steps_redone": redone,
        "moved_pids": len({x["pid"] for x in steps.get(MOVED, [])}),
        "others_kept_pids": all(len(p) == 1 for p in others.values()),
        "restarts_used": max((e.get("restarts_used", 0) for e in job["events"]), default=0),
    }


def switch_row(sc: Scenario, args: argparse.Namespace, row: dict) -> dict:
    """A hot switch of rank 1 against torchrun restart-all killed at the same step."""
    ft = run_scenario_job("ftrun", sc, args)
    row["ftrun"] = switch_split(ft)
    if args.torchrun:
        tr = run_scenario_job("torchrun", sc, args, kill_step=ft["killed_steps"][0])
        row["torchrun"] = {
            **lost_split(tr, "torchrun"),
            "trains_again_s": trains_again_s(tr, "torchrun"),
        }
        lost = row["ftrun"].get("lost_s")
        if lost is not None:
            row["lost_vs_torchrun"] = round(lost / row["torchrun"]["lost_s"], 4)
    return row
