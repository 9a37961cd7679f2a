"""Launch environment parsing."""

from __future__ import annotations

import pytest

from launcher.runtime.env import RuntimeEnv

BASE = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


def test_torchrun_environment_means_unmanaged():
    env = RuntimeEnv.from_environ(BASE)
    assert (
        not env.managed
        and env.generation == 0
        and not env.replacement
        and env.store_timeout == 300.0
    )


def test_ftrun_environment():
    env = RuntimeEnv.from_environ(
        {
            **BASE,
            "FTRUN_AGENT_SOCKET": "/tmp/a.sock",
            "FTRUN_GENERATION": "3",
            "FTRUN_REPLACEMENT": "1",
            "FTRUN_STORE_TIMEOUT": "12.5",
            "FTRUN_RUN_ID": "r",
            "FTRUN_NODE_RANK": "2",
        }
    )
    assert env.managed and env.generation == 3 and env.replacement and env.store_timeout == 12.5
    assert env.node_rank == 2 and env.run_id == "r"
    assert env.skip_init and not RuntimeEnv.from_environ({**BASE, "FTRUN_SKIP_INIT": "0"}).skip_init
    assert (
        env.ddp_comm == "reducer"
        and RuntimeEnv.from_environ({**BASE, "FTRUN_DDP_COMM": "hook"}).ddp_comm == "hook"
    )
    assert env.stop_points
    assert not RuntimeEnv.from_environ({**BASE, "FTRUN_STOP_POINTS": "0"}).stop_points


@pytest.mark.parametrize(
    "change,match",
    [
        ({"RANK": "4"}, "RANK=4 must be < WORLD_SIZE=4"),
        ({"RANK": "x"}, "RANK='x' is not an integer"),
        ({"FTRUN_REPLACEMENT": "yes"}, "FTRUN_REPLACEMENT='yes'"),
        ({"FTRUN_SKIP_INIT": "off"}, "FTRUN_SKIP_INIT='off'"),
        ({"FTRUN_DDP_COMM": "nccl"}, "FTRUN_DDP_COMM='nccl'; allowed: reducer, hook"),
        ({"FTRUN_STOP_POINTS": "yes"}, "FTRUN_STOP_POINTS='yes'; allowed: '0' or '1'"),
        ({"FTRUN_STORE_TIMEOUT": "0"}, "FTRUN_STORE_TIMEOUT=0.0 must be > 0"),
        ({"MASTER_ADDR": ""}, "MASTER_ADDR is not set"),
    ],
)
def test_bad_values_are_named(change, match):
    with pytest.raises(ValueError, match=match):
        RuntimeEnv.from_environ({**BASE, **change})


def test_missing_world_size():
    with pytest.raises(ValueError, match="WORLD_SIZE is not set"):
        RuntimeEnv.from_environ({"RANK": "0"})


def test_a_replacement_knows_when_it_began_running_the_script() -> None:
    """Issue 32 (the start-up split): a warm spare's assignment time (FTRUN_EXEC_TIME), else the
    process's own start (a cold replacement: its interpreter's start, before now)."""
    import time

    from launcher.runtime.env import exec_time, process_start_time

    base = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    env = RuntimeEnv.from_environ({**base, "FTRUN_REPLACEMENT": "1", "FTRUN_EXEC_TIME": "12.5"})
    assert env.exec_time == 12.5
    assert RuntimeEnv.from_environ({**base, "FTRUN_REPLACEMENT": "0"}).exec_time is None
    started = process_start_time()
    assert started is not None and 0 <= time.time() - started < 3600
    assert exec_time({}) == started and exec_time({"FTRUN_EXEC_TIME": "x"}) == started
