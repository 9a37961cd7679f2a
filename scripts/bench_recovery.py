#!/usr/bin/env python3
"""Benchmark: ftrun process-level recovery vs torchrun restart-all from a checkpoint.

Same model (about 170 MB of parameters + Adam state per rank with the defaults, --hidden 1424
--layers 9: the size issue 32's goals are stated at), 4 ranks, gloo on loopback, in the same run.
Rank 1 is killed with SIGKILL from outside after --kill-after-step completed steps and, under ftrun,
once its warm spares have finished importing torch (the steady state of a long job; the time they
took is `*spares_warm_after_s`; --no-wait-warm kills at the step regardless), at the end of the
next step every rank completes (every kill here lands at a step's end). torchrun
restarts every worker of a plain-torch script (bench_recovery_torchrun_worker.py), which reload
the checkpoint saved every 10 steps and recompute; ftrun restarts rank 1 of the same model on
launcher.runtime (bench_recovery_worker.py) and repairs it from a replica.

Reported (one JSON line):
  *_recover_s       time from the kill until every rank has completed the interrupted step,
                    i.e. progress is regained (torchrun's recomputed steps included);
  *_recomputed      steps completed before the kill and completed again after it;
  ftrun_overhead_s  from the kill until every rank resumed training (the recovery overhead; the
                    rest of ftrun_recover_s is resume_s, the interrupted step computed again), as
                    the agent logs it; ftrun_overhead_ranks_s by the ranks' own `repaired` edges;
  ftrun_phases      detect, decide, respawn (new process up and joined), stop (survivors out of
                    their collectives), rebuild (process groups), transfer (state to the
                    replacement), resume (first completed step after the repair);
  transfer_gbps vs raw_tcp_gbps: state transfer throughput against raw loopback TCP, measured
                    here in the same run; *_transfer_path: "memory" when the replacement read the
                    state straight from its replica's memory (same host), "wire" over gloo
                    (FTRUN_TRANSFER_LOCAL=0 in the environment measures the wire path).
With --kinds, one more JSON line per fault kind (injected inside the worker at a step), times
from the end of the step before the fault: detect_s (first report, or the hang detection),
resumed_s (every rank resumed training: the time to recover), recover_s (every rank completed
the interrupted step again), step_s (a fault-free step) and lost_s = recover_s - step_s.
With --churn, one more line: two SIGKILLs on one node (rank 1 once the spares are warm, rank 2
--churn-gap steps after the step the first one interrupted), each fault's lost_s and whether its
replacement came warm (--warm-spares N sets ftrun's spare count; 1 shows the old single-spare
behaviour).
--no-torchrun leaves torchrun out; --baseline-repo DIR runs DIR's ftrun (e.g. an export of main)
in the same run, keys prefixed base_ (churn rows: checkout "base"); --repeat N repeats the main
and churn rows, alternating which checkout goes first, and runs ftrun N times (separate jobs) in
each kill scenario row, whose figure is then the median run. *_replacement_path: the replacement's
edges (spawn, started, status, plan, rebuilt, registered, received, repaired) apart.
With --transfer-rows, two more lines, ftrun only: 4 ranks declared as dp=2 replica groups (rank 1's
state comes from one replica) and 6 ranks as dp=3 (from two replicas, striped), transfer_gbps
against raw_tcp_gbps each.
With --scenarios, one line per scenario (scripts/bench_recovery_scenarios.py says what they
measure): the native loop, `rt.ddp` and megatron-core callbacks, each killed at step 1, once
the spares are ready or during a recovery, against torchrun restart-all of the same script;
`native:shrink`: a live shrink (elastic-training) and, once it exists, the live grow back, each
one's time lost (scripts/bench_recovery_shrink.py).
Sets up the /etc/hosts line `::ffff:127.0.0.1 localhost-v4mapped` first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_recovery_probe import read_steps, warm_spares  # noqa: E402
from bench_recovery_scenarios import parse_scenarios, print_scenarios  # noqa: E402
from hosts_setup import ensure_hosts_line  # noqa: E402  (scripts/ is sys.path[0])

from launcher.observe.logs import read_events as events  # noqa: E402  (the repo, not only an install)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = {
    "ftrun": os.path.join(REPO, "scripts", "bench_recovery_worker.py"),
    "torchrun": os.path.join(REPO, "scripts", "bench_recovery_torchrun_worker.py"),
}
LAUNCHERS = {
    "ftrun": [sys.executable, "-m", "launcher"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}


def raw_tcp_gbps(nbytes: int = 100 << 20, repeat: int = 3) -> float:
    """Loopback TCP throughput between two threads (sendall / recv_into), best of `repeat`."""
    best = 0.0
    payload = bytearray(nbytes)
    for _ in range(repeat):
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        buf = bytearray(nbytes)

        def recv(conn: socket.socket) -> None:
            view, got = memoryview(buf), 0
            while got < nbytes:
                got += conn.recv_into(view[got:])

        cli = socket.create_connection(srv.getsockname())
        conn, _ = srv.accept()
        t = threading.Thread(target=recv, args=(conn,))
        t0 = time.perf_counter()
        t.start()
        cli.sendall(payload)
        t.join()
        dt = time.perf_counter() - t0
        best = max(best, nbytes / dt / 1e9)
        for s in (cli, conn, srv):
            s.close()
    return best


def run_job(
    name: str,
    args: argparse.Namespace,
    fault_plan: str | None = None,
    hang_timeout: float = 0.0,
    extra_args: list[str] | None = None,
    nproc: int = 4,
    worker_args: list[str] | None = None,
    repo: str = REPO,
    kills: list[tuple[int, int]] | None = None,
) -> dict:
    """One job of launcher `name` ("ftrun"/"torchrun"); `repo`: the checkout whose launcher,
    runtime and worker script run (another one for a before/after comparison in one run). The
    job's checkpoints are always removed afterwards (a 1 GB state writes ~8 GB of them); its
    logs too, unless the job failed or --keep-logs is given."""
    out = tempfile.mkdtemp(prefix=f"bench_recovery_{name}_")
    try:
        job = _run_job(
            out, name, args, fault_plan, hang_timeout, extra_args, nproc, worker_args, repo, kills
        )
    finally:
        shutil.rmtree(os.path.join(out, "ckpt"), ignore_errors=True)
    if getattr(args, "keep_logs", False):
        print(f"[bench_recovery] {name} run kept in {out}", file=sys.stderr, flush=True)
    else:
        shutil.rmtree(out, ignore_errors=True)
    return job


def _run_job(
    out: str,
    name: str,
    args: argparse.Namespace,
    fault_plan: str | None,
    hang_timeout: float,
    extra_args: list[str] | None,
    nproc: int,
    worker_args: list[str] | None,
    repo: str,
    kills: list[tuple[int, int]] | None,
) -> dict:
    env = dict(
        os.environ, OUT_DIR=out, PYTHONPATH=repo, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo"
    )
    if fault_plan:
        env["FTRUN_FAULT_PLAN"] = fault_plan
    cmd = LAUNCHERS[name] + [
        "--nproc_per_node",
        str(nproc),
        "--max_restarts",
        "3",
        "--log_dir",
        os.path.join(out, "logs"),
    ]
    if (
        name == "ftrun" and hang_timeout
    ):  # only where a hang is injected: a slow first step is no hang
        cmd += ["--hang_timeout", str(hang_timeout)]
    cmd += extra_args or []
    worker = os.path.join(repo, os.path.relpath(WORKERS[name], REPO))
    cmd += [
        worker,
        "--steps",
        str(args.steps),
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--checkpoint-dir",
        os.path.join(out, "ckpt"),
        "--checkpoint-every",
        "10",
    ] + (worker_args or [])
    stderr_path = os.path.join(out, "stderr.txt")
    # external SIGKILLs (no fault plan): (rank, gap) -- the first once every rank completed
    # --kill-after-step (and the warm spares are warm), each next one once every rank completed
    # `gap` more steps than the step the previous kill interrupted
    kills = list(kills or [(1, 0)]) if fault_plan is None else []
    kill_times: list[float] = []
    killed_steps: list[int] = []
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, cwd=repo)
        warm_at = None
        warm_floor = 0  # the first kill waits for a step completed after the spares were warm
        t_start = time.time()
        deadline = time.monotonic() + args.timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if len(kill_times) < len(kills):
                steps = read_steps(out)
                if warm_at is None and name == "ftrun" and args.wait_warm:
                    if warm_spares(proc.pid) is not None:
                        warm_at = time.time()
                        # then kill at the end of a step, as every other kill here (at a random
                        # point of a step the lost time also holds the part done before the kill)
                        warm_floor = 1 + max(
                            (s[-1]["step"] for s in steps.values() if s), default=-1
                        )
                    else:
                        time.sleep(0.05)
                        continue
                rank, gap = kills[len(kill_times)]
                need = (
                    killed_steps[-1] + gap
                    if killed_steps
                    else max(args.kill_after_step, warm_floor)
                )
                if len(steps) == nproc and all(s and s[-1]["step"] >= need for s in steps.values()):
                    victim = steps[rank][-1]
                    killed_steps.append(victim["step"] + 1)
                    kill_times.append(time.time())
                    os.kill(victim["pid"], signal.SIGKILL)
            time.sleep(0.002)
        if proc.poll() is None:
            proc.kill()
            raise RuntimeError(f"{name}: job did not finish within {args.timeout}s (logs in {out})")
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: job failed ({proc.returncode}); see {stderr_path}")
    with open(stderr_path, encoding="utf-8", errors="replace") as f:
        stderr = f.read()
    if len(kill_times) < len(kills):
        raise RuntimeError(
            f"{name}: the job ended before kill {len(kill_times) + 1} (spares warm: "
            f"{warm_at is not None}; logs in {out}); use more --steps"
        )
    ev = events(os.path.join(out, "logs"))
    if name == "ftrun":
        # the step the kill interrupted is the round's resume step: the victim may have
        # committed the step after its last logged one before the SIGKILL landed
        for i, t in enumerate(kill_times):
            plan = next((e for e in ev if e["event"] == "repair-plan" and e["time"] >= t), None)
            if plan is not None and plan.get("resume_step") is not None:
                killed_steps[i] = plan["resume_step"]
    return {
        "out": out,
        "kill_time": kill_times[0] if kill_times else None,
        "killed_step": killed_steps[0] if killed_steps else None,
        "kill_times": kill_times,
        "killed_steps": killed_steps,
        "stderr": stderr,
        "spares_warm_after_s": round(warm_at - t_start, 2) if warm_at else None,
        "steps": read_steps(out),
        "events": ev,
    }


def regained(job: dict, since: float, step: int) -> tuple[float, int]:
    """(time when every rank completed `step` after `since`, steps rank 0 recomputed)."""
    done = []
    for recs in job["steps"].values():
        times = [r["time"] for r in recs if r["step"] == step and r["time"] >= since]
        if not times:  # completed before the fault (e.g. committed by survivors)
            times = [r["time"] for r in recs if r["step"] == step]
        done.append(min(times))
    seen: dict[int, int] = {}
    for r in job["steps"][0]:
        seen[r["step"]] = seen.get(r["step"], 0) + 1
    return max(done), sum(1 for c in seen.values() if c > 1)


def ftrun_phases(job: dict, t_fault: float) -> dict:
    ev = job["events"]

    def first(kind: str, **match: object) -> dict | None:
        for e in ev:
            if (
                e["event"] == kind
                and all(e.get(k) == v for k, v in match.items())
                and e["time"] >= t_fault - 1
            ):
                return e
        return None

    failed = first("worker-failed") or first("worker-fault")
    plan = first("plan")
    phases: dict[str, float] = {}
    if failed:
        phases["detect_s"] = failed["time"] - t_fault
    if failed and plan:
        phases["decide_s"] = plan["time"] - failed["time"]
    rec = [e for e in ev if e["event"] == "rank-recovered"]
    repl = [e for e in rec if e.get("replacement")]
    surv = [e for e in rec if not e.get("replacement")]
    spawn = first("spawn", replacement=True)
    if spawn:
        hello = next(
            (
                e
                for e in ev
                if e["event"] == "hello"
                and e["rank"] == spawn["rank"]
                and e["time"] >= spawn["time"]
            ),
            None,
        )
        if hello and plan:
            phases["respawn_s"] = hello["time"] - plan["time"]
    if surv:
        phases["stop_s"] = max(e.get("stop_s", 0.0) for e in surv)
        phases["rebuild_s"] = max(e.get("rebuild_s", 0.0) for e in surv)
    if repl:
        phases["transfer_s"] = max(e.get("repair_s", 0.0) for e in repl)
    elif surv:
        phases["transfer_s"] = max(e.get("repair_s", 0.0) for e in surv)
    return {k: round(v, 4) for k, v in phases.items()}, (
        max(e["time"] for e in rec) if rec else None
    )


# the replacement's log line (before the same-host path: no "(path)" after the ranks)
RECEIVED = r"received state from rank ([\d,]+)(?: \(([\w+]+)\))?:"


def transfer_path(stderr: str) -> str | None:
    """How the state came: "wire", "memory" (same host) or "memory+wire"; None if not logged."""
    m = re.search(RECEIVED, stderr)
    return (m.group(2) or "wire") if m else None


def transfer_gbps(stderr: str) -> float | None:
    m = re.findall(RECEIVED + r" ([\d.]+) MB in \d+ tensors, ([\d.]+) s", stderr)
    if not m:
        return None
    mb, s = max((float(a), float(b)) for _, _, a, b in m)
    return mb / 1e3 / s if s > 0 else None


def replacement_path(job: dict, t_fault: float) -> dict:
    """The replacement's own path, edge to edge (s): spawn (the agent hands it a spare) ->
    started (its runtime exists) -> status (posted) -> plan (the controller's plan read) ->
    rebuilt (groups built) -> registered (the script built model + optimizer) -> received (state
    in) -> repaired (every rank past the end-of-transfer barrier)."""
    ev = job["events"]
    spawn = next(
        (
            e
            for e in ev
            if e["event"] == "spawn" and e.get("replacement") and e["time"] >= t_fault - 1
        ),
        None,
    )
    rec = next(
        (
            e
            for e in ev
            if e["event"] == "rank-recovered" and e.get("replacement") and e["time"] >= t_fault - 1
        ),
        None,
    )
    if spawn is None or rec is None:
        return {}
    edges = [("spawn", spawn["time"])] + sorted(
        ((k, v) for k, v in (rec.get("marks") or {}).items()), key=lambda kv: kv[1]
    )
    return {f"{a}->{b}": round(tb - ta, 4) for (a, ta), (b, tb) in zip(edges, edges[1:])}


def ftrun_row(job: dict, res: dict, prefix: str) -> None:
    """The ftrun job's numbers into `res`, keys starting with `prefix`."""
    t_rec, recomputed = regained(job, job["kill_time"], job["killed_step"])
    res[f"{prefix}_recover_s"] = round(t_rec - job["kill_time"], 3)
    res[f"{prefix}_recomputed"] = recomputed
    phases, last_rec = ftrun_phases(job, job["kill_time"])
    if last_rec is not None:
        phases["resume_s"] = round(t_rec - last_rec, 4)
        # the recovery overhead: from the kill until every rank resumed training (what
        # follows, resume_s, is the interrupted step computed again)
        res[f"{prefix}_overhead_s"] = round(last_rec - job["kill_time"], 4)
    # the same, by the ranks' own clocks: the last rank's `repaired` edge (the agent logs its
    # `rank-recovered` a message later)
    repaired = [
        e["marks"]["repaired"]
        for e in job["events"]
        if e["event"] == "rank-recovered"
        and e["time"] >= job["kill_time"]
        and "repaired" in (e.get("marks") or {})
    ]
    if repaired:
        res[f"{prefix}_overhead_ranks_s"] = round(max(repaired) - job["kill_time"], 4)
    res[f"{prefix}_phases"] = phases
    res[f"{prefix}_replacement_path"] = replacement_path(job, job["kill_time"])
    res[f"{prefix}_spares_warm_after_s"] = job["spares_warm_after_s"]
    gbps = transfer_gbps(job["stderr"])
    res[f"{prefix}_transfer_gbps"] = round(gbps, 3) if gbps else None
    m = re.search(RECEIVED + r" ([\d.]+) MB", job["stderr"])
    res[f"{prefix}_state_mb"] = float(m.group(3)) if m else None
    res[f"{prefix}_transfer_path"] = transfer_path(job["stderr"])


def compare(args: argparse.Namespace, tcp: float) -> dict:
    res: dict = {"bench": "recovery", "ranks": 4, "hidden": args.hidden, "layers": args.layers}
    if args.torchrun:
        job = run_job("torchrun", args)
        t_rec, recomputed = regained(job, job["kill_time"], job["killed_step"])
        res["torchrun_recover_s"] = round(t_rec - job["kill_time"], 3)
        res["torchrun_recomputed"] = recomputed
        res["torchrun_killed_step"] = job["killed_step"]
    # with --baseline-repo, that checkout's ftrun runs too (same run; order alternates by --repeat)
    variants = [("ftrun", REPO)] + ([("base", args.baseline_repo)] if args.baseline_repo else [])
    if args.round % 2:
        variants.reverse()
    for prefix, repo in variants:
        job = run_job("ftrun", args, repo=repo)
        ftrun_row(job, res, prefix)
        res[f"{prefix}_killed_step"] = job["killed_step"]
    res["state_mb"] = res.get("ftrun_state_mb")
    res["transfer_gbps"] = res.get("ftrun_transfer_gbps")
    res["raw_tcp_gbps"] = round(tcp, 3)
    if res.get("transfer_gbps"):
        res["transfer_vs_tcp"] = round(res["transfer_gbps"] / tcp, 3)
    if args.baseline_repo:
        res["baseline_repo"] = args.baseline_repo
    if "torchrun_recover_s" in res:
        res["ratio_ftrun_vs_torchrun"] = round(
            res["ftrun_recover_s"] / res["torchrun_recover_s"], 3
        )
    return res


def kind_row(kind: str, args: argparse.Namespace) -> dict:
    step = args.kill_after_step + 1
    plan = json.dumps([{"rank": 1, "step": step, "phase": "forward", "kind": kind}])
    job = run_job(
        "ftrun", args, fault_plan=plan, hang_timeout=args.hang_timeout if kind == "hang" else 0.0
    )
    ev = job["events"]
    fired = next((e for e in ev if e["event"] in ("worker-failed", "worker-fault")), None)
    hang = next((e for e in ev if e["event"] == "hang"), None)
    # the fault fired when rank 0 had finished step-1; the first report is the detection
    t_prev = max(r["time"] for r in job["steps"][1] if r["step"] == step - 1)
    t_rec, recomputed = regained(job, t_prev, step)
    pids = {r: len({x["pid"] for x in recs}) for r, recs in job["steps"].items()}
    strategy = next((e["strategy"] for e in ev if e["event"] == "plan"), None)
    resumed = [e["time"] for e in ev if e["event"] == "rank-recovered" and e["time"] >= t_prev]
    before = sorted(r["time"] for r in job["steps"][0] if r["step"] < step)
    gaps = sorted(b - a for a, b in zip(before, before[1:]))
    step_s = gaps[len(gaps) // 2] if gaps else 0.0
    return {
        "bench": "recovery-kind",
        "kind": kind,
        "strategy": strategy,
        "detect_s": round((hang or fired)["time"] - t_prev, 4) if (hang or fired) else None,
        "resumed_s": round(max(resumed) - t_prev, 3) if resumed else None,
        "recover_s": round(t_rec - t_prev, 3),
        "step_s": round(step_s, 3),
        "lost_s": round(t_rec - t_prev - step_s, 3),
        "recomputed": recomputed,
        "processes_restarted": sum(n - 1 for n in pids.values()),
    }


def churn_row(args: argparse.Namespace, repo: str = REPO) -> dict:
    """Two kills on one node, the second soon after the first recovery: does the second one
    still get a warm replacement, and does it lose as little time as the first? External
    SIGKILLs: rank 1 once the warm spares are warm, rank 2 --churn-gap steps later."""
    # no periodic checkpoint here: with one every 10 steps the second kill (step ~20) came right
    # after the checkpoint of iteration 20, whose write and writeback slowed that step for
    # reasons unrelated to the spares (both checkouts, ~0.3 s)
    job = run_job(
        "ftrun",
        args,
        extra_args=["--warm-spares", str(args.warm_spares)],
        repo=repo,
        kills=[(1, 0), (2, args.churn_gap)],
        worker_args=[] if args.churn_checkpoints else ["--checkpoint-every", "0"],
    )
    ev = job["events"]
    first = job["killed_steps"][0]
    before = sorted(r["time"] for r in job["steps"][0] if r["step"] < first)
    gaps = sorted(b - a for a, b in zip(before, before[1:]))
    step_s = gaps[len(gaps) // 2] if gaps else 0.0
    spawns = [e for e in ev if e["event"] == "spawn" and e.get("replacement")]
    lost = []
    for t_kill, step in zip(job["kill_times"], job["killed_steps"]):
        # from the end of the victim's step before the kill, as the per-kind rows
        # (every rank that logged it: a victim may die between its commit and its log line)
        t_prev = max(
            min(r["time"] for r in recs if r["step"] == step - 1)
            for recs in job["steps"].values()
            if any(r["step"] == step - 1 for r in recs)
        )
        t_rec, _ = regained(job, t_kill, step)
        lost.append(round(t_rec - t_prev - step_s, 3))
    return {
        "bench": "recovery-churn",
        "warm_spares": args.warm_spares,
        "gap_steps": args.churn_gap,
        "step_s": round(step_s, 3),
        "first_lost_s": lost[0],
        "second_lost_s": lost[1],
        "first_warm": bool(spawns and spawns[0].get("warm")),
        "second_warm": bool(len(spawns) > 1 and spawns[1].get("warm")),
        "spares_warm_after_s": job["spares_warm_after_s"],
        "strategies": [e["strategy"] for e in ev if e["event"] == "plan"],
    }


def transfer_row(args: argparse.Namespace, nproc: int, dp: int, tcp: float) -> dict:
    """ftrun only, `nproc` ranks declared as `dp`-way replica groups (rank r replicates
    r +- k*nproc/dp): rank 1 is killed and receives its state from its dp-1 healthy replicas
    (striped when >= 2)."""
    shards = nproc // dp
    groups = [[r for r in range(nproc) if r % shards == i] for i in range(shards)]
    job = run_job("ftrun", args, nproc=nproc, worker_args=["--replica-groups", json.dumps(groups)])
    phases, _ = ftrun_phases(job, job["kill_time"])
    gbps = transfer_gbps(job["stderr"])
    m = re.search(RECEIVED + r" ([\d.]+) MB", job["stderr"])
    return {
        "bench": "transfer",
        "ranks": nproc,
        "dp": dp,
        "replica_groups": groups,
        "sources": [int(x) for x in m.group(1).split(",")] if m else None,
        "state_mb": float(m.group(3)) if m else None,
        "transfer_path": transfer_path(job["stderr"]),
        "transfer_gbps": round(gbps, 3) if gbps else None,
        "raw_tcp_gbps": round(tcp, 3),
        "transfer_vs_tcp": round(gbps / tcp, 3) if gbps else None,
        "ftrun_phases": phases,
        "spares_warm_after_s": job["spares_warm_after_s"],
    }


def pick_rows(text: str) -> tuple[bool, list]:
    """--scenarios: (whether the main row runs, the scenario rows); exits 2 on a bad item."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        return True, []
    rest = [t for t in items if t != "main"]
    try:
        return "main" in items or items == ["all"], parse_scenarios(",".join(rest)) if rest else []
    except ValueError as exc:
        print(f"bench_recovery: {exc}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill-after-step", type=int, default=15)
    # 1424 x 9 layers: 171.6 MB of parameters + Adam moments per rank, issue 32's "~170 MB"
    ap.add_argument("--hidden", type=int, default=1424)
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--hang-timeout", type=float, default=2.0)
    ap.add_argument(
        "--kinds",
        default="",
        help="comma list of fault kinds for per-kind rows "
        "(kill,segv,exit,exception,hang,uce-low,uce-high,network)",
    )
    ap.add_argument("--no-compare", action="store_true", help="only the per-kind rows")
    ap.add_argument(
        "--churn",
        action="store_true",
        help="one more row: two kills in a row on one "
        "node (ranks 1 then 2, --churn-gap steps apart), lost time of each",
    )
    ap.add_argument("--churn-gap", type=int, default=3)
    ap.add_argument(
        "--churn-checkpoints",
        action="store_true",
        help="keep the periodic checkpoint "
        "(every 10 steps) in the churn row (default off: it lands next to the second kill)",
    )
    ap.add_argument("--warm-spares", type=int, default=2, help="ftrun's --warm-spares for --churn")
    ap.add_argument(
        "--no-wait-warm",
        dest="wait_warm",
        action="store_false",
        help="kill at --kill-after-step even while ftrun's warm spares are still importing "
        "torch (default: wait until they are warm, the steady state of a long job)",
    )
    ap.add_argument(
        "--transfer-rows",
        action="store_true",
        help="two more rows, ftrun only: 4 ranks "
        "as dp=2 replica groups (one source) and 6 ranks as dp=3 (two sources, striped)",
    )
    ap.add_argument(
        "--no-torchrun",
        dest="torchrun",
        action="store_false",
        help="leave torchrun's restart-all out of the main row (ftrun only)",
    )
    ap.add_argument(
        "--baseline-repo",
        default="",
        help="another checkout (e.g. main's) whose ftrun "
        "runs in the main row too, keys prefixed base_ (a before/after in one run)",
    )
    ap.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep each job's run directory (logs, "
        "events, step files; checkpoints are removed either way) and print its path",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="main and churn rows to run (baseline and this checkout alternate which goes "
        "first); in the scenario rows step1, warm and during-recovery: ftrun jobs per scenario "
        "(the row reports the median run, every run's overhead_s and lost_s, and judges the goal "
        "on the median; torchrun runs once)",
    )
    ap.add_argument(
        "--scenarios",
        default="",
        help="scenario rows, ftrun against torchrun restart-all of the same script: all (the "
        "main row and every path at step1 and warm, native also during-recovery and shrink), or "
        "a comma list of main and PATH:POINT, PATH native|ddp|megatron, POINT "
        "step1|warm|during-recovery|shrink (shrink: native only, a live shrink by "
        "elastic-training) (default: the main row only)",
    )
    ap.add_argument(
        "--megatron-hidden", type=int, default=1088, help="megatron scenarios: GPT hidden size"
    )
    ap.add_argument("--megatron-layers", type=int, default=2, help="megatron: GPT layers")
    ap.add_argument(
        "--megatron-steps", type=int, default=0, help="megatron: steps per job (0: --steps)"
    )
    ap.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        help="scenario rows: seconds every step sleeps besides its work (long enough jobs at "
        "tiny sizes for the spares to get ready)",
    )
    args = ap.parse_args()
    main_row, scenarios = pick_rows(args.scenarios)
    if args.baseline_repo and not os.path.isfile(
        os.path.join(args.baseline_repo, "launcher", "agent.py")
    ):
        sys.exit(
            f"bench_recovery: --baseline-repo {args.baseline_repo} holds no launcher/agent/agent.py"
        )
    if args.repeat < 1:
        sys.exit(f"bench_recovery: --repeat {args.repeat} must be >= 1")
    hosts = ensure_hosts_line()
    failed = bool(scenarios) and not print_scenarios(args, scenarios)
    if main_row and not args.no_compare:
        tcp = raw_tcp_gbps()
        for args.round in range(args.repeat):
            row = compare(args, tcp)
            row["hosts_line"] = hosts
            print(json.dumps(row), flush=True)
    for kind in [k for k in args.kinds.split(",") if k]:
        print(json.dumps(kind_row(kind, args)), flush=True)
    if args.churn:
        for i in range(args.repeat):
            runs = [("this", REPO)] + ([("base", args.baseline_repo)] if args.baseline_repo else [])
            for label, repo in runs if i % 2 == 0 else runs[::-1]:
                print(json.dumps(dict(churn_row(args, repo), checkout=label)), flush=True)
    if args.transfer_rows:
        tcp = raw_tcp_gbps()
        for nproc, dp in ((4, 2), (6, 3)):
            print(json.dumps(transfer_row(args, nproc, dp, tcp)), flush=True)
    if failed:
        sys.exit("bench_recovery: a scenario failed (its row says why)")


if __name__ == "__main__":
    main()
