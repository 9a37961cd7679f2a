"""Where a hot switch in progress stands (launcher.observe.switch_state), and `ftctl status`
saying it: each stage from the store keys the controller and the agents write."""

from __future__ import annotations

import json

from click.testing import CliRunner

from launcher.observe import status as status_mod
from launcher.observe.switch_state import (
    HALTING,
    REQUESTED,
    STARTING,
    SWITCHING,
    switch_state,
)
from launcher.protocol import plan as P
from rendezvous.store.memory import LocalKV

T0 = 1_000.0


def request(kv, ranks=(1,), node=None, t: float = T0) -> int:
    seq = kv.add(P.MIGRATE_SEQ, 1)
    req = P.MigrateRequest(seq=seq, ranks=list(ranks), node=node, time=t)
    kv.set(P.migrate_key(seq), req.to_json())
    return seq


def pause(kv, step: int | None = None, t: float = T0 + 1) -> int:
    seq = kv.add(P.PAUSE_SEQ, 1)
    kv.set(P.PAUSE_KEY, P.PauseRequest(seq=seq, max_s=300.0, time=t).to_json())
    if step is not None:
        kv.set(P.pause_step_key(seq), str(step).encode())
    return seq


def status(rank: int, g: int) -> P.RankStatus:
    return P.RankStatus(rank, g, True, -1, -1, shard="dp")


def test_a_switch_in_progress_in_each_stage_then_none_once_answered() -> None:
    kv = LocalKV()
    assert switch_state(kv) is None
    seq = request(kv, node=1, ranks=())
    s = switch_state(kv)
    assert (s.seq, s.stage, s.node) == (seq, REQUESTED, 1)
    assert s.describe(now=T0 + 2).startswith("hot switch #1 (ftctl, node 1, requested 2.0s ago)")
    assert "requested, not taken yet" in s.describe()
    # the controller takes it: the new processes start (one of two ready)
    kv.set(P.SWITCH_KEY, P.SwitchOrder(seq=seq, generation=3, ranks=[2, 3]).to_json())
    kv.set(P.status_key(3, 2), status(2, 3).to_json())
    s = switch_state(kv)
    assert (s.stage, s.ranks, s.generation, s.ready) == (STARTING, [2, 3], 3, 1)
    assert "waiting for the new processes (1 of 2 ready" in s.describe()
    # an older pause (before the request) is not the switch's halt
    kv.set(P.PAUSE_KEY, P.PauseRequest(seq=9, max_s=60.0, time=T0 - 5).to_json())
    assert switch_state(kv).stage == STARTING
    # ready: the controller halts every rank; they agree on step 7
    pause(kv, step=7)
    s = switch_state(kv)
    assert (s.stage, s.halt_step) == (HALTING, 7)
    assert s.describe().endswith("halting every rank at a step boundary (after step 7)")
    # the switch round is published
    kv.set(P.plan_key(3), P.Plan(generation=3, strategy=P.SWITCH, restart_ranks=[2, 3]).to_json())
    s = switch_state(kv)
    assert (s.stage, s.generation, s.halt_step) == (SWITCHING, 3, 7)
    assert "switching in generation 3: halted after step 7" in s.describe()
    # a second request waits behind it
    request(kv, ranks=[0], t=T0 + 3)
    assert switch_state(kv).seq == seq and switch_state(kv).waiting == 1
    assert switch_state(kv).describe().endswith("; 1 more request(s) queued")
    # answered: the first is no longer in progress, the second is requested
    kv.set(P.migrate_outcome_key(seq), P.SwitchOutcome(seq, "done").to_json())
    s = switch_state(kv)
    assert (s.seq, s.stage, s.ranks) == (2, REQUESTED, [0])
    kv.set(P.migrate_outcome_key(2), P.SwitchOutcome(2, "refused", "x").to_json())
    assert switch_state(kv) is None


def test_ftctl_status_says_the_switch_in_progress_after_its_source(monkeypatch) -> None:
    """A live job's status (through its store): the switch's stage in the header's source (and
    --json's `source`); its halt is said once, as the switch's, not as a separate pause."""
    kv = LocalKV()
    kv.close = lambda: None  # the test keeps using it
    monkeypatch.setattr(status_mod, "connect", lambda addr, token: kv)
    job = {"run_id": "r", "script": "train.py", "world_size": 4, "nnodes": 1, "outcome": "running"}
    kv.set(P.node_status_key(0), json.dumps({"node": 0, "leader": True, "job": job}).encode())
    seq = request(kv)
    kv.set(P.SWITCH_KEY, P.SwitchOrder(seq=seq, generation=1, ranks=[1]).to_json())
    pause(kv, t=T0 + 1)  # the switch's halt, not agreed yet

    def shown() -> str:
        out = CliRunner().invoke(status_mod.status, ["--addr", "h:1", "--json"])
        assert out.exit_code == 0, out.output
        return json.loads(out.output)["source"]

    said = shown()
    assert said.startswith("live, store h:1; hot switch #1 (ftctl, ranks [1], requested")
    assert "halting every rank at a step boundary" in said and "pausing" not in said
    kv.set(P.resume_key(1), b"abandoned: hot switch #1: x")
    assert "waiting for the new processes (0 of 1 ready" in shown()
    kv.set(P.migrate_outcome_key(seq), P.SwitchOutcome(seq, "abandoned", "x").to_json())
    assert shown() == "live, store h:1"
