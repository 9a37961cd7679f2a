"""The process groups of a rank's current generation.

Owns: `World`: building the default group and the runtime's own groups on the generation's
store prefix, tearing the old generation's groups down at a recovery round (never destroying a
group a stuck collective may still use), the listeners told of each rebuild (rt.ddp, the
framework's `on_rebuild`), and the collectives that wait in C++ (DDP's own reducer under
rt.ddp): on a stop, shutting down the older groups' sockets so such a wait fails at once, and
the alarm when the training thread stays inside one anyway; and `grad_comm`, the gradient
communication of a group in the current world (after a live shrink: torch's numbering of the
smaller world, and an average over the group's original size).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from launcher.protocol import plan as P
from launcher.runtime.buckets import GradComm
from launcher.runtime.build_stores import BuildStores
from launcher.runtime.collectives import Graveyard, Interruptible
from launcher.runtime.devices import DeviceAdapter
from launcher.runtime.elastic import ElasticView
from launcher.runtime.group_sockets import SocketLedger
from launcher.runtime.groups import GroupHandle, GroupRegistry
from launcher.runtime.rank_state import RankLinks, RankState
from launcher.runtime.wait_probe import (
    STUCK_AFTER_BREAK_S,
    CppWaitProbe,
    StuckWaitAlarm,
    cpp_wait_codes,
)


class World:
    """The default group and the runtime's groups, rebuilt for each generation."""

    def __init__(
        self,
        state: RankState,
        links: RankLinks,
        backend: str,
        adapter: DeviceAdapter,
        graveyard: Graveyard,
    ) -> None:
        self.state = state
        self.links = links
        self.elastic = ElasticView(state, links)  # the current world's ranks (live shrink)
        self.backend = backend
        self.adapter = adapter
        self.graveyard = graveyard
        env = links.env
        self.groups = GroupRegistry(env.rank, env.world_size, backend, lambda: self.elastic.members)
        # sockets of every gloo group, so that a stop can break waits torch runs in C++ (rt.ddp)
        self.sockets = SocketLedger(lambda: links.stop.target)
        # each build's own store connection, shut by a newer stop (a peer died mid-round)
        self.build_stores = BuildStores(self._store_client, lambda: links.stop.target)
        links.stop.on_request(self.break_old_groups)
        self.stuck_alarm: StuckWaitAlarm | None = None  # set with the C++ waits (rt.ddp, gloo)
        # called with the new generation after every group rebuild (rt.ddp rebuilds DDP there)
        self.listeners: list[Callable[[int], None]] = []
        # Called with the generation once a recovery round has rebuilt the default group and
        # the runtime's own groups: a framework re-creates its groups here (see callbacks).
        self.on_rebuild: Callable[[int], None] | None = None

    def build(self, generation: int, rebuild_groups: bool) -> None:
        """The default group of `generation` (and, in a recovery round, the runtime's groups;
        then the listeners rebuild theirs), on a store connection of its own that a newer stop
        shuts down (build_stores). A build that fails leaves torch as it found it."""
        store = dist.PrefixStore(P.pg_prefix(generation), self.build_stores.open(generation))
        try:
            with self.sockets.track(generation):
                self._init_default_group(store)
                if rebuild_groups:
                    self.groups.rebuild(generation)
            if rebuild_groups:
                for listener in list(self.listeners):
                    listener(generation)
                if self.on_rebuild is not None:
                    self.on_rebuild(generation)
        finally:
            self.build_stores.finished(generation)

    def grad_comm(self, coll: Interruptible, group: GroupHandle | None) -> GradComm:
        """Gradient communication over `group` (None: every rank) in the current world. After a
        live shrink the average keeps the global batch: it divides by the group's original
        size (launcher.runtime.elastic), and broadcasts name their source by torch's rank."""
        rank = self.links.rank
        if group is not None and rank not in group.ranks:
            raise ValueError(f"rank {rank} is not a member of group {group.name!r} ({group.ranks})")
        ranks = tuple(self.elastic.members) if group is None else tuple(group.ranks)
        original = self.links.env.world_size if group is None else group.original_size
        torch_ranks = tuple(self.elastic.torch_rank(r) for r in ranks)
        return GradComm(
            coll,
            lambda: None if group is None else group.group,
            len(ranks),
            torch_ranks[0],
            ranks,
            divisor=original if original != len(ranks) else 0,
            torch_ranks=torch_ranks,
        )

    def _init_default_group(self, store: dist.PrefixStore) -> None:
        """init_process_group on `store`; when it fails, the group it named is forgotten.

        torch names the default group from a process-wide counter (`_world.group_count`, the
        group's keys in the store live under that name) and counts it before gloo connects,
        so an init that fails (a peer died, a newer stop shut the build's store) leaves the
        counter at 1 with no group: the next generation's default group would be group "1"
        here and group "0" in a fresh replacement, and their rendezvous would never meet (each
        waits for the other's keys until the store timeout). Only `destroy_process_group`
        resets the counter, and with no default group there is nothing to destroy."""
        c10d = dist.distributed_c10d
        count = c10d._world.group_count
        try:
            dist.init_process_group(
                self.backend,
                store=store,
                rank=self.elastic.group_rank,
                world_size=self.elastic.size,
                timeout=timedelta(seconds=self.links.env.store_timeout),
            )
        except BaseException:
            if not dist.is_initialized():
                c10d._world.group_count = count
            raise

    def _store_client(self) -> dist.TCPStore:
        """A new connection to the job's store (through this node's agent), for one build."""
        env = self.links.env
        return dist.TCPStore(
            env.master_addr,
            env.master_port,
            is_master=False,
            timeout=timedelta(seconds=env.store_timeout),
            wait_for_workers=False,
        )

    def teardown(self) -> None:
        """Drop the current generation's groups (aborted first; kept alive in the graveyard)."""
        if not dist.is_initialized():
            return
        c10d = dist.distributed_c10d
        groups = list(c10d._world.pg_map.keys())
        self.graveyard.keep(*groups)  # never let a group with a stuck op be destroyed
        self.sockets.forget(self.links.stop.target)  # every group is about to be destroyed
        self.adapter.abort_groups(groups)
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - the old world is discarded either way
            self.links.log(
                f"destroying generation {self.state.generation}'s groups failed ({exc}); "
                "dropping them"
            )
            _drop_all_groups()

    def abort_groups(self) -> None:
        if dist.is_initialized():
            self.adapter.abort_groups(list(dist.distributed_c10d._world.pg_map.keys()))

    # ---------------------------------------------------------------- waits in C++
    def break_old_groups(self, target: int) -> None:
        """On a stop (the channel's reader thread): with collectives that wait in C++ (DDP's
        own reducer under rt.ddp), shut down the sockets of the older generations' groups so
        that such a wait fails at once instead of waiting for a hung peer (see
        group_sockets)."""
        for left in self.build_stores.interrupt(target):
            self.links.log(
                f"stop for generation {target}: left the group build of generation {left} "
                "(its store connection shut down)"
            )
        if self.sockets.enabled:
            n = self.sockets.break_before(target)
            if n:
                self.links.log(
                    f"stop for generation {target}: shut down {n} sockets of the older groups "
                    "(leaves DDP's waits in C++)"
                )
            if self.stuck_alarm is not None:
                self.stuck_alarm.arm(target)

    def _report_stuck(self, target: int) -> None:
        """(the alarm's timer) The training thread stayed in its C++ wait after the break: tell
        the agent, which replaces this rank in the round now (see StuckWaitAlarm)."""
        self.links.log(
            f"still inside a collective wait in C++ {STUCK_AFTER_BREAK_S:g}s after the stop for "
            f"generation {target} shut down its sockets: a send gloo had queued on a failed "
            "connection, which gloo never fails; asking the agent to replace this rank"
        )
        if self.links.channel is not None:
            self.links.channel.update(stuck=True)

    def enable_cpp_waits(self) -> None:
        """Something waits for collectives in C++ from now on (DDP's own reducer): break
        those waits on a stop, and report them to the agent as waiting on peers. gloo only: its
        waits block the training thread on sockets. NCCL/HCCL waits do not block the host (the
        stream waits), their groups are aborted through the device adapter, and there the
        backward runs on device threads, so a training thread without CPU inside backward is
        computing, not waiting: the probe would be wrong."""
        if self.sockets.enabled or self.backend != "gloo":
            return
        self.sockets.enabled = True
        channel = self.links.channel
        if channel is not None:
            codes = cpp_wait_codes()
            channel.set_wait_probe(CppWaitProbe(codes))
            state = self.state
            self.stuck_alarm = StuckWaitAlarm(
                codes, lambda g: state.generation >= g, self._report_stuck
            )


def _drop_all_groups() -> None:
    """Forget every group torch knows (when destroying them failed)."""
    c10d = dist.distributed_c10d
    c10d._update_default_pg(None)
    for table in (
        c10d._world.pg_map,
        c10d._world.pg_names,
        c10d._world.pg_group_ranks,
        c10d._world.pg_backend_config,
        c10d._world.pg_to_tag,
        c10d._world.tags_to_pg,
    ):
        table.clear()
    c10d._world.group_count = 0
