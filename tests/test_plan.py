"""The recovery protocol's vocabulary: records survive the store byte-exact, keys are stable."""

from __future__ import annotations

import dataclasses
import json

import pytest

from launcher.protocol import plan as P


@pytest.mark.parametrize(
    "record",
    [
        P.Fault(
            kind="uce-low",
            rank=3,
            node=1,
            generation=2,
            message="m",
            exitcode=None,
            pid=42,
            local_rank=1,
            host="h",
            time=12.5,
            injected=True,
            evidence={"step": 4, "repeat_uce": True},
        ),
        P.Injection(rank=1, kind="kill", step=3, phase="backward", time=1.0),
        P.Plan(
            generation=3,
            strategy=P.RECOVER_IN_PLACE,
            failed_ranks=[1, 2],
            restart_ranks=[2],
            reason="r",
            root_cause={"kind": "signal", "rank": 2},
            restarts_used=2,
        ),
        P.RankStatus(
            rank=1,
            generation=3,
            replacement=True,
            committed_step=-1,
            step=-1,
            dirty=False,
            shard="dp",
            pid=7,
            host="h",
        ),
        P.RepairPlan(
            generation=3,
            resume_step=8,
            action="rollback",
            pairs=[[0, 1]],
            fallback=None,
            reason="why",
        ),
        P.RepairPlan(
            generation=4,
            resume_step=8,
            action="rollback",
            fallback=P.DUMP,
            writers={"tp0": 0, "tp1": 1},
        ),
    ],
)
def test_records_round_trip_through_json(record) -> None:
    raw = record.to_json()
    assert isinstance(raw, bytes)
    back = type(record).from_json(raw)
    assert back == record and type(back) is type(record)
    assert type(record).from_json(raw.decode()) == record  # a str (torch store values) works too


def test_unknown_fields_from_another_version_are_ignored() -> None:
    data = json.loads(P.Plan(generation=1, strategy=P.EXIT).to_json())
    data["max_restarts"] = 3  # a field older versions wrote
    assert P.Plan.from_json(json.dumps(data)) == P.Plan(generation=1, strategy=P.EXIT)
    assert "max_restarts" not in {f.name for f in dataclasses.fields(P.Plan)}


def test_json_is_canonical() -> None:
    a = P.RankStatus(rank=1, generation=2, replacement=False, committed_step=3, step=4)
    assert a.to_json() == P.RankStatus.from_json(a.to_json()).to_json()
    assert list(json.loads(a.to_json())) == sorted(json.loads(a.to_json()))


def test_every_control_key_lives_under_the_root_and_names_its_generation() -> None:
    keys = [
        P.GENERATION_KEY,
        P.FAULT_SEQ,
        P.INJECT_SEQ,
        P.RESTARTS_USED_KEY,
        P.WORLD_SIZE_KEY,
        P.EXITED_KEY,
        P.plan_key(3),
        P.fault_key(3),
        P.status_key(3, 1),
        P.repair_key(3),
        P.resumed_key(3, 1),
        P.pg_prefix(3),
        P.node_key(1),
        P.inject_key(2),
        P.replica_key(1),
        P.stopped_key(3),
        P.all_stopped_key(3),
        P.go_key(3),
        P.aware_key(1),
        P.done_key(3),
        P.ckpt_key(3, 10, "mp_rank_00"),
    ]
    assert all(k.startswith(P.ROOT + "/") for k in keys)
    assert len(set(keys)) == len(keys)
    per_round = [
        P.status_key(3, 1),
        P.repair_key(3),
        P.resumed_key(3, 1),
        P.pg_prefix(3),
        P.stopped_key(3),
        P.all_stopped_key(3),
        P.go_key(3),
        P.ckpt_key(3, 10, "s"),
    ]
    assert all(k.startswith(f"{P.ROOT}/g3/") for k in per_round)
    assert P.status_key(3, 1) != P.status_key(31, 1) and P.status_key(1, 31) != P.status_key(13, 1)


def test_keys_are_the_wire_format_agents_of_one_job_share() -> None:
    # Changing these strands running jobs and ftctl: they are part of the protocol.
    assert P.plan_key(2) == "ftrun/plan/2" and P.fault_key(5) == "ftrun/fault/5"
    assert P.status_key(2, 1) == "ftrun/g2/status/1" and P.repair_key(2) == "ftrun/g2/repair"
    assert P.stopped_key(2) + "_all" == P.all_stopped_key(2)
    assert P.WORLD_SIZE_KEY == "ftrun/world_size" and P.GENERATION_KEY == "ftrun/generation"


def test_strategies_and_the_fallback_exit_code() -> None:
    assert P.STRATEGIES == (
        P.RETRY,
        P.RECOVER_IN_PLACE,
        P.ELASTIC,
        P.RESTART_ALL,
        P.DUMP,
        P.EXIT,
    )
    assert (
        P.EXIT_FALLBACK not in (0, 1, 2) and 0 < P.EXIT_FALLBACK < 128
    )  # not a signal, not torchrun's


def test_node_statuses_round_trip_and_ignore_fields_they_do_not_know() -> None:
    a = P.RankStatus(4, 2, False, 7, 8, shard="dp", host="h")
    b = dict(P.RankStatus(5, 2, True, -1, -1, shard="dp").__dict__, later_field=1)
    rec = P.NodeStatuses.from_json(P.NodeStatuses(2, 1, [a.__dict__, b]).to_json())
    assert (rec.generation, rec.node) == (2, 1)
    got = rec.ranks()
    assert got[4] == a and got[5].replacement and got[5].committed_step == -1
    assert P.node_statuses_key(2, 1) == "ftrun/g2/node_statuses/1"
