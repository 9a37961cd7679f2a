"""The recovery protocol's shared vocabulary: store key names and the JSON records exchanged.

Owns: every store key the launcher's control plane uses (agents, controller and the in-worker
runtime must agree on them byte for byte; the node-level rendezvous keys are `rendezvous`'s), the
strategy names, the exit code a rank leaves with for a fallback, and the dataclasses written under
the keys. Nothing here talks to a store; callers pass a `KVStore` (agents) or a torch `Store`
(workers).

All control keys live under `ftrun/` (logical keys, see `rendezvous.kv`). Worker keys of an
unmodified script live outside it and are cleared between restart-all generations.

Flow of one recovery round (generation g -> g+1 = g'):
  1. an agent sees a fault and posts a `Fault` under `fault_key(n)` (n from `FAULT_SEQ`);
  2. the controller (leader agent) writes `Plan` under `plan_key(g')`, then sets `GENERATION_KEY`;
  3. agents see the plan, push "stop" to their live workers and respawn `plan.restart_ranks`;
  4. every rank of g' posts a `RankStatus` under `status_key(g', rank)`; each agent, once all
     its local ranks did, posts them together as `NodeStatuses` under `node_statuses_key(g', n)`;
  5. the controller reads all statuses and writes a `RepairPlan` under `repair_key(g')`;
  6. ranks build process groups on `pg_prefix(g')`, transfer state src->dst, roll back or commit,
     post `resumed_key(g', rank)` and continue.
A restart-all round instead: every agent stops its workers and adds 1 to `stopped_key(g')` (the
last sets `all_stopped_key(g')`); the controller clears the worker keys and sets `go_key(g')`.
A job that ends: each agent sets `finished_key(rank)` for every rank done with the job (said
goodbye or exited 0), adds 1 to `done_key(g)` when its workers finished, then to `EXITED_KEY`
when it leaves.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

from rendezvous.nodes.keys import GENERATION_KEY, ROOT, node_key  # noqa: F401 - re-exported

FAULT_SEQ = f"{ROOT}/fault_seq"
# the next fault the controller reads: a controller elected after its predecessor's node was
# lost goes on from there (reports posted meanwhile are not skipped, decided ones not replayed)
FAULT_NEXT_KEY = f"{ROOT}/fault_next"
RESTARTS_USED_KEY = f"{ROOT}/restarts_used"  # the controller's budget, kept across leader changes
WORLD_SIZE_KEY = (
    f"{ROOT}/world_size"  # set by the leader agent; `ftctl inject` checks ranks against it
)
EXITED_KEY = f"{ROOT}/exited"  # agents that left after a successful job

# A runtime-aware rank exits with this code when the repair plan fell back (restart-all or dump):
# the agent does not count it as a fault.
EXIT_FALLBACK = 75

# Strategies, cheapest first (issue: fault taxonomy and strategy chain).
RETRY = "retry"
RECOVER_IN_PLACE = "recover-in-place"
# live shrink: the failed ranks' data-parallel replicas leave the world, the others continue at
# the interrupted step in a smaller world (no restart, no checkpoint read; issue 33)
ELASTIC = "elastic-training"
RESTART_ALL = "restart-all"
DUMP = "dump"
EXIT = "exit"
STRATEGIES = (RETRY, RECOVER_IN_PLACE, ELASTIC, RESTART_ALL, DUMP, EXIT)
# live grow back after a live shrink: the dropped ranks' returning processes join and receive
# their replica's state; every rank rebuilds the full world at a step boundary. The controller's
# own round (launcher.control.grow), not a strategy of the chain
GROW = "elastic-grow"
# a hot switch (sub-health): ranks of a suspect node move to new processes at a step boundary,
# no fault, no rollback; the controller's own round (launcher.control.hot_switch), not charged
SWITCH = "hot-switch"


def plan_key(generation: int) -> str:
    return f"{ROOT}/plan/{generation}"


def fault_key(seq: int) -> str:
    return f"{ROOT}/fault/{seq}"


def status_key(generation: int, rank: int) -> str:
    return f"{ROOT}/g{generation}/status/{rank}"


def node_statuses_key(generation: int, node: int) -> str:
    """Set by node `node`'s agent once every local rank of generation `generation`'s round
    posted its status: those statuses as one `NodeStatuses` (the controller waits on one key
    per node, not one per rank)."""
    return f"{ROOT}/g{generation}/node_statuses/{node}"


def repair_key(generation: int) -> str:
    return f"{ROOT}/g{generation}/repair"


def resumed_key(generation: int, rank: int) -> str:
    return f"{ROOT}/g{generation}/resumed/{rank}"


def pg_prefix(generation: int) -> str:
    """Store prefix the process groups of generation `generation` are built on."""
    return f"{ROOT}/g{generation}/pg"


def stopped_key(generation: int) -> str:
    """Counter: nodes that stopped all their workers for a restart-all round."""
    return f"{ROOT}/g{generation}/stopped"


def all_stopped_key(generation: int) -> str:
    """Set by the last node to stop its workers for a restart-all round."""
    return f"{ROOT}/g{generation}/stopped_all"


def go_key(generation: int) -> str:
    """Set by the controller: the workers of a restart-all round may start."""
    return f"{ROOT}/g{generation}/go"


def skip_init_key(rank: int) -> str:
    """Whether a replacement of `rank` may skip its random parameter init: "harmless", or why
    not; set at the first step of a start that ran its init (launcher.runtime.skip_init)."""
    return f"{ROOT}/skip_init/{rank}"


def aware_key(rank: int) -> str:
    """Set when `rank` said hello on the worker channel: it uses launcher.runtime."""
    return f"{ROOT}/aware/{rank}"


def done_key(generation: int) -> str:
    """Counter: nodes whose workers all finished in generation `generation`."""
    return f"{ROOT}/done/{generation}"


FINISHED_PREFIX = f"{ROOT}/finished/"


def finished_key(rank: int) -> str:
    """Set by `rank`'s agent when its process is done with the job (it said goodbye after
    `rt.finish()`, or exited 0): the generation that process was started in. A finished rank
    takes part in no recovery round of that process's life (the controller, `decision`)."""
    return f"{FINISHED_PREFIX}{rank}"


def ckpt_key(generation: int, iteration: int, shard: str) -> str:
    """Set by a checkpoint writer once its shard file of `iteration` is durable."""
    return f"{ROOT}/g{generation}/ckpt/{iteration}/{shard}"


INJECT_SEQ = f"{ROOT}/inject_seq"
STORE_ADDR_FILE = "store.json"  # in the run log dir: where `ftctl` finds a live job's store


def inject_key(seq: int) -> str:
    """A fault-injection request from `ftctl inject` (a `Injection` record)."""
    return f"{ROOT}/inject/{seq}"


# `ftctl pause` / `ftctl resume` (launcher.cli.pause, launcher.runtime.pause): the latest
# request is a `PauseRequest` under PAUSE_KEY; agents hear of it through an `Injection` of kind
# PAUSE_KIND for rank -1 (every rank) on the inject sequence and tell their ranks on the channel
PAUSE_SEQ = f"{ROOT}/pause_seq"
PAUSE_KEY = f"{ROOT}/pause/current"
PAUSE_KIND = "pause"
EVERY_RANK = -1  # an Injection's rank: every rank of the job


def pause_at_key(seq: int, rank: int) -> str:
    """The first step `rank` can still halt after (it has not ended it) when it heard of pause
    `seq`: every rank halts after the largest of these."""
    return f"{ROOT}/pause/{seq}/at/{rank}"


def pause_step_key(seq: int) -> str:
    """The step every rank halts after for pause `seq` (set once the ranks agreed)."""
    return f"{ROOT}/pause/{seq}/step"


def pause_halted_key(seq: int, rank: int) -> str:
    """Set by `rank` when it halted for pause `seq` (the step it halted after): a world grow
    waits for every rank's before it stops them at that step boundary."""
    return f"{ROOT}/pause/{seq}/halted/{rank}"


def resume_key(seq: int) -> str:
    """Why pause `seq` ended ("ftctl resume", "expired ...", "abandoned: ..."): set once, the
    first writer wins (compare_set); every paused rank continues when it appears."""
    return f"{ROOT}/pause/{seq}/resume"


# `ftctl migrate` and the sub-health file (launcher.cli.migrate, launcher.agent.subhealth): a
# `MigrateRequest` per MIGRATE_SEQ number; the controller answers each under migrate_outcome_key.
# The switch it starts is a `SwitchOrder` under SWITCH_KEY; agents hear of it through an
# `Injection` of kind SWITCH_KIND for every rank (as a pause) and start the incoming processes
MIGRATE_SEQ = f"{ROOT}/migrate_seq"
SWITCH_KEY = f"{ROOT}/switch/current"
SWITCH_KIND = "switch"


def migrate_key(seq: int) -> str:
    """Migrate request `seq` (a `MigrateRequest`)."""
    return f"{ROOT}/migrate/{seq}"


def migrate_outcome_key(seq: int) -> str:
    """How migrate request `seq` ended (a `SwitchOutcome`), set once by the controller."""
    return f"{ROOT}/migrate/{seq}/outcome"


def switch_ended_key(seq: int) -> str:
    """Why switch `seq` cannot be made, as an agent saw it (an incoming process ended): the
    controller abandons the switch (first writer wins)."""
    return f"{ROOT}/switch/{seq}/failed"


def node_status_key(node_rank: int) -> str:
    """A node's live status (JSON, `launcher.observe.observer`), refreshed every second for
    `ftctl status`."""
    return f"{ROOT}/observe/node/{node_rank}"


def progress_key(node: int) -> str:
    """A node's per-rank progress records (`launcher.control.progress`), read by the
    controller's blame."""
    return f"{ROOT}/progress/{node}"


def replica_key(rank: int) -> str:
    """Where a runtime-aware rank publishes the shard it holds (see RankStatus.shard)."""
    return f"{ROOT}/replica/{rank}"


def grad_syncs_key(rank: int) -> str:
    """Where a rank records its gradient syncs, for its replacement to install before its
    first backward (launcher.runtime.grad_sync_plan)."""
    return f"{ROOT}/grad_syncs/{rank}"


class _Record:
    """JSON (de)serialisation shared by the records below."""

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> Any:
        return cls.from_dict(json.loads(raw))

    @classmethod
    def from_dict(cls, data: dict) -> Any:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class Fault(_Record):
    """One observed fault. `kind` is one of launcher.protocol.faults.FaultKind values."""

    kind: str
    rank: int | None
    node: int
    generation: int
    message: str = ""
    exitcode: int | None = None
    signal: str | None = None
    pid: int | None = None
    local_rank: int | None = None
    host: str = ""
    time: float = field(default_factory=time.time)
    injected: bool = False
    evidence: dict = field(default_factory=dict)
    # the reporting agent (group rank, incarnation): the controller refuses a report of an agent
    # that is no longer a member (cut off, declared dead, replaced): a stale node's write
    by_node: int | None = None
    by_incarnation: int = 0


@dataclass
class Injection(_Record):
    """`ftctl inject`: make rank `rank` suffer fault `kind` (at `step`/`phase` when given)."""

    rank: int
    kind: str
    step: int | None = None
    phase: str | None = None
    time: float = field(default_factory=time.time)


@dataclass
class PauseRequest(_Record):
    """`ftctl pause`: every rank halts at the end of a step (the same step on every rank, no
    rollback) and waits until `resume_key(seq)` is set, or `max_s` seconds after `time`."""

    seq: int
    max_s: float
    time: float = field(default_factory=time.time)


@dataclass
class MigrateRequest(_Record):
    """`ftctl migrate` or a node's sub-health file: move `ranks` (or every rank of `node`) to
    new processes with no fault and no rollback (a hot switch)."""

    seq: int
    ranks: list[int] = field(default_factory=list)
    node: int | None = None
    source: str = "ftctl"  # "ftctl", or "subhealth" (a device plugin's file)
    why: str = ""
    time: float = field(default_factory=time.time)


@dataclass
class SwitchOrder(_Record):
    """The controller's hot switch `seq`: each agent starts an incoming process for its ranks
    among `ranks`, for generation `generation` (the switch's round)."""

    seq: int
    generation: int
    ranks: list[int] = field(default_factory=list)


@dataclass
class SwitchOutcome(_Record):
    """How a migrate request ended: "done" (moved; `cost_s`: the ranks held from the halt
    request to the repair plan), "refused" or "abandoned" (the ranks keep running where they
    were; `why`)."""

    seq: int
    outcome: str
    why: str = ""
    ranks: list[int] = field(default_factory=list)
    generation: int = 0
    cost_s: float = 0.0


@dataclass
class Plan(_Record):
    """What generation `generation` is: decided by the controller, executed by agents/workers."""

    generation: int
    strategy: str
    failed_ranks: list[int] = field(default_factory=list)
    restart_ranks: list[int] = field(default_factory=list)
    reason: str = ""
    root_cause: dict | None = None  # a Fault as dict
    restarts_used: int = 0
    # every fault of the job so far, in order (this round's last): its rank, kind, node,
    # message, "handling" ([strategy, generation] pairs tried) and "outcome" (in progress,
    # recovered, restarted, superseded by ..., failed)
    history: list[dict] = field(default_factory=list)
    # restart-all in a new world: the rendezvous round (rendezvous.nodes.rounds) every agent rejoins
    # (without the lost node(s), or with the agents waiting to get in: scale_up=restart), then
    # restarts its workers; 0 = the same world
    new_round: int = 0


@dataclass
class RankStatus(_Record):
    """A rank's report after it stopped (survivor) or started (replacement) in generation g'."""

    rank: int
    generation: int
    replacement: bool
    committed_step: int  # last step whose optimizer update completed; -1 = none
    step: int  # step the rank was executing (or about to start)
    dirty: bool = False  # stopped inside an optimizer update: its state must be repaired
    shard: str = ""  # replica identity: ranks with equal shard hold equal state
    pid: int = 0
    host: str = ""
    # the rank can continue in a smaller world (elastic-training: native loop, plain data
    # parallelism, no rt.ddp, no framework hooks, no user groups)
    shrinkable: bool = False


@dataclass
class NodeStatuses(_Record):
    """One node's agent speaking for its ranks in generation `generation`'s round: the
    `RankStatus` records (as dicts) of the local ranks it runs in that round."""

    generation: int
    node: int
    statuses: list[dict] = field(default_factory=list)

    def ranks(self) -> dict[int, RankStatus]:
        names = {f.name for f in dataclasses.fields(RankStatus)}  # once, not once per rank
        out = {}
        for d in self.statuses:
            st = RankStatus(**(d if d.keys() <= names else {k: d[k] for k in d if k in names}))
            out[st.rank] = st
        return out


@dataclass
class RepairPlan(_Record):
    """The controller's answer to the statuses: who sends state to whom, where to resume."""

    generation: int
    resume_step: int
    action: str  # "commit" or "rollback" (of the step that was interrupted)
    pairs: list[list[int]] = field(default_factory=list)  # [src, dst]
    fallback: str | None = None  # set when peer repair is impossible: the strategy to use
    reason: str = ""
    writers: dict[str, int] = field(default_factory=dict)  # dump: the rank saving each shard
    # elastic-training: the ranks of the new world (original rank numbers, in group-rank
    # order); empty: the world is unchanged
    world: list[int] = field(default_factory=list)
