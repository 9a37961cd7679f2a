"""The recovery round a stop starts, from this rank's side: executing the controller's plan.

Owns: `RecoveryRound`: stop the device and tear the old groups down, post this rank's
RankStatus, wait for the controller's RepairPlan (a fallback plan ends the process, after the
dying-gasp dump when asked), rebuild the groups for the new generation, restore the step-start
state or send/receive the full state along the plan's pairs, post resumed; the round's timings
and edges for the agent; a replacement's joining of the round it was started for.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from launcher.protocol import plan as P
from launcher.protocol.messages import Recovered
from launcher.runtime import heap
from launcher.runtime.checkpoints import Checkpoints
from launcher.runtime.collectives import Interruptible
from launcher.runtime.devices import DeviceAdapter
from launcher.runtime.faultplan import FaultInjector
from launcher.runtime.rank_state import RankLinks, RankState
from launcher.runtime.signals import StopRequested
from launcher.runtime.skip_init import InitWindow
from launcher.runtime.state import Snapshot
from launcher.runtime.step_path import StepPath
from launcher.runtime.transfer import recv_state, send_state
from launcher.runtime.world import World


def _start_marks(env: Any) -> dict[str, float]:
    """A replacement's start-up marks (see `RecoveryRound.__init__`)."""
    now = round(time.time(), 4)
    marks = {"imported": now, "started": now}
    if env.exec_time is not None:
        marks = {"exec": min(float(env.exec_time), now), **marks}
    return marks


class RecoveryRound:
    """This rank's recovery rounds; `recover()` runs them until one completes."""

    def __init__(
        self,
        state: RankState,
        links: RankLinks,
        world: World,
        coll: Interruptible,
        adapter: DeviceAdapter,
        injector: FaultInjector,
        path: StepPath,
        checkpoints: Checkpoints,
    ) -> None:
        self.state = state
        self.links = links
        self.world = world
        self.coll = coll
        self.adapter = adapter
        self.injector = injector
        self.path = path
        self.checkpoints = checkpoints
        self.last_recovery: dict[str, float] = {}
        self.last_plan: P.RepairPlan | None = None  # the plan of the latest completed round
        self.pending_plan: P.RepairPlan | None = None  # a replacement's, run at its first step
        # the rank's random init, skipped by a replacement when its rank's first start found
        # that harmless (skip_init); opened at start, closed at the first step
        self.init_window = InitWindow(links)
        self._t_created = time.monotonic()
        # wall-clock edges of the current recovery round (sent with "recovered"; events.jsonl
        # `rank-recovered.marks`, drawn by `ftctl report`) and the state bytes moved in it. A
        # replacement's start-up first: `exec` (its process began running the user's code: a
        # cold one's interpreter start, a warm spare's assignment), `imported` (the script's
        # imports done: its first call into the runtime, i.e. now) and `started` (the same)
        self._marks: dict[str, float] = _start_marks(links.env) if links.env.replacement else {}
        self._moved: dict[str, Any] = {"transfer_bytes": 0, "transfer_s": 0.0}

    # ---------------------------------------------------------------- a stop's rounds
    def recover(self) -> int:
        """Run recovery rounds until one completes; returns the step to resume at."""
        t_stop = time.monotonic()
        self.mark("stopped")
        self._await_stop()
        while True:
            target = self.links.stop.target
            self.links.log(f"recovery round for generation {target} starts")
            self.adapter.stop_device()
            self.world.teardown()
            self.adapter.restart_device()
            try:
                plan, times = self._round(target)
            except StopRequested as exc:
                self.links.log(f"recovery round interrupted: {exc}")
                continue
            except Exception as exc:  # noqa: BLE001 - a newer stop explains most failures
                if self.links.stop.wait_newer(target, self.links.options.network_grace):
                    self.links.log(
                        f"recovery round failed ({exc}); a newer generation was requested"
                    )
                    continue
                raise
            return self._recovered(plan, target, t_stop, times)

    def _await_stop(self) -> None:
        """A fault (not a stop) interrupted the step: wait for the agent's stop; without one,
        raise the fault."""
        state, links = self.state, self.links
        if not links.stop.newer_than(state.generation):
            timeout = links.env.store_timeout
            links.log(f"waiting up to {timeout:.0f} s for the agent's stop after the fault")
            if not links.stop.wait_newer(state.generation, timeout):
                exc = state.pending_exc or RuntimeError("recovery requested but no stop arrived")
                raise exc
        state.pending_exc = None

    def _round(self, target: int) -> tuple[P.RepairPlan, list[float]]:
        """One round into generation `target`: the plan, and the monotonic times of its edges
        (start, plan, rebuilt, repaired)."""
        t0 = time.monotonic()
        size = self.world.elastic.size
        plan = self.join(target)
        t1 = time.monotonic()
        self.injector.maybe_fire(target, plan.resume_step, "rebuild")
        self.world.build(target, rebuild_groups=True)
        if self.world.elastic.size != size:  # a live shrink (elastic-training)
            self.world.elastic.resized(size)
        self.mark("rebuilt")
        t2 = time.monotonic()
        self.execute(plan)
        return plan, [t0, t1, t2, time.monotonic()]

    def _recovered(self, plan: P.RepairPlan, target: int, t_stop: float, times: list[float]) -> int:
        """Tell the agent the round completed; the resume step."""
        t0, t1, t2, t3 = times
        resume = plan.resume_step
        self.last_recovery = {
            "stop_s": t0 - t_stop,
            "plan_wait_s": t1 - t0,
            "rebuild_s": t2 - t1,
            "repair_s": t3 - t2,
            "total_s": t3 - t_stop,
        }
        self._send_recovered(plan, target, replacement=False)
        self.links.log(
            f"recovered into generation {target}: resume at step {resume} "
            f"(plan wait {t1 - t0:.3f} s, rebuild {t2 - t1:.3f} s, repair {t3 - t2:.3f} s)"
        )
        return resume

    def _send_recovered(self, plan: P.RepairPlan, generation: int, replacement: bool) -> None:
        if self.links.channel is None:
            return
        timings = {k: round(v, 4) for k, v in self.last_recovery.items()}
        self.links.channel.send(
            Recovered(
                self.links.rank,
                generation,
                plan.resume_step,
                plan.action,
                replacement=replacement,
                timings=timings,
                **self._take_marks(),
            )
        )

    # ---------------------------------------------------------------- a replacement
    def join_as_replacement(self) -> None:
        """(at start) Join the round this replacement was started for (or a newer one) and
        build its groups; the plan runs at the first step (`resume_replacement`). A round
        superseded before its groups were built (another rank failed meanwhile, maybe one this
        build waited for) is left for the newer one, until one builds."""
        state, links = self.state, self.links
        links.log(f"replacement for rank {links.rank}: joining generation {state.generation}")
        while True:
            try:
                self.pending_plan = self.join(state.generation)
                self.world.build(state.generation, rebuild_groups=False)
                break
            except StopRequested:
                links.log(
                    f"generation {state.generation} superseded before it completed; joining "
                    f"generation {links.stop.target}"
                )
            except Exception as exc:  # noqa: BLE001 - a newer stop explains most failures
                if not links.stop.wait_newer(state.generation, links.options.network_grace):
                    raise
                links.log(
                    f"building generation {state.generation}'s groups failed ({exc}); "
                    f"generation {links.stop.target} was requested meanwhile: joining it"
                )
            state.generation = links.stop.target
        self.mark("rebuilt")
        self.init_window.open(replacement=True)  # closed before the received state is applied

    def resume_replacement(self) -> int:
        """(at the first step) Execute the plan of the round joined at start; the resume step."""
        plan, self.pending_plan = self.pending_plan, None
        assert plan is not None
        if self.links.stop.newer_than(self.state.generation):
            return self.recover()  # our round was superseded before we got here
        try:
            t0 = time.monotonic()
            resume = self.execute(plan)
        except StopRequested:
            return self.recover()
        self.last_recovery = {
            "repair_s": time.monotonic() - t0,
            "since_init_s": time.monotonic() - self._t_created,
        }
        self.links.log(
            f"replacement resumes at step {resume} (repair {self.last_recovery['repair_s']:.3f} s)"
        )
        self._send_recovered(plan, plan.generation, replacement=True)
        heap.settle()  # the heap its spare faulted in is used: shrink like any process again
        return resume

    # ---------------------------------------------------------------- status and plan
    def join(self, generation: int) -> P.RepairPlan:
        """Post this rank's status for `generation` and wait for the controller's plan."""
        links = self.links
        self.state.generation = generation
        if links.channel is not None:  # heartbeats from now on answer the stop of this round
            links.channel.update(generation=generation, stuck=False)
        self.path.set_phase("recovering")
        self.mark("status")
        status = self.status(generation)
        links.store.set(P.status_key(generation, links.rank), status.to_json())
        links.log(
            f"posted status: committed_step={status.committed_step} step={status.step} "
            f"dirty={status.dirty} replacement={status.replacement} shard={status.shard!r}"
        )
        # the round's critical path: every rank of the round waits for this key, the slowest
        # reader holds up the group rebuild, so poll it finely (a round lasts ~0.1 s)
        raw = links.wait_key(
            generation,
            P.repair_key(generation),
            "the controller's repair plan",
            max_delay=links.options.plan_poll_interval,
        )
        plan = P.RepairPlan.from_json(raw)
        self.mark("plan")
        links.log(
            f"repair plan: resume_step={plan.resume_step} action={plan.action} "
            f"pairs={plan.pairs} fallback={plan.fallback} ({plan.reason})"
            + (f" world={plan.world}" if plan.world else "")
        )
        if plan.fallback:
            self._fallback(plan)
        if self.state.needs_state and not self.world.elastic.admits(plan.world):
            self._left_out(plan)
        self.world.elastic.set_members(plan.world)  # the next world's ranks (shrink, grow)
        return plan

    def status(self, generation: int) -> P.RankStatus:
        state = self.state
        return P.RankStatus(
            rank=self.links.rank,
            generation=generation,
            replacement=state.needs_state,
            committed_step=-1 if state.needs_state else state.committed,
            step=state.current_step,
            dirty=state.dirty,
            shard=self._shard_for_status(),
            pid=os.getpid(),
            host=socket.gethostname(),
            shrinkable=state.shrinkable,
        )

    def _shard_for_status(self) -> str:
        rank = self.links.rank
        if not self.state.registered and self.links.env.managed:
            raw = self.links.try_get(P.replica_key(rank))  # our predecessor's layout
            if raw is not None:
                return raw.decode()
        return self.state.layout.shard_of(rank)

    def _left_out(self, plan: P.RepairPlan) -> None:
        """A returning rank (a live grow) that the round's world does not take back: the others
        stay in their world; this process ends (its agent expects it)."""
        self.links.log(
            f"not taken back into the world {plan.world} ({plan.reason}); this returning "
            "process ends and the world stays as it is"
        )
        self.links.hard_exit(P.EXIT_FALLBACK)

    def _fallback(self, plan: P.RepairPlan) -> None:
        self.links.log(
            f"peer repair impossible, fallback={plan.fallback}: {plan.reason}; exiting so the "
            "agents restart the job from the last durable checkpoint"
        )
        if plan.fallback == P.DUMP:
            self.checkpoints.dying_gasp(plan)
        self.links.hard_exit(P.EXIT_FALLBACK)

    # ---------------------------------------------------------------- the repair
    def execute(self, plan: P.RepairPlan) -> int:
        """Restore/transfer along the plan, post resumed, return the resume step."""
        self.last_plan = plan
        rank = self.links.rank
        sources = [src for src, dst in plan.pairs if dst == rank]  # >1: striped, in order
        if len(set(sources)) != len(sources) or rank in sources:
            raise RuntimeError(f"repair plan names sources {sources} for rank {rank}: {plan.pairs}")
        if sources and not self.state.registered:
            raise RuntimeError("a replacement must call rt.register(...) before rt.steps()")
        snap = None if sources else self._restore_own(plan.resume_step)
        stripes: dict[int, list[int]] = {}
        for src, dst in plan.pairs:
            stripes.setdefault(dst, []).append(src)
        for dst, srcs in stripes.items():
            if rank in srcs:
                assert snap is not None
                self._send(plan, snap, dst, srcs)
            elif dst == rank:
                snap = self._receive(plan.resume_step, srcs)
        if plan.pairs:
            # every rank leaves the round together: ranks outside the transfers sleep in this
            # barrier instead of computing the resume step on the CPUs the transfer needs
            # (their step would block on the replacement's gradients anyway)
            self.coll.barrier(what="end of state transfer")
        assert snap is not None
        return self._resumed(plan, snap)

    def _restore_own(self, resume: int) -> Snapshot:
        """A rank the plan gives no source: back to its own step-start state of `resume`."""
        state, rank = self.state, self.links.rank
        if state.needs_state or state.dirty:
            raise RuntimeError(
                f"rank {rank} holds no trusted state but the plan gives it no source"
            )
        snap = state.snapshots.get(resume)
        if snap is None:
            raise RuntimeError(
                f"rank {rank} has no step-start state for step {resume} "
                f"(has {sorted(state.snapshots)}); the plan does not match this rank"
            )
        state.reg.restore(snap, self.adapter)
        return snap

    def _send(self, plan: P.RepairPlan, snap: Snapshot, dst: int, srcs: list[int]) -> None:
        """This rank's stripe of its state to `dst` (one of the sources `srcs`)."""
        resume, rank = plan.resume_step, self.links.rank
        stats = send_state(
            self.coll,
            self.state.reg.full_state(snap),
            dst,
            srcs.index(rank),
            len(srcs),
            midway=lambda: self.injector.maybe_fire(plan.generation, resume, "transfer"),
        )
        self._moved["transfer_s"] += stats.seconds
        part = f"stripe {srcs.index(rank)}/{len(srcs)} of " if len(srcs) > 1 else ""
        how = "read from this rank's memory" if stats.path == "memory" else "sent"
        self.links.log(
            f"{how}: {part}state to rank {dst}, {stats.nbytes / 1e6:.1f} MB in "
            f"{stats.tensors} tensors, {stats.seconds:.3f} s ({stats.gbps:.2f} GB/s)"
        )

    def _receive(self, resume: int, srcs: list[int]) -> Snapshot:
        """The state of step `resume` from the sources `srcs`, applied; its snapshot."""
        reg, log = self.state.reg, self.links.log
        self.init_window.close(reg.overwritten())
        state, stats = recv_state(self.coll, srcs, reg.live_tensors())
        self._moved = {
            "transfer_bytes": stats.nbytes,
            "transfer_s": stats.seconds,
            "source": srcs[0],
            "transfer_path": stats.path,
        }
        if state["step"] != resume:
            raise RuntimeError(
                f"ranks {srcs} sent the state of step {state['step']}, plan resumes at {resume}"
            )
        reg.load_full_state(state, self.adapter)
        self.mark("received")
        if stats.fallback:
            log(
                f"reading the state from the sender's memory failed ({stats.fallback}); "
                f"it came over the network"
            )
        log(
            f"received state from rank {','.join(map(str, srcs))} ({stats.path}): "
            f"{stats.nbytes / 1e6:.1f} MB in {stats.tensors} tensors, {stats.seconds:.3f} s "
            f"({stats.gbps:.2f} GB/s; {stats.phases})"
        )
        snap = reg.snapshot(resume, self.adapter)
        if reg.on_rollback is not None:
            reg.on_rollback(resume)
        return snap

    def _resumed(self, plan: P.RepairPlan, snap: Snapshot) -> int:
        """The round's repair is done: the rank stands at the start of the resume step."""
        resume, state = plan.resume_step, self.state
        state.snapshots = {resume: snap}
        state.committed = resume - 1
        state.current_step = resume - 1
        state.dirty = False
        state.needs_state = False
        state.in_update = False
        self.links.store.set(P.resumed_key(plan.generation, self.links.rank), str(resume).encode())
        self.mark("repaired")
        self.path.set_phase("resumed")
        return resume

    # ---------------------------------------------------------------- the round's edges
    def mark(self, edge: str) -> None:
        """Wall-clock time of one edge of a recovery round (inside a round only)."""
        if self._marks or edge in ("stopped", "status"):
            self._marks[edge] = round(time.time(), 4)

    def _take_marks(self) -> dict:
        """The round's edges and bytes moved, for the "recovered" message; resets both."""
        out = {"marks": self._marks, **self._moved}
        self._marks, self._moved = {}, {"transfer_bytes": 0, "transfer_s": 0.0}
        return out
