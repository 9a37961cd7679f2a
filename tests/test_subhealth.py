"""launcher/agent/subhealth.py: the sub-health file's format (`parse_subhealth`), the agent's
watch (a new subhealthy content is one migrate request; the content found at the start, the
same content again, a healthy state and a bad file are none, the bad file one line), the
config's one-line refusal of a path that cannot be a file; and end to end: a live 4-rank job
whose sub-health file names local rank 2 moves that rank to a new process (no fault, no
rollback, bit-identical parameters)."""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers_faults import LiveJob, assert_same_params
from helpers_launch import FTRUN, env_with
from test_migrate import STEPS, ref  # noqa: F401 (the fault-free run, a fixture)

from launcher.agent.subhealth import Subhealth, SubhealthWatch, parse_subhealth, post_migrate
from launcher.config import ConfigError, parse_subhealth_file
from launcher.observe.logs import AgentLog, read_event_file
from launcher.protocol import plan as P
from rendezvous.store.memory import LocalKV


@pytest.mark.parametrize(
    "text, report, bad",
    [
        ('{"state": "subhealthy", "local_ranks": [2, 1, 2], "reason": "ecc"}', ((1, 2), "ecc"), ""),
        ('{"state": "subhealthy"}', (None, ""), ""),
        ('{"state": "subhealthy", "local_ranks": "all", "reason": "hbm"}', (None, "hbm"), ""),
        ('{"state": "healthy", "local_ranks": [1]}', None, ""),
        ("not json", None, "not JSON"),
        ("[1]", None, "not a JSON object"),
        ('{"state": "sick"}', None, "\"state\" is 'sick'; allowed: subhealthy, healthy"),
        ('{"state": "subhealthy", "local_ranks": [4]}', None, 'allowed: "all" or a list of 0..3'),
        ('{"state": "subhealthy", "local_ranks": []}', None, '"local_ranks" is []'),
        ('{"state": "subhealthy", "local_ranks": [true]}', None, '"local_ranks" is [True]'),
    ],
)
def test_the_file_format(text, report, bad) -> None:
    got, why = parse_subhealth(text, 4)
    assert got == (Subhealth(*report) if report is not None else None)
    assert (bad in why and why) if bad else why == ""


def test_a_new_subhealthy_content_is_one_request(tmp_path) -> None:
    kv, path = LocalKV(), tmp_path / "subhealth.json"
    path.write_text('{"state": "subhealthy", "local_ranks": [0]}')  # there at the start
    log = AgentLog(1, str(tmp_path / "events.jsonl"), quiet=True)
    watch = SubhealthWatch(str(path), kv, node=1, rank_base=4, nproc=4, log=log)
    watch.start()
    watch.stop()
    assert watch.check() is None and kv.try_get(P.MIGRATE_SEQ) is None  # not news
    path.write_text('{"state": "subhealthy", "local_ranks": [1, 3], "reason": "ecc"}')
    seq = watch.check()
    req = P.MigrateRequest.from_json(kv.get(P.migrate_key(seq), 1.0))
    assert (req.ranks, req.node, req.source) == ([5, 7], None, "subhealth")
    assert req.why == f"{path}: ecc"
    assert watch.check() is None  # the same content: no second request
    path.write_text('{"state": "healthy"}')
    assert watch.check() is None
    path.write_text('{"state": "subhealthy"}')  # the whole node
    req = P.MigrateRequest.from_json(kv.get(P.migrate_key(watch.check()), 1.0))
    assert (req.ranks, req.node) == ([], 1)
    path.write_text("{oops")
    assert watch.check() is None
    lines = [
        e for e in read_event_file(str(tmp_path / "events.jsonl")) if e["event"] == "subhealth"
    ]
    assert (
        len(lines) == 3 and "not JSON" in lines[-1]["message"] and "ignored" in lines[-1]["message"]
    )
    assert post_migrate(kv, [2, 2], None, "ftctl", "x") == 3  # numbered after the file's


def test_the_config_takes_a_file_path_and_refuses_a_directory(tmp_path) -> None:
    f = tmp_path / "sh.json"
    assert parse_subhealth_file({"subhealth_file": str(f)}, {}) == str(f)
    assert parse_subhealth_file({}, {"FTRUN_SUBHEALTH_FILE": str(f)}) == str(f)
    assert parse_subhealth_file({}, {}) == ""
    with pytest.raises(ConfigError, match="FTRUN_SUBHEALTH_FILE="):
        parse_subhealth_file({}, {"FTRUN_SUBHEALTH_FILE": str(tmp_path / "no" / "x.json")})
    with pytest.raises(ConfigError, match="--rdzv-conf subhealth_file=.*a directory"):
        parse_subhealth_file({"subhealth_file": str(tmp_path)}, {})
    script = tmp_path / "x.py"
    script.write_text("pass\n")
    res = subprocess.run(
        FTRUN + ["--nproc_per_node", "1", "--rdzv-conf", f"subhealth_file={tmp_path}", str(script)],
        env=env_with(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "subhealth_file" in lines[0], res.stderr


def test_a_subhealth_file_moves_its_rank_live(tmp_path, ref) -> None:
    path = tmp_path / "subhealth.json"
    job = LiveJob(
        tmp_path,
        launcher_args=["--rdzv-conf", f"subhealth_file={path}"],
        script_args=["--step-time", "0.3"],
        steps=STEPS,
    )
    try:
        job.wait_for("hello", 4)
        pids = {e["rank"]: e["pid"] for e in job.wait_for("spawn", 4)}
        path.write_text(json.dumps({"state": "subhealthy", "local_ranks": [2], "reason": "ecc"}))
        done = job.wait_for("switch-done", 1, timeout=60)[0]
    finally:
        result = job.finish()
    assert result.returncode == 0, result.describe()
    assert done["moved"] == [2] and result.strategies() == [P.SWITCH]
    assert result.restarted() == {2: 1}
    assert {r: p[0] for r, p in result.pids.items()} == pids
    start = result.first("switch-start")
    assert start["source"] == "subhealth" and "ecc" in start["message"]
    assert_same_params(result.params, ref)
