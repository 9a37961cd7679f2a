"""LaunchConfig resolution: torchrun's hidden rules, ftrun's additions, clear errors."""

from __future__ import annotations

import re

import pytest

from launcher.cli.ftrun import parse
from launcher.config import (
    ConfigError,
    build_config,
    parse_death_notice,
    parse_hang_policy,
    parse_metrics_port,
    parse_switch,
    strategy_from_seed_env,
)
from launcher.protocol import plan as P
from tests.helpers_launch import FTRUN, env_with, run, script

SCRIPT = __file__


def cfg(*args: str, env: dict | None = None):
    return build_config(parse([*args, SCRIPT]), env=env or {})


def test_single_node_auto_switch_uses_a_private_port() -> None:
    c = cfg("--nproc_per_node", "2")
    assert c.store_port == 0 and c.master_addr_for_workers == "localhost" and c.rdzv_id != "none"


def test_static_multi_node_uses_master_addr_and_port() -> None:
    c = cfg(
        "--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1", "--master_port", "29555"
    )
    assert (c.store_host, c.store_port, c.node_rank, c.is_store_host) == (
        "10.0.0.1",
        29555,
        1,
        False,
    )
    assert c.proxy  # on by default with more than one node


def test_proxy_can_be_turned_off_and_tiered_flag_turns_it_on() -> None:
    assert not cfg("--nnodes", "2", "--node_rank", "1", "--rdzv_conf", "proxy=false").proxy
    assert cfg("--enable_tiered_parallel_tcpstore", "true").proxy


def test_etcd_needs_endpoint_and_maps_v2() -> None:
    with pytest.raises(ConfigError, match="--rdzv-endpoint is required"):
        cfg("--rdzv_backend", "etcd")
    c = cfg("--rdzv_backend", "etcd-v2", "--rdzv_endpoint", "127.0.0.1:2379")
    assert c.store_backend == "etcd" and any("v3" in n for n in c.notes)


def test_strategy_parsing_and_aliases() -> None:
    c = cfg("--recover_strategy", "recover,elastic-training")
    # elastic-training is a strategy of its own (a live shrink), restart-all its fallback
    assert c.recover_strategy == [P.RECOVER_IN_PLACE, P.ELASTIC, P.RESTART_ALL, P.EXIT]
    c = cfg("--recover_strategy", "elastic-training,dump")
    assert c.recover_strategy == [P.ELASTIC, P.RESTART_ALL, P.DUMP, P.EXIT]
    assert cfg().recover_strategy == [P.RETRY, P.RECOVER_IN_PLACE, P.RESTART_ALL, P.EXIT]


def test_seed_environment_variables_map_onto_the_chain() -> None:
    chain, notes = strategy_from_seed_env({"HIGH_AVAILABILITY": "dump"})
    assert chain == [P.DUMP, P.EXIT] and "HIGH_AVAILABILITY=dump" in notes[0]
    chain, _ = strategy_from_seed_env({"PROCESS_RECOVER": "on"})
    assert chain == [P.RECOVER_IN_PLACE, P.RESTART_ALL, P.EXIT]
    assert strategy_from_seed_env({})[0] is None
    with pytest.raises(ConfigError, match="HIGH_AVAILABILITY"):
        strategy_from_seed_env({"HIGH_AVAILABILITY": "maybe"})
    c = cfg(env={"HIGH_AVAILABILITY": "retry"})
    assert c.recover_strategy[0] == P.RETRY and c.notes


def test_worker_command_forms() -> None:
    c = cfg("--nproc_per_node", "1")
    assert c.worker_command(0)[1:] == ["-u", SCRIPT]
    c = build_config(parse(["-m", "some.module", "--x", "${local_rank}"]), env={})
    assert c.worker_command(3)[1:] == ["-u", "-m", "some.module", "--x", "3"]
    c = build_config(parse(["--no-python", "/bin/true"]), env={})
    assert c.worker_command(0) == ["/bin/true"]


def test_redirect_maps() -> None:
    c = cfg("--nproc_per_node", "3", "--redirects", "0:1,2:3", "--tee", "2")
    assert c.redirects == {0: 1, 1: 0, 2: 3} and c.tee == {0: 2, 1: 2, 2: 2}


def test_shutdown_timeout_env_fallback() -> None:
    assert cfg(env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}).shutdown_timeout == 7.0
    assert cfg("--shutdown_timeout", "3").shutdown_timeout == 3.0


def test_hang_timeout_is_auto_by_default_seconds_or_zero_and_bad_values_are_one_line() -> None:
    c = cfg()
    assert (
        c.hang.timeout is None and c.hang.enabled and c.hang.floor == 30.0 and c.fault_window == 2.0
    )
    assert cfg("--hang-timeout", "auto").hang.timeout is None
    assert cfg("--hang_timeout", "45").hang.step_timeout([1.0]) == 45.0
    assert not cfg("--hang-timeout", "0").hang.enabled
    for bad, why in (
        ("x", "is not 'auto' or a number"),
        ("-1", "must be 'auto', 0 (off)"),
        ("inf", "must be 'auto', 0 (off)"),
    ):
        with pytest.raises(ConfigError, match=re.escape(f"--hang-timeout: '{bad}' {why}")):
            cfg("--hang-timeout", bad)
    c = cfg(
        env={"FTRUN_HANG_FLOOR": "2", "FTRUN_HANG_MULTIPLIER": "5", "FTRUN_FAULT_WINDOW": "0.5"}
    )
    assert (c.hang.floor, c.hang.multiplier, c.fault_window) == (2.0, 5.0, 0.5)
    with pytest.raises(ConfigError, match="^FTRUN_HANG_FLOOR='0' must be > 0"):
        cfg(env={"FTRUN_HANG_FLOOR": "0"})
    assert cfg().transfer_stripes == 0  # auto: one sending replica per node
    assert cfg(env={"FTRUN_TRANSFER_STRIPES": "Auto"}).transfer_stripes == 0
    assert cfg(env={"FTRUN_TRANSFER_STRIPES": "3"}).transfer_stripes == 3
    for bad in ("0", "two", "-1", "17"):
        with pytest.raises(
            ConfigError,
            match=f"^FTRUN_TRANSFER_STRIPES='{bad}': must be 'auto' "
            r"\(one sending replica per node\) or a whole number",
        ):
            cfg(env={"FTRUN_TRANSFER_STRIPES": bad})
    with pytest.raises(ConfigError, match="^FTRUN_FAULT_WINDOW='soon': must be seconds in 0..60"):
        cfg(env={"FTRUN_FAULT_WINDOW": "soon"})
    assert cfg(env={"FTRUN_FAULT_WINDOW": ""}).fault_window == 2.0  # empty is unset, as elsewhere


def test_hang_policy_from_the_flag_and_the_environment_with_one_line_errors() -> None:
    pol = parse_hang_policy(None, {"FTRUN_HANG_FLOOR": "2.5", "FTRUN_HANG_MULTIPLIER": "4"})
    assert (pol.floor, pol.multiplier, pol.first_step, pol.unmodified) == (2.5, 4.0, 300.0, 600.0)
    assert pol.step_timeout([1.0]) == 4.0 and pol.unmodified_timeout() == 600.0
    assert parse_hang_policy(7.0, {}).unmodified_timeout() == 7.0
    assert parse_hang_policy(None, {"FTRUN_HANG_STOP": "7"}).stop_answer == 7.0
    assert parse_hang_policy(None, {"FTRUN_HANG_FIRST_STEP": ""}).first_step == 300.0
    for name, raw in (
        ("FTRUN_HANG_FLOOR", "x"),
        ("FTRUN_HANG_MULTIPLIER", "0"),
        ("FTRUN_HANG_FIRST_STEP", "-1"),
        ("FTRUN_HANG_UNMODIFIED", "nan"),
        ("FTRUN_HANG_STOP", "0"),
    ):
        with pytest.raises(ConfigError, match=f"^{name}=.*\\(hang detection knob, seconds\\)$"):
            parse_hang_policy(None, {name: raw})
    c = cfg("--hang-timeout", "12", env={"FTRUN_HANG_UNMODIFIED": "90"})
    assert (c.hang.timeout, c.hang.unmodified, c.hang.unmodified_timeout()) == (12.0, 90.0, 12.0)


def test_metrics_port_from_rdzv_conf_then_environment() -> None:
    assert parse_metrics_port({}, {}) is None
    assert parse_metrics_port({}, {"FTRUN_METRICS_PORT": ""}) is None
    assert parse_metrics_port({}, {"FTRUN_METRICS_PORT": "9100"}) == 9100
    assert parse_metrics_port({"metrics_port": "9200"}, {"FTRUN_METRICS_PORT": "9100"}) == 9200
    assert parse_metrics_port({"metrics_port": "0"}, {}) == 0
    assert cfg().metrics_port is None
    assert cfg("--rdzv_conf", "metrics_port=9300").metrics_port == 9300
    assert cfg(env={"FTRUN_METRICS_PORT": "9100"}).metrics_port == 9100


@pytest.mark.parametrize(
    "conf,env,needle",
    [
        ({"metrics_port": "http"}, {}, "--rdzv-conf metrics_port='http'"),
        ({}, {"FTRUN_METRICS_PORT": "70000"}, "FTRUN_METRICS_PORT='70000'"),
    ],
)
def test_bad_metrics_port_names_the_setting(conf, env, needle) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle) + ": must be a port number 0-65535"):
        parse_metrics_port(conf, env)
    args = ("--rdzv_conf", f"metrics_port={conf['metrics_port']}") if conf else ()
    with pytest.raises(ConfigError, match="^" + re.escape(needle)):
        cfg(*args, env=env)


def test_progress_interval_from_the_environment_and_its_one_line_error() -> None:
    assert cfg().progress_interval == 5.0
    assert cfg(env={"FTRUN_PROGRESS_INTERVAL": "0.3"}).progress_interval == 0.3
    assert cfg(env={"FTRUN_PROGRESS_INTERVAL": ""}).progress_interval == 5.0
    for bad in ("0", "-1", "soon", "inf", "nan"):
        with pytest.raises(
            ConfigError, match=f"^FTRUN_PROGRESS_INTERVAL='{bad}': must be seconds > 0$"
        ):
            cfg(env={"FTRUN_PROGRESS_INTERVAL": bad})


def test_switches_store_accel_and_death_notice() -> None:
    for on in ("1", "on", "TRUE", "yes", " 1 "):
        assert parse_switch("FTRUN_X", on, False) is True
    for off in ("0", "off", "false", "No"):
        assert parse_switch("FTRUN_X", off, True) is False
    assert (
        parse_switch("FTRUN_X", "", True) is True and parse_switch("FTRUN_X", " ", False) is False
    )
    with pytest.raises(ConfigError, match=r"^FTRUN_X='2': must be 1 \(on\) or 0 \(off\)"):
        parse_switch("FTRUN_X", "2", True)
    c = cfg()
    assert c.store_accel and c.death_notice
    assert not cfg(env={"FTRUN_STORE_ACCEL": "0"}).store_accel
    assert not cfg(env={"FTRUN_DEATH_NOTICE": "0"}).death_notice
    # the slot ftrun gives its workers, inherited by an ftrun started inside one: on
    assert parse_death_notice("/proc/12/fd/5:64") and parse_death_notice("1")
    with pytest.raises(ConfigError, match="^FTRUN_STORE_ACCEL='fast': must be 1"):
        cfg(env={"FTRUN_STORE_ACCEL": "fast"})
    with pytest.raises(ConfigError, match="^FTRUN_DEATH_NOTICE='maybe': must be 1"):
        cfg(env={"FTRUN_DEATH_NOTICE": "maybe"})


def test_warm_spares_flag_env_and_bad_values_are_one_line() -> None:
    assert cfg().warm_spares == 2  # two faults in a row on one node both start warm
    assert cfg("--warm-spares", "0").warm_spares == 0
    assert cfg("--warm_spares", "3", env={"FTRUN_WARM_SPARES": "5"}).warm_spares == 3  # flag wins
    assert cfg(env={"FTRUN_WARM_SPARES": "5"}).warm_spares == 5
    assert (
        cfg(env={"FTRUN_WARM_SPARE": "0"}).warm_spares == 0
    )  # the older switch still turns them off
    for bad in ("-1", "9", "two", "1.5"):
        with pytest.raises(
            ConfigError,
            match=re.escape(
                f"--warm-spares: '{bad}' must be a whole number of spare processes per node in 0..8"
            ),
        ):
            cfg("--warm-spares", bad)
    with pytest.raises(ConfigError, match="^FTRUN_WARM_SPARES='x': must be"):
        cfg(env={"FTRUN_WARM_SPARES": "x"})


def test_node_replace_timeout_from_rdzv_conf_env_or_default() -> None:
    assert cfg().node_replace_timeout == 600.0
    assert cfg(env={"FTRUN_NODE_REPLACE_TIMEOUT": "12.5"}).node_replace_timeout == 12.5
    c = cfg("--rdzv_conf", "node_replace_timeout=3", env={"FTRUN_NODE_REPLACE_TIMEOUT": "12"})
    assert c.node_replace_timeout == 3.0  # the flag wins over the environment


@pytest.mark.parametrize(
    "args, env, needle",
    [
        (
            ("--rdzv_conf", "node_replace_timeout=soon"),
            {},
            "--rdzv-conf node_replace_timeout='soon': must be a number of seconds > 0",
        ),
        (
            ("--rdzv_conf", "node_replace_timeout=0"),
            {},
            "--rdzv-conf node_replace_timeout='0': must be a number of seconds > 0",
        ),
        (
            (),
            {"FTRUN_NODE_REPLACE_TIMEOUT": "-4"},
            "FTRUN_NODE_REPLACE_TIMEOUT='-4': must be a number of seconds > 0",
        ),
        (
            (),
            {"FTRUN_NODE_REPLACE_TIMEOUT": "inf"},
            "FTRUN_NODE_REPLACE_TIMEOUT='inf': must be a number of seconds > 0",
        ),
    ],
)
def test_bad_node_replace_timeout_is_one_line_naming_the_key(args, env, needle) -> None:
    with pytest.raises(ConfigError) as e:
        cfg(*args, env=env)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_wait_reschedule_timeout_is_the_same_wait_by_the_ascend_guides_name() -> None:
    """Issue 33 item 4: `wait_reschedule_timeout` (30 to 270 s, the guide's) sets the wait for a
    replacement; its default 270 s applies when elastic-training is asked for."""
    c = cfg("--rdzv_conf", "wait_reschedule_timeout=45")
    assert c.node_replace_timeout == 45.0
    assert cfg(env={"FTRUN_WAIT_RESCHEDULE_TIMEOUT": "30"}).node_replace_timeout == 30.0
    assert cfg(env={"FTRUN_WAIT_RESCHEDULE_TIMEOUT": "270"}).node_replace_timeout == 270.0
    elastic = cfg("--recover-strategy", "elastic-training")
    assert elastic.elastic_training and elastic.node_replace_timeout == 270.0
    ha = cfg(env={"HIGH_AVAILABILITY": "elastic-training"})
    assert ha.elastic_training and ha.node_replace_timeout == 270.0
    assert not cfg().elastic_training and cfg().node_replace_timeout == 600.0
    # explicit values win over the elastic default; a flag wins over the other name's variable
    c = cfg(
        "--rdzv_conf",
        "wait_reschedule_timeout=60",
        env={"FTRUN_NODE_REPLACE_TIMEOUT": "5"},
    )
    assert c.node_replace_timeout == 60.0
    c = cfg(
        "--rdzv_conf",
        "node_replace_timeout=5",
        env={"FTRUN_WAIT_RESCHEDULE_TIMEOUT": "60"},
    )
    assert c.node_replace_timeout == 5.0
    c = cfg("--recover-strategy", "elastic-training", "--rdzv_conf", "node_replace_timeout=5")
    assert c.node_replace_timeout == 5.0


@pytest.mark.parametrize(
    "args, env, needle",
    [
        (
            ("--rdzv_conf", "wait_reschedule_timeout=29"),
            {},
            "--rdzv-conf wait_reschedule_timeout='29': must be seconds from 30 to 270",
        ),
        (
            ("--rdzv_conf", "wait_reschedule_timeout=271"),
            {},
            "--rdzv-conf wait_reschedule_timeout='271': must be seconds from 30 to 270",
        ),
        (
            (),
            {"FTRUN_WAIT_RESCHEDULE_TIMEOUT": "soon"},
            "FTRUN_WAIT_RESCHEDULE_TIMEOUT='soon': must be seconds from 30 to 270",
        ),
        (
            ("--rdzv_conf", "wait_reschedule_timeout=60,node_replace_timeout=60"),
            {},
            "--rdzv-conf wait_reschedule_timeout and --rdzv-conf node_replace_timeout name the "
            "same wait",
        ),
        (
            (),
            {"FTRUN_WAIT_RESCHEDULE_TIMEOUT": "60", "FTRUN_NODE_REPLACE_TIMEOUT": "60"},
            "FTRUN_WAIT_RESCHEDULE_TIMEOUT and FTRUN_NODE_REPLACE_TIMEOUT name the same wait",
        ),
    ],
)
def test_bad_wait_reschedule_timeout_is_one_line_naming_the_key(args, env, needle) -> None:
    with pytest.raises(ConfigError) as e:
        cfg(*args, env=env)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_bad_wait_reschedule_timeout_exits_2_with_one_line() -> None:
    res = run(
        FTRUN + ["--rdzv-conf", "wait_reschedule_timeout=10", script("envdump.py")],
        env=env_with(),
    )
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "wait_reschedule_timeout='10'" in lines[0], res.stderr


def test_elastic_grow_is_on_unless_switched_off_by_flag_or_variable() -> None:
    """Issue 33 item 3: the live grow back after a live shrink; --rdzv-conf wins."""
    assert cfg().elastic_grow is True
    assert cfg(env={"FTRUN_ELASTIC_GROW": "0"}).elastic_grow is False
    assert cfg("--rdzv_conf", "elastic_grow=off").elastic_grow is False
    both = cfg("--rdzv_conf", "elastic_grow=1", env={"FTRUN_ELASTIC_GROW": "0"})
    assert both.elastic_grow is True


def test_a_bad_elastic_grow_exits_2_with_one_line_naming_it() -> None:
    with pytest.raises(ConfigError) as e:
        cfg(env={"FTRUN_ELASTIC_GROW": "maybe"})
    assert "FTRUN_ELASTIC_GROW='maybe': must be 1 (on) or 0 (off)" in str(e.value)
    res = run(FTRUN + ["--rdzv-conf", "elastic_grow=2", script("envdump.py")], env=env_with())
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--rdzv-conf elastic_grow='2'" in lines[0], res.stderr


# ---------------------------------------------------------------- spare pool and agent phases
def test_spare_fork_is_on_unless_switched_off() -> None:
    """FTRUN_SPARE_FORK (was read by the spare pool itself): 0 turns the fork server off."""
    assert cfg().spare_fork is True
    assert cfg(env={"FTRUN_SPARE_FORK": "1"}).spare_fork is True
    assert cfg(env={"FTRUN_SPARE_FORK": "0"}).spare_fork is False
    assert cfg(env={"FTRUN_SPARE_FORK": " Off "}).spare_fork is False


def test_spare_start_imports_and_learning() -> None:
    """Issue 32: when the pool starts (auto by default), the modules the spares import besides
    torch (none named by default), and whether they learn the ranks' (on by default)."""
    c = cfg()
    assert (c.spare_start, c.spare_imports, c.spare_learn) == ("auto", [], True)
    c = cfg(
        env={
            "FTRUN_SPARE_START": " Workers ",
            "FTRUN_SPARE_IMPORTS": "megatron.core, transformers,,",
            "FTRUN_SPARE_LEARN": "0",
        }
    )
    assert (c.spare_start, c.spare_imports, c.spare_learn) == (
        "workers",
        ["megatron.core", "transformers"],
        False,
    )
    assert cfg(env={"FTRUN_SPARE_START": "hello"}).spare_start == "hello"


def test_worker_start_defaults_to_auto_and_takes_fork_or_exec() -> None:
    """FTRUN_WORKER_START: how the node's ranks start (auto: forked from the fork server when the
    script imports torch; fork: whenever it can be; exec: each its own `python -u script`)."""
    assert cfg().worker_start == "auto"
    assert cfg(env={"FTRUN_WORKER_START": " Fork "}).worker_start == "fork"
    assert cfg(env={"FTRUN_WORKER_START": "exec"}).worker_start == "exec"
    assert cfg(env={"FTRUN_WORKER_START": ""}).worker_start == "auto"


def test_phase_timeout_defaults_to_120_s_and_takes_seconds() -> None:
    assert cfg().phase_timeout == 120.0
    assert cfg(env={"FTRUN_PHASE_TIMEOUT": "7.5"}).phase_timeout == 7.5


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"FTRUN_SPARE_FORK": "maybe"}, "FTRUN_SPARE_FORK='maybe': must be 1"),
        ({"FTRUN_SPARE_START": "soon"}, "FTRUN_SPARE_START='soon': must be one of auto, workers"),
        (
            {"FTRUN_WORKER_START": "spawn"},
            "FTRUN_WORKER_START='spawn': must be one of auto, fork, exec",
        ),
        ({"FTRUN_SPARE_IMPORTS": "a,b-c"}, "FTRUN_SPARE_IMPORTS='a,b-c': 'b-c' is not a module"),
        ({"FTRUN_SPARE_IMPORTS": "x..y"}, "'x..y' is not a module name"),
        ({"FTRUN_SPARE_LEARN": "maybe"}, "FTRUN_SPARE_LEARN='maybe': must be 1"),
        ({"FTRUN_PHASE_TIMEOUT": "soon"}, "FTRUN_PHASE_TIMEOUT='soon': must be a number"),
        ({"FTRUN_PHASE_TIMEOUT": "0"}, "FTRUN_PHASE_TIMEOUT='0': must be a number of seconds > 0"),
        ({"FTRUN_PHASE_TIMEOUT": "-3"}, "FTRUN_PHASE_TIMEOUT='-3': must be"),
        ({"FTRUN_PHASE_TIMEOUT": "inf"}, "FTRUN_PHASE_TIMEOUT='inf': must be"),
    ],
)
def test_bad_spare_or_phase_setting_is_one_line_naming_the_variable(env, needle) -> None:
    with pytest.raises(ConfigError) as e:
        cfg(env=env)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_job_token_is_read_and_checked_here_and_never_logged(tmp_path) -> None:
    """FTRUN_JOB_TOKEN and --rdzv-conf token_file=F are read by the config (was: by the store
    stack at start-up, after the config); a bad one is one line naming its source; the token
    stays out of what the logs and events.jsonl record (`public()`)."""
    assert cfg().job_token is None
    c = cfg(env={"FTRUN_JOB_TOKEN": " s3cret "})
    assert c.job_token == "s3cret"
    assert "job_token" not in c.public() and "s3cret" not in repr(c)
    assert "s3cret" not in str(c.public())
    token = tmp_path / "token"
    token.write_text("from-file\n")
    token.chmod(0o600)
    from_file = cfg("--rdzv-conf", f"token_file={token}", env={"FTRUN_JOB_TOKEN": "ignored"})
    assert from_file.job_token == "from-file"
    token.chmod(0o644)
    with pytest.raises(ConfigError, match=r"^--rdzv-conf token_file=.*has mode 0644") as e:
        cfg("--rdzv-conf", f"token_file={token}")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^FTRUN_JOB_TOKEN: job token of 5000 bytes"):
        cfg(env={"FTRUN_JOB_TOKEN": "x" * 5000})
