"""One simulated job of scripts/bench_scale.py: N ranks on N/per_node simulated nodes over one
real store, measured through its life.

Owns: `ScaleJob` — start (`start`: every agent's real rendezvous at once, then its proxy, feeds,
controller and ranks; the time until every rank has its world), `steady` (store requests/s and
the CPU of the store, the proxies, the agents and the simulated ranks over a quiet window),
`kill_rank` (one rank SIGKILLed: death → plan published → every status collected (repair plan
written) → every rank resumed, with the round's store requests and bytes and the controller's
CPU), `lose_node` (a node crashes with a hot spare waiting: death → node declared lost → plan →
statuses → resumed), `verdict` (every rank in the same generation with the same repair plan)
and `stop`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from scale_hosts import HostedNode, NodeHost
from scale_measure import (
    ProbeProcess,
    RequestCounts,
    StoreHost,
    cpu_delta,
    per_node_rates,
    process_cpu,
    read_events,
    thread_cpu,
    wait_until,
    wire_bytes,
)
from scale_nodes import SimNode
from scale_plots import control_path
from scale_priority import check_sim_nice, niced, process_nice, run_niced, thread_nices
from scale_ranks import RankLoop, RankRecord

from launcher.protocol import plan as P
from rendezvous.nodes.settings import RendezvousSettings
from rendezvous.store.client import StoreClient

threading.stack_size(512 * 1024)  # thousands of agent threads in one process
LEADER_HEAD_START = 0.5  # s: the leader process arrives first and takes node 0
# a simulation process this busy (share of one core) queues its own agents and ranks: the
# round's wall times are then the simulation's as much as the control plane's
SIM_BOUND_SHARE = 0.8
ROUND_LOOK_S = 0.02  # s between the benchmark's looks for a round's end


class ScaleJob:
    """A simulated job of `ranks` ranks, `per_node` per node (see the module docstring)."""

    def __init__(
        self,
        ranks: int,
        per_node: int,
        timeout: float = 600.0,
        rdzv: RendezvousSettings | None = None,
        sim_procs: int = 0,
        sim_nice: int = 0,
    ) -> None:
        if ranks % per_node:
            raise ValueError(f"ranks={ranks} is not a multiple of per_node={per_node}")
        self.nranks, self.per_node, self.timeout = ranks, per_node, timeout
        self.nnodes = ranks // per_node
        self.sim_procs = sim_procs  # processes the nodes besides the leader's are split over
        # how much lower than the control plane's the simulation's threads run (scale_priority)
        self.sim_nice = check_sim_nice(sim_nice)
        self.hosts: list[NodeHost] = []  # the leader's first
        self.dir = tempfile.mkdtemp(prefix="bench-scale-")
        self.events_path = os.path.join(self.dir, "events.jsonl")
        self.store = StoreHost()
        self.counts = RequestCounts()  # this process's agents' store requests
        self.loop = RankLoop()
        self.nodes: list[SimNode] = []
        self.spare: SimNode | None = None
        self.rdzv = rdzv or RendezvousSettings()  # ftrun's defaults
        self.run_id = f"scale{ranks}"
        self.generation = 0
        self.kv: StoreClient | None = None  # the benchmark's own reads (the verdict)

    # ---- the job's start ----------------------------------------------------------------
    def _node(self) -> SimNode:
        return SimNode(
            ("127.0.0.1", self.store.port),
            self.nnodes,
            self.per_node,
            self.run_id,
            self.loop,
            events_path=self.events_path,
            rdzv=self.rdzv,
            counts=self.counts,
        )

    def _hosts(self) -> list[NodeHost]:
        """The leader's process, then the simulation's (`sim_procs`; none: this process)."""
        conf = dict(store_port=self.store.port, nnodes=self.nnodes, per_node=self.per_node,
                    run_id=self.run_id, events=self.events_path,
                    rdzv=dataclasses.asdict(self.rdzv))  # fmt: skip
        leader = NodeHost(conf, 1)  # the inherited priority: the controller's is a machine's
        leader.join_start()
        time.sleep(LEADER_HEAD_START)
        rest, procs = self.nnodes - 1, min(self.sim_procs, self.nnodes - 1)
        counts = [rest // procs + (i < rest % procs) for i in range(procs)] if procs else []
        with ThreadPoolExecutor(max(1, procs)) as pool:  # their imports, in parallel
            hosts = list(pool.map(lambda c: NodeHost(conf, c, self.sim_nice), counts))
        return [leader] + hosts

    def start(self) -> dict:
        """Rendezvous of every node at once, then the ranks: the times until every agent has
        its node world and until every rank has its world."""
        self.store.start()
        run_niced(self.loop.start, self.sim_nice)  # this process's simulated ranks' thread
        self.kv = StoreClient("127.0.0.1", self.store.port, timeout=60.0)
        self.hosts = self._hosts()
        hosted = [n for h in self.hosts for n in h.nodes]
        local = [self._node() for _ in range(self.nnodes - len(hosted))]
        before = self.store.stats()
        t0 = time.time()
        for h in self.hosts[1:]:
            h.join_start()
        with ThreadPoolExecutor(max(1, len(local))) as pool:
            list(pool.map(niced(lambda n: n.join(self.timeout), self.sim_nice), local))
        for h in self.hosts:
            h.join_wait()
        leader = self.hosts[0].nodes[0]
        if leader.group_rank != 0:
            raise RuntimeError(f"the leader process holds node {leader.group_rank}, not 0")
        self.nodes = sorted(hosted + local, key=lambda n: n.group_rank)
        t_rdzv = max(n.joined_at for n in self.nodes)
        for h in self.hosts:
            h.start_all()
        run_niced(lambda: [n.start() for n in local], self.sim_nice)
        t_world = wait_until(self._all_started, self.timeout, "every rank's world")
        wait_until(self._all_aware, self.timeout, "every rank's hello")
        after = self.store.stats()
        return {
            "rendezvous_s": round(t_rdzv - t0, 4),
            "world_s": round(t_world - t0, 4),
            "requests": after["requests"] - before["requests"],
            "store_cpu_s": round(after["cpu_s"] - before["cpu_s"], 4),
        }

    def _all_started(self) -> bool:
        for n in self.nodes:
            s = n.summary()
            if s["n"] != self.per_node or not s["started"]:
                return False
        return True

    def _all_aware(self) -> bool:
        return all(n.summary()["idle"] for n in self.nodes)

    def priorities(self) -> dict:
        """The nice values things run at, as read back: the store process's threads (its loop
        raises its own while it serves few enough connections), the leader's process, each
        simulation process, and this process's simulated threads (none: no local nodes)."""
        local = [n for n in self.nodes if not isinstance(n, HostedNode)]
        loop_tid = self.loop.thread_id
        own = [os.getpriority(os.PRIO_PROCESS, loop_tid)] if local and loop_tid is not None else []
        return {
            "sim_nice": self.sim_nice,
            "store_threads": sorted(set(thread_nices(self.store.proc.pid))),
            "leader_process": process_nice(self.hosts[0].proc.pid),
            "sim_processes": [h.nice() for h in self.hosts[1:]] + own,
        }

    # ---- steady state -------------------------------------------------------------------
    def steady(self, seconds: float) -> dict:
        """A quiet window: heartbeats, liveness checks, feeds, progress and status records."""
        time.sleep(min(2.0, seconds))  # let the start-up's stragglers settle
        s0, c0, p0s, r0, t0 = (
            self.store.stats(),
            self._sim_cpu(),
            self._sim_processes_cpu(),
            self._requests(),
            time.time(),
        )
        time.sleep(seconds)
        s1, c1, p1s, r1, t1 = (
            self.store.stats(),
            self._sim_cpu(),
            self._sim_processes_cpu(),
            self._requests(),
            time.time(),
        )
        p0, p1 = sum(p0s), sum(p1s)
        dt = t1 - t0
        cpu = cpu_delta(c0, c1)
        return {
            **self._sim_bound(p0s, p1s, dt),
            "window_s": round(dt, 2),
            "store_requests_per_s": round((s1["requests"] - s0["requests"]) / dt, 1),
            "store_cpu_per_s": round((s1["cpu_s"] - s0["cpu_s"]) / dt, 5),
            "proxies_cpu_per_s": round(cpu["proxies"] / dt, 5),
            "agents_cpu_per_s": round(cpu["agents"] / dt, 5),
            "sim_ranks_cpu_per_s": round(cpu["ranks"] / dt, 5),
            "sim_process_cpu_per_s": round((p1 - p0) / dt, 4),
            "sim_procs": len(self.hosts) - 1,
            "requests_per_node_s": per_node_rates(r0, r1, len(self.nodes), dt),
        }

    def _requests(self) -> dict[str, int]:
        """Every simulated agent's store requests so far, by "source.op" (all processes)."""
        out = self.counts.snapshot()
        for h in self.hosts:
            for k, n in h.requests().items():
                out[k] = out.get(k, 0) + n
        return out

    def _sim_cpu(self) -> dict[str, float]:
        """Thread CPU by role of the simulation's processes (this one and its hosts but the
        leader's)."""
        out = thread_cpu()
        for h in self.hosts[1:]:
            for role, spent in h.cpu().items():
                out[role] = out.get(role, 0.0) + spent
        return out

    def _sim_processes_cpu(self) -> list[float]:
        """On-CPU seconds of each of the simulation's processes (this one, then its hosts)."""
        return [process_cpu(os.getpid())] + [h.process_cpu() for h in self.hosts[1:]]

    def _sim_process_cpu(self) -> float:
        return sum(self._sim_processes_cpu())

    def _sim_bound(self, before: list[float], after: list[float], wall: float) -> dict:
        """Where the simulation itself is the bottleneck: its busiest process's share of one
        core over `wall` s (one interpreter lock each: near 1, its agents' and ranks' threads
        queue for it) or all its processes' share of the machine's cores (near 1: they queue
        for the CPUs), and whether the machine had more runnable work than cores."""
        wall = max(wall, 1e-9)
        busiest = max((a - b) / wall for a, b in zip(after, before))
        machine = sum(a - b for a, b in zip(after, before)) / wall / (os.cpu_count() or 1)
        return {
            "sim_busiest_process_core_share": round(busiest, 3),
            "sim_machine_share": round(machine, 3),  # all its processes, of every core
            "sim_bound": busiest >= SIM_BOUND_SHARE or machine >= SIM_BOUND_SHARE,
            # more runnable work than cores: every process's wall times hold others' queueing
            "machine_saturated": os.getloadavg()[0] >= (os.cpu_count() or 1),
        }

    # ---- one rank killed ----------------------------------------------------------------
    def _round_window(self, act, done, what: str) -> dict:
        """Run `act()` at t0 and wait for `done()`; the round's store requests, bytes and CPU."""
        s0, b0, c0, l0 = self._readings()
        p0, t0 = self._sim_processes_cpu(), time.time()
        act()
        # every 20 ms: each look asks every host for its nodes' state, the leader's process too
        # (its interpreter is the controller's); the round's edges come from the events and
        # the ranks' records, not from this look
        t_end = wait_until(done, self.timeout, what, step=ROUND_LOOK_S)
        p1 = self._sim_processes_cpu()
        s1, b1, c1, l1 = self._readings()
        cpu = cpu_delta(c0, c1)
        for role, spent in cpu_delta(l0, l1).items():  # the leader process's threads
            cpu[role] = round(cpu.get(role, 0.0) + spent, 4)
        return {
            "t0": t0,
            "t_end": t_end,
            "requests": s1["requests"] - s0["requests"],
            "bytes": b1 - b0,
            "store_cpu_s": round(s1["cpu_s"] - s0["cpu_s"], 4),
            "controller_cpu_s": cpu["controller"],
            "proxies_cpu_s": cpu["proxies"],
            "sim_ranks_cpu_s": cpu["ranks"],
            "agents_cpu_s": cpu["agents"],
            **self._sim_bound(p0, p1, t_end - t0),
        }

    def _readings(self) -> tuple[dict, int, dict, dict]:
        """The store's counters, its sockets' bytes, the simulation's and the leader process's
        thread CPU by role."""
        leader = self.hosts[0].cpu()
        return self.store.stats(), wire_bytes(self.store.port), self._sim_cpu(), leader

    def _resumed_in(self, g: int) -> bool:
        for n in self.live_nodes():
            s = n.summary()
            if s["n"] != self.per_node or {tuple(x) for x in s["gens"]} != {(g, g)}:
                return False
        return True

    def live_nodes(self) -> list:
        return [n for n in self.nodes if not n.crashed]

    def records(self) -> list[RankRecord]:
        return [r for n in self.live_nodes() for r in n.records()]

    def _phases(self, g: int, t0: float, w: dict) -> dict:
        """Edges of round `g` from the controller's events and the ranks' records."""
        ev = read_events(self.events_path)
        plan_t = next(
            (e["time"] for e in ev if e["event"] == "plan" and e.get("generation") == g), 0
        )
        repair_t = next(
            (e["time"] for e in ev if e["event"] == "repair-plan" and e.get("generation") == g), 0
        )
        ranks = self.records()
        seen = [n.plans_seen.get(g, 0.0) for n in self.live_nodes()]
        out = {
            "to_plan_s": round(plan_t - t0, 4) if plan_t else None,
            "to_all_agents_saw_plan_s": round(max(seen) - t0, 4) if all(seen) else None,
            "to_last_status_posted_s": round(max(r.status_at for r in ranks) - t0, 4),
            "to_statuses_collected_s": round(repair_t - t0, 4) if repair_t else None,
            "to_all_resumed_s": round(max(r.resumed_at for r in ranks) - t0, 4),
        }
        path = control_path(out)
        out["control_path_s"] = None if path is None else round(path, 4)
        out.update({k: v for k, v in w.items() if k not in ("t0", "t_end")})
        out["round_requests_per_rank"] = round(w["requests"] / self.nranks, 2)
        out["control_plane_cpu_s"] = round(
            w["store_cpu_s"] + w["controller_cpu_s"] + w["proxies_cpu_s"], 4
        )
        return out

    def kill_rank(self) -> dict:
        """SIGKILL one rank of the last node (not the controller's)."""
        g = self.generation + 1
        node = self.nodes[-1]
        victim = max(node.ranks)
        probe = ProbeProcess(self.store.port, P.plan_key(g), self.nnodes)
        try:
            w = self._round_window(
                lambda: node.kill_rank(victim), lambda: self._resumed_in(g), f"round {g}"
            )
            fanout = probe.result()
        finally:
            probe.close()
        self.generation = g
        out = {"generation": g, "victim": victim, **self._phases(g, w["t0"], w)}
        return {**out, **self._protocol_path(g, w["t0"], out, fanout)}

    def _protocol_path(self, g: int, t0: float, phases: dict, fanout: dict) -> dict:
        """The round's path through the real control plane alone: death to the plan published
        (the simulated agent's report and the real controller), the plan published to every
        node holding it (the real store's fan-out, timed by `ProbeProcess`: one waiting
        connection per node, in a process of its own), and the last status posted to the
        repair plan written (the real relay and controller). `control_plane_path_s` leaves
        the simulated agents' report and relay hop out: fault posted -> plan, the fan-out,
        the last node's record -> the repair plan (`_relay_legs`)."""
        ev = read_events(self.events_path)
        plan_t = next(
            (e["time"] for e in ev if e["event"] == "plan" and e.get("generation") == g), 0
        )
        if not plan_t or fanout["nodes"] < self.nnodes:
            return {"plan_fanout_s": None, "protocol_path_s": None}
        spread = max(0.0, fanout["last_value"] - plan_t)
        done, last = phases["to_statuses_collected_s"], phases["to_last_status_posted_s"]
        path = None
        if phases["to_plan_s"] is not None and done is not None:
            path = phases["to_plan_s"] + spread + max(0.0, done - last)
        posted = [t for n in self.live_nodes() for t in n.summary()["faults_posted"] if t >= t0]
        fault_to_plan = plan_t - min(posted) if posted else None
        legs = self._relay_legs(g, t0, done, last)
        cp = (
            None
            if fault_to_plan is None or legs["relay_to_repair_s"] is None
            else fault_to_plan + spread + legs["relay_to_repair_s"]
        )
        return {
            **legs,
            # the legs only the store, the controller and the fan-out make (the simulated
            # agents' report and relay left out): fault posted -> plan, the plan's fan-out on
            # the wire, the last node's record -> the repair plan
            "control_plane_path_s": None if cp is None else round(cp, 4),
            # the plan's leg split: the simulated agent's (death seen, its report begun) and
            # the report's two requests with the real controller's (-> plan written)
            "to_fault_posted_s": round(min(posted) - t0, 4) if posted else None,
            "fault_to_plan_s": round(plan_t - min(posted), 4) if posted else None,
            "plan_fanout_s": round(spread, 4),
            "plan_fanout_first_s": round(max(0.0, fanout["first_wake"] - plan_t), 4),
            "status_to_repair_s": None if done is None else round(max(0.0, done - last), 4),
            "protocol_path_s": None if path is None else round(path, 4),
        }

    def _relay_legs(self, g: int, t0: float, done: float | None, last: float) -> dict:
        """The leg from the last status to the repair plan, split at the last node's record of
        round `g` (the agents' `StatusRelay` posts, stamped by their clients): the simulated
        agents' relay hop before it, the store and the controller after it (s from `t0`:
        `done` the repair plan, `last` the last rank's status)."""
        relayed = [n.summary()["relayed"].get(str(g)) for n in self.live_nodes()]
        last_relay = max(relayed) - t0 if relayed and all(relayed) else None
        if last_relay is None:
            return {"status_to_last_relay_s": None, "relay_to_repair_s": None}
        # a repair plan written before the last record came: the controller read that node's
        # statuses from its ranks' own keys (a late relay): its leg is not this one
        early = done is None or done < last_relay
        # a rank stamps its status once its coroutine runs again: its relay's record can be
        # stamped first; the controller's leg then starts at the later of the two
        start = max(last_relay, last)
        return {
            "status_to_last_relay_s": round(start - last, 4),
            "relay_to_repair_s": None if early else round(done - start, 4),
        }

    # ---- one node lost, a hot spare waiting ----------------------------------------------
    def lose_node(self) -> dict:
        """A hot spare joins and waits; the last node crashes; the spare takes its ranks."""
        spare = self.spare = self._node()
        joiner = threading.Thread(
            target=niced(spare.join, self.sim_nice), args=(self.timeout,), daemon=True
        )
        joiner.start()
        wait_until(self.nodes[1].spare_waiting, 60.0, "the spare waiting")
        victim = self.nodes[-1]

        def crash() -> None:
            victim.crash()

        def spare_in() -> bool:
            if spare.world is None or spare.started:
                return spare.started
            run_niced(lambda: spare.start(replacement=True), self.sim_nice)
            self.nodes[self.nodes.index(victim)] = spare
            return True

        g_before = self.generation
        w = self._round_window(
            crash,
            lambda: spare_in() and self._latest_resumed(g_before),
            "the spare's round",
        )
        joiner.join(1.0)
        g = self._latest_generation()
        self.generation = g
        ev = read_events(self.events_path)
        lost_t = next(
            (e["time"] for e in ev if e["event"] == "fault-reported" and e["time"] > w["t0"]), 0
        )
        out = {"generation": g, "lost_node": victim.group_rank, **self._phases(g, w["t0"], w)}
        out["to_node_declared_lost_s"] = round(lost_t - w["t0"], 4) if lost_t else None
        return out

    def _latest_generation(self) -> int:
        return max(g for n in self.live_nodes() for g, _ in n.summary()["gens"])

    def _latest_resumed(self, after: int) -> bool:
        g = self._latest_generation()
        return g > after and self._resumed_in(g)

    # ---- the verdict and the end ---------------------------------------------------------
    def verdict(self) -> dict:
        """Every rank in the same generation with the same repair plan, that generation the
        store's, and every rank on the world's node count."""
        ranks = self.records()
        gens = {r.generation for r in ranks}
        plans = {r.repair for r in ranks}
        store_g = int(self.kv.try_get(P.GENERATION_KEY) or b"0")
        return {
            "ranks": len(ranks),
            "generations": sorted(gens),
            "store_generation": store_g,
            "plans": len(plans),
            "errors": sorted({r.error for r in ranks if r.error}),
            "consistent": len(ranks) == self.nranks
            and gens == {store_g}
            and len(plans) == 1
            and b"" not in plans,
        }

    def stop(self) -> None:
        nodes = [n for n in self.nodes + ([self.spare] if self.spare else []) if n]
        with ThreadPoolExecutor(max(1, len(nodes) + len(self.hosts))) as pool:
            list(pool.map(lambda n: n.stop(), nodes + self.hosts))
        self.loop.stop()
        if self.kv is not None:
            self.kv.close()
        self.store.stop()
        shutil.rmtree(self.dir, ignore_errors=True)  # the controller's events.jsonl
