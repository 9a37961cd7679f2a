"""Tests for rendezvous.nodes.settings: torchrun's --rdzv-conf names, defaults and one-line
errors."""

from __future__ import annotations

import pytest

from rendezvous.nodes.settings import RendezvousSettings


def test_defaults_and_torchrun_names() -> None:
    s = RendezvousSettings()
    assert (s.join_timeout, s.last_call_timeout, s.close_timeout, s.read_timeout) == (
        600.0,
        30.0,
        30.0,
        60.0,
    )
    assert s.liveness_timeout == 5.0 and s.spare_timeout is None
    s = RendezvousSettings.from_rdzv_conf(
        {
            "join_timeout": "20",
            "last_call_timeout": "2.5",
            "close_timeout": 3,
            "read_timeout": "7",
            "keep_alive_interval": "0.5",
            "keep_alive_max_attempt": "4",
            "is_host": "true",
            "cacert": "/x",
        }
    )
    assert (s.join_timeout, s.last_call_timeout, s.close_timeout, s.read_timeout) == (
        20.0,
        2.5,
        3.0,
        7.0,
    )
    assert s.liveness_timeout == 2.0
    assert (
        RendezvousSettings.from_rdzv_conf(
            {"heartbeat_timeout": "3", "keep_alive_interval": "1"}
        ).liveness_timeout
        == 3.0
    )
    assert RendezvousSettings.from_rdzv_conf({"timeout": "90"}).join_timeout == 90.0
    assert (
        RendezvousSettings.from_rdzv_conf({"timeout": "90", "join_timeout": "5"}).join_timeout
        == 5.0
    )
    assert RendezvousSettings.from_rdzv_conf({"spare_timeout": "60"}).spare_timeout == 60.0


@pytest.mark.parametrize(
    "conf, msg",
    [
        ({"join_timeout": "soon"}, "join_timeout='soon': must be a number of seconds > 0"),
        ({"last_call_timeout": "-1"}, "last_call_timeout=-1.0: must be a number"),
        ({"read_timeout": "inf"}, "read_timeout=inf"),
        (
            {"keep_alive_max_attempt": "1.5"},
            "keep_alive_max_attempt='1.5': must be an integer >= 2",
        ),
        ({"keep_alive_max_attempt": "1"}, "keep_alive_max_attempt=1: must be an integer >= 2"),
        (
            {"heartbeat_timeout": "1", "keep_alive_interval": "2"},
            "heartbeat_timeout=1: must exceed keep_alive_interval=2",
        ),
    ],
)
def test_bad_values_name_the_key(conf: dict, msg: str) -> None:
    with pytest.raises(ValueError) as info:
        RendezvousSettings.from_rdzv_conf(conf)
    assert msg in str(info.value) and "\n" not in str(info.value)
