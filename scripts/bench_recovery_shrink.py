"""The recovery benchmark's shrink row (`bench_recovery.py --scenarios native:shrink`): what a
live shrink costs (and, once the world grows back live, each grow) against torchrun
restart-all from a checkpoint, in the same run.

Owns: `SHRINK_FLAGS` (ftrun's flags for the row: `--recover-strategy elastic-training`, no warm
spares: a shrink restarts nobody), `shrink_split` (the numbers of ftrun's job: time lost by the
survivors, split into the interrupted step done again in the smaller world and the overhead,
the step time before and after, the world's changes as `launcher.observe.world_history` reads
them from events.jsonl, each shrink's and grow's cost there, the survivors' processes kept)
and `grow_split` (the live grow back that follows in the same job, when the dropped rank's
returning process is ready before the job ends: its time lost at the step boundary, against
the same torchrun restart-all: torchrun grows a world back by restarting every worker too).

The job: the native loop with `--micro-batches` (scripts/bench_recovery_worker.py: each step
consumes micro-batches 0..N-1 of the original world, `rt.micro_batches` of them on this rank, so
a shrink keeps the global batch), rank 1 SIGKILLed from outside once every rank completed
--kill-after-step steps; torchrun runs the same script (every rank computes its own micro-batch,
restart-all from the checkpoint of every 10 steps) killed at the same step.

Time lost (the project's rule, docs/user-guide.md#time-lost) for a shrink: from the fault until
every rank of the smaller world committed the interrupted step (the step files); `redone_s` is
that step computed again in the smaller world (the median step after the shrink, `step_after_s`:
the survivors compute the lost replica's micro-batches too), `overhead_s` the rest (detecting,
stopping, rebuilding the groups). `events_cost_s` is the shrink's cost as `ftctl report` shows
it (its round's time lost from events.jsonl, ending at the heartbeat that tells the commit).
"""

from __future__ import annotations

from bench_recovery_scenarios import fault_free_step_s, ftrun_rounds, regained_at

from launcher.observe.timeline import Timeline

SHRINK_FLAGS = ["--recover-strategy", "elastic-training", "--warm-spares", "0"]
VICTIM = 1  # the rank the scenario kills (`Killer`)


def survivors(steps: dict[int, list[dict]], victim: int = VICTIM) -> dict[int, list[dict]]:
    return {r: recs for r, recs in steps.items() if r != victim}


def world_changes(events: list[dict], since: float) -> list[dict]:
    """The world's shrinks and grows after `since` as `ftctl report` reads them, each with its
    cost (a shrink: its round's time lost; a grow: the seconds it held the ranks)."""
    view = Timeline().feed_all(events).view(now=None)
    return [
        {
            "kind": c.kind,
            "world": [c.before, c.world_size],
            "step": c.step,
            "cost_s": c.cost_s,
            "open": c.cost_open,
        }
        for c in view.world_changes
        if c.time >= since - 1.0
    ]


def shrink_split(job: dict, victim: int = VICTIM) -> dict:
    """ftrun's numbers of one shrink job (module docstring)."""
    t_kill, step = job["kill_times"][0], job["killed_steps"][0]
    kept = survivors(job["steps"], victim)
    t_back = regained_at(kept, t_kill, step)
    step_s = fault_free_step_s(job["steps"], t_kill, float("inf"))  # before the kill
    after_s = fault_free_step_s(job["steps"], float("-inf"), t_back)  # in the smaller world
    fault, events_lost, rounds = ftrun_rounds(job["events"], t_kill)
    t_fault = fault if fault is not None else t_kill
    lost = t_back - t_fault
    redone = min(lost, after_s or step_s)
    changes = world_changes(job["events"], t_kill)
    shrinks = [c for c in changes if c["kind"] == "shrink"]
    return {
        "killed_step": step,
        "kills": len(job["kill_times"]),
        "rounds": rounds,
        "strategies": [e["strategy"] for e in job["events"] if e["event"] == "plan"],
        "lost_s": round(lost, 4),
        "redone_s": round(redone, 4),
        "overhead_s": round(lost - redone, 4),
        "step_s": round(step_s, 4),
        "step_after_s": round(after_s, 4),
        "lost_events_s": None if events_lost is None else round(events_lost, 4),
        "events_cost_s": shrinks[0]["cost_s"] if shrinks else None,
        "world_changes": changes,
        "grow_cost_s": [c["cost_s"] for c in changes if c["kind"] == "grow"],
        "processes_restarted": sum(len({r["pid"] for r in recs}) - 1 for recs in kept.values()),
        "grow": grow_split(job, step_s, victim),
    }


def grow_split(job: dict, step_s: float, victim: int = VICTIM) -> dict | None:
    """The live grow back's numbers (None when the world did not grow back within the job):
    `cost_s` as the event says it (halt request to repair plan); `halt_to_resume_s` from the
    step boundary the world halted at (the last survivor's commit of the step before the grow)
    until every rank, the returned one too, committed the first step after it; `lost_s` that
    minus one step of the full world (`step_s`: what the step costs anyway); `steps_redone`:
    steps a survivor committed again after the halt (no rollback: 0); `back_after_s`: from the
    kill to the grow's halt request (the returning process's start)."""
    grow = next(
        (e for e in job["events"] if e["event"] == "world-grow" and "new_world_size" in e), None
    )
    if grow is None:
        return None
    cost = float(grow.get("cost_s") or 0.0)
    t_halt = grow["time"] - cost
    out: dict = {
        "cost_s": round(cost, 4),
        "back_after_s": round(t_halt - job["kill_times"][0], 4),
        "resume_step": grow.get("resume_step"),
    }
    resume = grow.get("resume_step")
    if resume is None:
        return out
    kept = survivors(job["steps"], victim)
    boundary = max(
        max(r["time"] for r in recs if r["step"] == resume - 1)
        for recs in kept.values()
        if any(r["step"] == resume - 1 for r in recs)
    )
    resumed = regained_at(job["steps"], t_halt, resume)
    redone = sum(
        1
        for recs in kept.values()
        for r in recs
        if r["time"] > t_halt
        and r["step"] < resume
        and any(o["step"] == r["step"] and o["time"] < r["time"] for o in recs)
    )
    out["halt_to_resume_s"] = round(resumed - boundary, 4)
    out["lost_s"] = round(resumed - boundary - step_s, 4)
    out["steps_redone"] = redone
    return out
