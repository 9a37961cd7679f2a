"""Rendezvous timing and policy settings, as torchrun's `--rdzv-conf` names them.

Owns: `RendezvousSettings` (every timeout and keep-alive knob membership takes, with torchrun's
names) and `from_rdzv_conf`, which reads them from a `--rdzv-conf` dict and rejects a bad value
with one line naming the key and what is allowed. Keys it does not know belong to other
components (etcd TLS, proxy, is_host, ...) and are ignored here. Also `MembershipSettings`:
everything a `rendezvous.nodes.membership.Membership` is built from (who this node is, the
world it expects, the run, and the `RendezvousSettings`), checked when it is made.

  join_timeout            s   the whole rendezvous must complete within it (torchrun: 600)
  last_call_timeout       s   after MIN nodes arrived, wait this long for more (up to MAX) (30)
  close_timeout           s   wait for arrivals already counted to write their records (30)
  read_timeout            s   a single store read that waits for a key (60)
  keep_alive_interval     s   how often an agent shows it is alive (ftrun: 1; torchrun: 5)
  keep_alive_max_attempt  n   silent intervals after which it is dead (ftrun: 5; torchrun: 3)
  heartbeat_timeout       s   the liveness timeout itself (overrides interval * max_attempt)
  spare_timeout           s   a hot spare gives up after this long (default: waits until the
                              run ends or it is stopped)
  scale_up                    spare (a node arriving while the job runs waits as a hot spare
                              and takes the next lost node's ranks) | restart (torchrun: a new
                              rendezvous round includes it; see rendezvous.nodes.rounds)
`timeout` is accepted as join_timeout when join_timeout is not given (static rendezvous).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

_SECONDS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "read_timeout",
    "keep_alive_interval",
    "heartbeat_timeout",
    "spare_timeout",
)


@dataclass(frozen=True)
class RendezvousSettings:
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    read_timeout: float = 60.0
    keep_alive_interval: float = 1.0
    keep_alive_max_attempt: int = 5
    heartbeat_timeout: float | None = None  # None: keep_alive_interval * keep_alive_max_attempt
    spare_timeout: float | None = None  # None: a spare waits until the run ends or it is stopped
    scale_up: str = "spare"  # or "restart"

    def __post_init__(self) -> None:
        for name in _SECONDS:
            v = getattr(self, name)
            if v is None and name in ("heartbeat_timeout", "spare_timeout"):
                continue
            if (
                not isinstance(v, (int, float))
                or isinstance(v, bool)
                or not math.isfinite(v)
                or v <= 0
            ):
                raise ValueError(f"--rdzv-conf {name}={v!r}: must be a number of seconds > 0")
        if self.scale_up not in ("spare", "restart"):
            raise ValueError(f"--rdzv-conf scale_up={self.scale_up!r}: must be spare or restart")
        n = self.keep_alive_max_attempt
        if not isinstance(n, int) or isinstance(n, bool) or n < 2:
            raise ValueError(f"--rdzv-conf keep_alive_max_attempt={n!r}: must be an integer >= 2")
        if self.liveness_timeout <= self.keep_alive_interval:
            raise ValueError(
                f"--rdzv-conf heartbeat_timeout={self.liveness_timeout:g}: must "
                f"exceed keep_alive_interval={self.keep_alive_interval:g}"
            )

    @property
    def liveness_timeout(self) -> float:
        """Silence after which a node is dead (the heartbeat timeout / etcd lease TTL)."""
        if self.heartbeat_timeout is not None:
            return float(self.heartbeat_timeout)
        return self.keep_alive_interval * self.keep_alive_max_attempt

    @classmethod
    def from_rdzv_conf(cls, conf: Mapping[str, object]) -> "RendezvousSettings":
        """Settings from a `--rdzv-conf` dict (values as strings or numbers)."""
        vals: dict[str, object] = {}
        for name in _SECONDS:
            if conf.get(name) not in (None, ""):
                vals[name] = _number(name, conf[name])
        if "join_timeout" not in vals and conf.get("timeout") not in (None, ""):
            vals["join_timeout"] = _number("timeout", conf["timeout"])
        raw = conf.get("keep_alive_max_attempt")
        if raw not in (None, ""):
            try:
                vals["keep_alive_max_attempt"] = int(str(raw))
            except ValueError:
                raise ValueError(
                    f"--rdzv-conf keep_alive_max_attempt={raw!r}: must be an integer >= 2"
                ) from None
        if conf.get("scale_up") not in (None, ""):
            vals["scale_up"] = str(conf["scale_up"]).strip().lower()
        return cls(**vals)  # type: ignore[arg-type]


def _number(name: str, raw: object) -> float:
    try:
        return float(str(raw))
    except ValueError:
        raise ValueError(f"--rdzv-conf {name}={raw!r}: must be a number of seconds > 0") from None


@dataclass(frozen=True)
class MembershipSettings:
    """What one agent's `Membership` is built from. `node_rank` None: a dynamic rendezvous
    (--nnodes MIN:MAX, group ranks by arrival); else a static one (nnodes_min == nnodes_max).
    `host` is the address the others reach this node at; `hosts_store`: this agent runs the
    embedded store. ValueError naming the first bad field."""

    node_rank: int | None
    nnodes_min: int
    nnodes_max: int
    local_world_size: int
    host: str
    run_id: str
    rdzv: RendezvousSettings = field(default_factory=RendezvousSettings)
    hosts_store: bool = False

    def __post_init__(self) -> None:
        lo, hi = self.nnodes_min, self.nnodes_max
        if not 1 <= lo <= hi:
            raise ValueError(f"nnodes {lo}:{hi}: need 1 <= MIN <= MAX")
        if self.node_rank is not None:
            if lo != hi:
                raise ValueError(
                    f"node_rank={self.node_rank} needs a fixed node count, got "
                    f"nnodes {lo}:{hi} (omit node_rank for MIN:MAX)"
                )
            if not 0 <= self.node_rank < hi:
                raise ValueError(f"node_rank={self.node_rank} must be in 0..{hi - 1}")
        if self.local_world_size < 1:
            raise ValueError(f"local_world_size={self.local_world_size} must be >= 1")
        if not self.run_id or "/" in self.run_id:
            raise ValueError(f"run_id={self.run_id!r} must be a non-empty name without '/'")
        if not isinstance(self.rdzv, RendezvousSettings):
            raise TypeError(f"rdzv={self.rdzv!r}: must be a RendezvousSettings")

    @property
    def static(self) -> bool:
        """True for a static rendezvous (node ranks given)."""
        return self.node_rank is not None
