"""The PNGs of scripts/bench_scale.py: one log-log chart per metric against N (ranks), ftrun's
line(s) beside torch elastic's where torch has the same thing.

Owns: `METRICS` (file name, title, y label, and the lines: a label and the path of the value in
one JSON line of the benchmark) and `plot_all(lines, directory)`.
"""

from __future__ import annotations

import os

TORCH = "torch elastic c10d"

METRICS = (
    (
        "scale_rendezvous.png",
        "Job start: rendezvous of all nodes",
        "seconds",
        (
            ("ftrun: every agent has its world", ("start", "rendezvous_s")),
            ("ftrun: every rank has its world", ("start", "world_s")),
            (TORCH + ": every next_rendezvous() returned", ("torch", "rendezvous_s")),
        ),
    ),
    (
        "scale_steady_cpu.png",
        "Steady state: store CPU (heartbeats, liveness, feeds, progress)",
        "CPU seconds per second",
        (
            ("ftrun store process", ("steady", "store_cpu_per_s")),
            ("ftrun proxies (all nodes)", ("steady", "proxies_cpu_per_s")),
            (TORCH + " TCPStore master (keep-alives)", ("torch", "steady_store_cpu_per_s")),
        ),
    ),
    (
        "scale_steady_requests.png",
        "Steady state: store requests",
        "requests per second",
        (
            ("ftrun store", ("steady", "store_requests_per_s")),
            ("ftrun, per node (agent's breakdown)", ("steady", "requests_per_node_s", "total")),
        ),
    ),
    (
        "scale_kill_round.png",
        "One rank killed: the recovery round",
        "seconds from the kill",
        (
            ("plan published", ("kill", "to_plan_s")),
            ("fault posted -> plan (the controller)", ("kill", "fault_to_plan_s")),
            ("plan's fan-out to every node (the probe)", ("kill", "plan_fanout_s")),
            ("every agent holds the plan", ("kill", "to_all_agents_saw_plan_s")),
            ("last status posted -> repair plan written", ("kill", "status_to_repair_s")),
            ("every status collected", ("kill", "to_statuses_collected_s")),
            ("every rank resumed", ("kill", "to_all_resumed_s")),
            ("control-plane path (see docs/benchmarks.md)", ("kill", "control_path_s")),
            ("protocol path (plan fan-out on the wire)", ("kill", "protocol_path_s")),
            ("control-plane CPU (store+proxies+controller)", ("kill", "control_plane_cpu_s")),
        ),
    ),
    (
        "scale_kill_cost.png",
        "One rank killed: what the round cost the store",
        "requests / kilobytes",
        (
            ("store requests", ("kill", "requests")),
            ("kilobytes on the store's sockets", ("kill", "kbytes")),
        ),
    ),
    (
        "scale_node_round.png",
        "One node lost, a hot spare waiting (after the node is declared lost)",
        "seconds from the node declared lost",
        (
            ("plan published", ("node", "after_lost_to_plan_s")),
            ("every status collected", ("node", "after_lost_to_statuses_collected_s")),
            ("every rank resumed", ("node", "after_lost_to_all_resumed_s")),
        ),
    ),
)


def control_path(rnd: dict) -> float | None:
    """A round's control-plane path: death to every agent holding the plan, plus the last
    status posted to the repair plan written (the stretches between are the simulated
    agents' and ranks': Stop on the channel, the status written, the plan polled)."""
    parts = [
        rnd.get(k)
        for k in ("to_all_agents_saw_plan_s", "to_statuses_collected_s", "to_last_status_posted_s")
    ]
    if any(p is None for p in parts):
        return None
    return parts[0] + max(0.0, parts[1] - parts[2])


def value(line: dict, path: tuple[str, ...]) -> float | None:
    cur: object = line
    for k in path:
        if not isinstance(cur, dict):
            return None
        if k == "kbytes" and "bytes" in cur:
            cur = cur["bytes"] / 1000
            continue
        if k.startswith("after_lost_") and k not in cur:
            base, lost = cur.get(k.replace("after_lost_", "")), cur.get("to_node_declared_lost_s")
            cur = None if base is None or lost is None else base - lost
            continue
        if k == "control_path_s" and k not in cur:
            cur = control_path(cur)
            continue
        if k == "status_to_repair_s" and k not in cur:
            done, last = cur.get("to_statuses_collected_s"), cur.get("to_last_status_posted_s")
            cur = None if done is None or last is None else done - last
            continue
        cur = cur.get(k)
    return float(cur) if isinstance(cur, (int, float)) and cur > 0 else None


def plot_all(lines: list[dict], directory: str) -> list[str]:
    """One PNG per metric in `directory`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, title, ylabel, series in METRICS:
        fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=80)
        for label, path in series:
            pts = [(ln["ranks"], value(ln, path)) for ln in lines if "error" not in ln]
            pts = [(x, y) for x, y in pts if y is not None]
            if pts:
                style = "--" if path[0] == "torch" else "-"
                ax.plot(*zip(*pts), style, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks (N)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        fig.tight_layout()
        out = os.path.join(directory, name)
        fig.savefig(out)
        plt.close(fig)
        paths.append(out)
    return paths
