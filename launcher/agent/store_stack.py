"""The agent's store stack: the job's store, its token, the node's proxy, the node rendezvous.

Owns, in the order an agent builds them: the job token; the store (hosting the embedded store on the
store host, connecting to it from other nodes, or an etcd client); the node-level rendezvous
(`rendezvous.nodes.membership`: join, heartbeat, node watch) that says which node this is and how
big the job is, and moving it to a new rendezvous round (`request_round`, `next_round`: the world
shrinks when a lost node is not taken over); the per-node store proxy local workers use; publishing
where the store is (`store.json` in the run log dir for `ftctl`, the world size in the store); and
`close()`, which takes all of it down in reverse order. Nothing here knows about workers or plans.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from launcher.config import LaunchConfig
from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from rendezvous.kv import KVStore, StoreError
from rendezvous.store import auth

if TYPE_CHECKING:
    from rendezvous.nodes.membership import Membership


class MembershipLog(logging.Handler):
    """Membership news (`ftrun.membership` records: slots, the world closing, a hot spare
    waiting or taking over, leaves) as agent log events, for people and events.jsonl."""

    def __init__(self, log: AgentLog) -> None:
        super().__init__(logging.INFO)
        self.agent_log = log

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        kind = "hot-spare" if "hot spare" in msg else "membership"
        level = "warning" if record.levelno >= logging.WARNING else "info"
        self.agent_log.event(kind, msg, level=level)


@dataclass(frozen=True)
class AgentWorld:
    """What this agent knows of the job after node-level rendezvous."""

    group_rank: int
    group_world_size: int
    rank_base: int
    world_size: int
    is_leader: bool
    from_spare: bool = False  # a hot spare that took over a lost node's ranks


class StoreStack:
    """Built by `open()`, `join()`, `start_proxy()`, `publish()`; taken down by `close()`."""

    def __init__(self, cfg: LaunchConfig, log: AgentLog) -> None:
        self.cfg = cfg
        self.log = log
        self.kv: KVStore | None = None
        self.token: str | None = None
        self.addr = ""  # where the job's store is, as printed for people and ftctl
        self.rejoined = False  # this agent replaces a lost node
        self.generation_before_join = 0
        self.hosting = False  # this agent hosts the embedded store
        self._server: Any = None
        self._proxy: Any = None
        self._membership: Membership | None = None  # `membership`
        self._interrupted = False
        self._watchers: tuple[Any, Any, Any, Any] = (None, None, None, None)  # join()'s callbacks
        self._renewed = False  # joining again after this agent's membership was lost
        self._news = MembershipLog(log)
        news = logging.getLogger("ftrun.membership")
        news.addHandler(self._news)
        news.setLevel(logging.INFO)
        news.propagate = False

    # ---------------------------------------------------------------- the store
    def _etcd_kv(self) -> KVStore:
        """A client of the job's etcd store (the agent's own, and each proxy upstream link)."""
        from rendezvous.store.etcd import (
            EtcdConf,
            EtcdKV,
            parse_endpoints,
        )  # imports gRPC: only for etcd

        cfg = self.cfg
        return EtcdKV(
            parse_endpoints(cfg.rdzv_endpoint),
            root=f"/ftrun/{cfg.rdzv_id}",
            conf=EtcdConf.from_rdzv_conf(cfg.rdzv_conf),
        )

    def open(self) -> KVStore:
        cfg = self.cfg
        self.token = cfg.job_token
        if cfg.store_backend == "etcd":
            # The agent forks workers while gRPC threads run; gRPC's fork handlers only warn.
            os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
            self.kv = self._etcd_kv()
            self.log.info("store", f"etcd store at {cfg.rdzv_endpoint} (run {cfg.rdzv_id})")
        elif cfg.dynamic and cfg.max_nodes > 1:
            self.kv = self._host_or_join()
        elif cfg.is_store_host:
            self.kv = self._host()
        else:
            from rendezvous.store.client import StoreClient

            # the store host may come up within join_timeout; every call after that is bounded
            # by read_timeout (a hung store must not block a store call for join_timeout)
            self.kv = StoreClient(
                cfg.store_host,
                cfg.store_port,
                token=self.token,
                timeout=cfg.rdzv_settings.read_timeout,
                connect_timeout=cfg.join_timeout,
            )
            self.log.info("store", f"using the store at {cfg.store_host}:{cfg.store_port}")
        return self.kv

    def _host_or_join(self) -> KVStore:
        """Dynamic c10d: the agent on the endpoint's host hosts the store (torchrun's is_host
        rule); every other agent, and one finding the port held by this run's store, joins."""
        from rendezvous.nodes.hosting import host_or_join

        cfg = self.cfg
        h = host_or_join(
            cfg.store_host,
            cfg.store_port,
            cfg.rdzv_id,
            cfg.is_store_host,
            token=self.token,
            timeout=cfg.rdzv_settings.read_timeout,
            nice=cfg.store_nice,
            accel=cfg.store_accel,
        )
        self._server, self.hosting = h.server, h.hosting
        if h.hosting and cfg.proxy and self.token is None:
            self.log.warning(
                "store-auth",
                "no job token (FTRUN_JOB_TOKEN or --rdzv-conf "
                "token_file=...): the store port accepts any client",
            )
        if h.hosting:
            self.log.info(
                "store",
                f"hosting the store on 0.0.0.0:{h.server.port} (is_host: "
                f"{cfg.store_host} is this host)",
                port=h.server.port,
            )
        else:
            self.log.info(
                "store",
                f"using the store at {cfg.store_host}:{cfg.store_port}"
                + (" (the port is held by another agent of this run)" if cfg.is_store_host else ""),
            )
        return h.kv

    def _host(self) -> KVStore:
        from rendezvous.store.server import StoreServer

        cfg = self.cfg
        if cfg.proxy and self.token is None and cfg.max_nodes == 1:
            self.token = auth.generate_token()  # only this agent and its proxy need it
        if cfg.proxy and self.token is None:
            self.log.warning(
                "store-auth",
                "no job token (FTRUN_JOB_TOKEN or --rdzv-conf "
                "token_file=...): the store port accepts any client",
            )
        host = "127.0.0.1" if cfg.store_port == 0 else "0.0.0.0"
        self._server = StoreServer(
            host=host,
            port=cfg.store_port,
            token=self.token if cfg.proxy else None,
            nice=cfg.store_nice,
            accel=cfg.store_accel,
        )
        self._server.start()
        self.hosting = True
        self.log.info(
            "store",
            f"hosting the store on {host}:{self._server.port}"
            + (" (token required)" if cfg.proxy and self.token else ""),
            port=self._server.port,
        )
        return self._server.kv

    def server_stats(self) -> Callable[[], Any] | None:
        """The hosted store's request statistics (for the metrics), None when not hosting."""
        return self._server.stats.copy if self._server is not None else None

    def store_port(self) -> int:
        if self._server is not None:
            return int(self._server.port)
        return self.cfg.store_port

    # ---------------------------------------------------------------- node rendezvous
    def join(
        self,
        host: str,
        on_node_dead: Callable[[int], None],
        on_node_join: Callable[[int], None],
        stop: threading.Event | None = None,
        on_lost: Callable[[Any], None] | None = None,
        on_left: Callable[[int, str], None] | None = None,
    ) -> AgentWorld:
        """Node-level rendezvous; the callbacks run on the membership thread. Ends with
        JoinInterrupted within a fraction of a second of `stop.set()` / `interrupt()`,
        RendezvousGracefulExit when the run finished while this agent waited as a hot spare."""
        cfg = self.cfg
        assert self.kv is not None
        if cfg.max_nodes == 1 and cfg.store_backend == "embedded":
            return AgentWorld(0, 1, 0, cfg.nproc_per_node, True)
        from rendezvous.nodes.membership import Membership
        from rendezvous.nodes.settings import MembershipSettings

        if self._membership is None:
            self._membership = Membership(
                self.kv,
                MembershipSettings(
                    cfg.node_rank,
                    cfg.min_nodes,
                    cfg.max_nodes,
                    cfg.nproc_per_node,
                    cfg.local_addr or host,
                    cfg.rdzv_id,
                    rdzv=cfg.rdzv_settings,
                    hosts_store=self.hosting,
                ),
            )
        if self._interrupted:
            self._membership.interrupt()
        try:
            raw = self.kv.try_get(P.GENERATION_KEY)
        except StoreError:
            if not self._renewed:
                raise  # the first join: the store is not there (one line, within join_timeout)
            raw = None  # a renewed agent: join() says why (the embedded store's host is gone...)
        self.generation_before_join = int(raw) if raw is not None else 0
        self._watchers = (on_node_dead, on_node_join, on_lost, on_left)
        self._membership.join(stop=stop)
        return self._watch()

    def _watch(self) -> AgentWorld:
        """Heartbeat and node watch of the membership just joined; its world for the agent."""
        m = self._membership
        on_node_dead, on_node_join, on_lost, on_left = self._watchers
        m.start_heartbeat()
        m.watch_nodes(on_node_dead, on_node_join, on_lost=on_lost, on_left=on_left)
        w = m.world
        self.rejoined = bool(w.rejoined)
        return AgentWorld(
            w.group_rank,
            w.group_world_size,
            w.nodes[w.group_rank].rank_base,
            w.world_size,
            w.leader_node == w.group_rank,
            bool(getattr(w, "from_spare", False)),
        )

    @property
    def membership(self) -> Membership | None:
        """The node-level rendezvous (None: one node on the embedded store, or before join())."""
        return self._membership

    @property
    def can_renumber(self) -> bool:
        """True when a new rendezvous round can renumber the nodes (a dynamic rendezvous)."""
        return self._membership is not None and not self._membership.static

    def request_round(self) -> int:
        """Open a new rendezvous round (the controller, to shrink the world); its number."""
        assert self._membership is not None
        return int(self._membership.request_round())

    def waiting(self) -> int:
        """How many agents wait to get in (hot spares; with scale_up=restart, for a round)."""
        return len(self._membership.spares()) if self._membership is not None else 0

    def next_round(self, stop: threading.Event | None = None) -> AgentWorld:
        """Leave this round and join the requested one (this agent's workers are stopped);
        the same callbacks as join(). Raises like join()."""
        assert self._membership is not None
        raw = self.kv.try_get(P.GENERATION_KEY) if self.kv is not None else None
        self.generation_before_join = int(raw) if raw is not None else 0
        self._membership = self._membership.next_round(stop=stop)
        return self._watch()

    def interrupt(self) -> None:
        """End a running join() (signal handler safe: no I/O)."""
        self._interrupted = True
        if self._membership is not None:
            self._membership.interrupt()

    def lost_error(self) -> Any:
        """Why this agent lost its membership (NodeLostError), or None while a member."""
        return self._membership.lost_error() if self._membership is not None else None

    # ---------------------------------------------------------------- the controller role
    @property
    def can_elect(self) -> bool:
        """True when the controller role is elected (etcd): it moves when its node is lost."""
        return self._membership is not None and bool(self._membership.can_elect)

    def elect(self, on_elected: Callable[[], None], on_deposed: Callable[[], None]) -> Any:
        """Run for controller (etcd; see rendezvous.nodes.election); returns the Election."""
        assert self._membership is not None
        return self._membership.elect(on_elected, on_deposed)

    def lost_nodes(self) -> list[int]:
        """Group ranks of the world this agent believes have no live holder now."""
        if self._membership is None or self._membership.world is None:
            return []
        alive = set(self._membership.alive_nodes())
        return [n.node_rank for n in self._membership.world.nodes if n.node_rank not in alive]

    def members(self) -> dict[int, int]:
        """Group rank -> agent incarnation of every node this agent believes alive now."""
        if self._membership is None or self._membership.world is None:
            return {}
        return self._membership.liveness.roster.alive()

    def world_round(self) -> int:
        """The rendezvous round of the world this agent is in (0 before a new round)."""
        if self._membership is None or self._membership.world is None:
            return 0
        return int(getattr(self._membership.world, "round", 0))

    def incarnation_of(self, node: int) -> int:
        """The incarnation of `node`'s live agent as this agent knows it (0: unknown)."""
        return self.members().get(node, 0)

    def why_gone(self, node: int, incarnation: int) -> str:
        """How that incarnation of `node` went (left with a reason, lease expired, ...)."""
        assert self._membership is not None
        return self._membership.why_gone(node, incarnation)

    # ---------------------------------------------------------------- fencing
    def me(self) -> tuple[int | None, int]:
        """(group rank, incarnation) of this agent's membership; (None, 0) without one."""
        if self._membership is None:
            return None, 0
        gr, inc = self._membership.me
        return (gr if inc else None), inc

    def check_member(self, what: str) -> None:
        """FencedError (logged) when this agent is stale and may not write `what`; a no-op
        without membership (one node, embedded store)."""
        if self._membership is not None:
            self._membership.check_member(what)

    def stale(self, node: int, incarnation: int) -> str:
        """Why a record written by incarnation `incarnation` of `node` must be refused ("" when
        its writer is still the node's live holder, or without membership)."""
        if self._membership is None or incarnation <= 0:
            return ""
        try:
            return self._membership.stale(node, incarnation)
        except StoreError:
            return ""

    def renew(self) -> None:
        """After this agent was lost: drop the old identity; the next join() is a fresh node."""
        assert self._membership is not None
        self._membership.stop(leave=False)
        self._membership = self._membership.renew()
        self._renewed = True

    # ---------------------------------------------------------------- what workers use
    def start_proxy(self) -> tuple[str, int]:
        """Start the per-node proxy when enabled; return the MASTER_ADDR/PORT workers get."""
        cfg = self.cfg
        if not cfg.proxy:
            return cfg.master_addr_for_workers, self.store_port()
        from rendezvous.store.proxy import StoreProxy

        if cfg.store_backend == "etcd":
            self._proxy = StoreProxy(
                self._etcd_kv, listen_host="127.0.0.1", port=0, accel=cfg.store_accel
            )
        else:
            host = "127.0.0.1" if self._server is not None else cfg.store_host
            self._proxy = StoreProxy(
                (host, self.store_port(), self.token),
                listen_host="127.0.0.1",
                port=0,
                accel=cfg.store_accel,
            )
        self._proxy.start()
        self.log.info("proxy", f"store proxy for local workers on 127.0.0.1:{self._proxy.port}")
        return "127.0.0.1", int(self._proxy.port)

    def publish(self, world: AgentWorld, run_dir: str) -> str:
        """Tell people and `ftctl` where this job's store is (store.json in the run log dir)."""
        assert self.kv is not None
        cfg = self.cfg
        if cfg.store_backend == "etcd":
            addr = cfg.rdzv_endpoint
        elif self._server is not None:
            host = cfg.store_host if cfg.store_port else "127.0.0.1"
            addr = f"{host}:{self._server.port}"
        else:
            addr = f"{cfg.store_host}:{cfg.store_port}"
        if world.is_leader:
            self.kv.set(P.WORLD_SIZE_KEY, str(world.world_size).encode())
        path = os.path.join(run_dir, P.STORE_ADDR_FILE)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "addr": addr,
                    "backend": cfg.store_backend,
                    "token_required": bool(self.token and cfg.proxy),
                },
                f,
            )
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.addr = addr
        self.log.info("store-address", f"job store at {addr} (ftctl --addr {addr})", addr=addr)
        return addr

    # ---------------------------------------------------------------- shutdown
    def _let_spares_see_the_end(self) -> None:
        """The store host of a finished run keeps the store up until the hot spares have seen
        the end (they poll once per keep-alive interval and then withdraw), at most 3 of those."""
        if self._server is None or self._membership is None:
            return
        end = time.monotonic() + 3 * self.cfg.rdzv_settings.keep_alive_interval
        try:
            while self._membership.spares() and time.monotonic() < end:
                time.sleep(0.05)
        except StoreError:
            pass

    def close(self, leave_reason: str | None = None) -> None:
        """Take everything down; `leave_reason` (keys.LEAVE_SIGNAL) tells the other nodes at
        once that this node left on purpose (default: done)."""
        if self._membership is not None:
            if leave_reason is None:
                self._membership.stop()
                self._let_spares_see_the_end()
            else:
                self._membership.leave(leave_reason)
        if self._proxy is not None:
            self._proxy.stop()
        if self.kv is not None and self._server is None:
            self.kv.close()
        if self._server is not None:
            self._server.stop()
        logging.getLogger("ftrun.membership").removeHandler(self._news)
