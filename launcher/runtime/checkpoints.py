"""Durable checkpoints, coordinated across the ranks (the files are `checkpoint`'s).

Owns: `Checkpoints`: the periodic save between steps (one writer per shard, rank 0 commits once
every shard is written), loading the latest checkpoint at a (restart-all) start, and the
dying-gasp dump a repair plan with fallback=dump asks for before the job restarts.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from launcher.protocol import plan as P
from launcher.runtime import checkpoint as ckpt
from launcher.runtime.devices import DeviceAdapter
from launcher.runtime.rank_state import RankLinks, RankState
from launcher.runtime.state import Snapshot


class Checkpoints:
    """A rank's part in the job's durable checkpoints (none until `configure` names a dir)."""

    def __init__(
        self,
        state: RankState,
        links: RankLinks,
        adapter: DeviceAdapter,
        set_phase: Callable[[str], None],
    ) -> None:
        self.state = state
        self.links = links
        self.adapter = adapter
        self._set_phase = set_phase
        self.dir: str | None = None
        self.every = 0

    def configure(self, directory: str | os.PathLike | None, every: int) -> None:
        self.dir = os.fspath(directory) if directory else None
        self.every = every

    def maybe_save(self, iteration: int) -> None:
        """The periodic checkpoint, when `iteration` is due (between steps)."""
        if self.every and iteration % self.every == 0:
            self.save(iteration)

    def save(self, iteration: int) -> None:
        """Durable checkpoint of the state at the start of step `iteration` (between steps)."""
        state = self.state
        snap = state.snapshots.get(iteration)
        if snap is None or state.committed != iteration - 1:
            raise RuntimeError(
                f"checkpoint of iteration {iteration} requested, but the last completed "
                f"step is {state.committed}"
            )
        rank, members = self.links.rank, state.members  # members: after a live shrink
        replicas = [r for r in state.layout.replicas(rank) if not members or r in members]
        writer = min(replicas) == rank  # the lowest replica still in the world
        self._set_phase("checkpoint")
        self._write(iteration, snap, state.generation, writer, rank == min(members or [0]))

    def _write(
        self, iteration: int, snap: Snapshot, generation: int, writer: bool, committer: bool
    ) -> None:
        """Write this rank's shard (a writer), commit the checkpoint once every shard is
        written (the committer)."""
        assert self.dir is not None
        layout, links = self.state.layout, self.links
        name = layout.checkpoint_name(links.rank)
        if writer:
            t0 = time.monotonic()
            ckpt.write_shard(self.dir, iteration, name, self.state.reg.full_state(snap))
            links.store.set(P.ckpt_key(generation, iteration, name), b"1")
            links.log(
                f"checkpoint shard {name} of iteration {iteration} written in "
                f"{time.monotonic() - t0:.3f} s"
            )
        if committer:
            for shard in layout.checkpoint_names:
                links.wait_key(
                    self.state.generation,
                    P.ckpt_key(generation, iteration, shard),
                    f"checkpoint shard {shard}",
                )
            final = ckpt.commit(self.dir, iteration, list(layout.checkpoint_names))
            links.log(f"checkpoint {final} committed")

    def load(self) -> int:
        """Load the latest durable checkpoint (if any) into the registered objects; returns the
        step to start at (0 without a checkpoint)."""
        if not self.dir:
            return 0
        iteration = ckpt.latest(self.dir)
        if iteration is None:
            return 0
        name = self.state.layout.checkpoint_name(self.links.rank)
        state = ckpt.read_shard(self.dir, iteration, name)
        self.state.reg.load_full_state(state, self.adapter)
        self.links.log(f"loaded checkpoint iteration {iteration} from {self.dir}")
        return iteration

    def dying_gasp(self, plan: P.RepairPlan) -> None:
        """Save the resume state of every shard when each has a writer (the controller's
        `plan_dump` chose the step and the writers)."""
        state, rank = self.state, self.links.rank
        if not self.dir or state.needs_state or state.dirty:
            return
        if state.committed != plan.resume_step - 1:
            return
        writers = plan.writers
        names = set(state.layout.names)
        if set(writers) != names:
            self.links.log(
                f"no dying-gasp checkpoint: shards {sorted(names - set(writers))} "
                "have no healthy holder"
            )
            return
        snap = state.snapshots.get(plan.resume_step)
        if snap is None:
            return
        state.reg.restore(snap, self.adapter)
        shard = state.layout.shard_of(rank)
        self._write(
            plan.resume_step,
            snap,
            plan.generation,
            writers[shard] == rank,
            min(writers.values()) == rank,
        )
