"""Tests for rendezvous.nodes.settings: torchrun's --rdzv-conf names, defaults and one-line
errors; MembershipSettings' checks."""

from __future__ import annotations

import pytest

from rendezvous.nodes.settings import MembershipSettings, RendezvousSettings


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


def test_membership_settings_say_static_or_dynamic_and_carry_the_rendezvous_settings() -> None:
    s = MembershipSettings(1, 3, 3, 4, "10.0.0.2", "job")
    assert s.static and s.rdzv == RendezvousSettings() and not s.hosts_store
    rdzv = RendezvousSettings(join_timeout=5, keep_alive_interval=0.2, heartbeat_timeout=1.0)
    d = MembershipSettings(None, 1, 4, 2, "h", "job", rdzv=rdzv, hosts_store=True)
    assert not d.static and d.rdzv.liveness_timeout == 1.0 and d.hosts_store


@pytest.mark.parametrize(
    "args, msg",
    [
        ((0, 1, 2, 1, "h", "job"), "needs a fixed node count"),
        ((5, 2, 2, 1, "h", "job"), r"must be in 0\.\.1"),
        ((None, 3, 2, 1, "h", "job"), "need 1 <= MIN <= MAX"),
        ((None, 0, 2, 1, "h", "job"), "need 1 <= MIN <= MAX"),
        ((None, 1, 2, 0, "h", "job"), "local_world_size=0 must be >= 1"),
        ((None, 1, 2, 1, "h", "a/b"), "without '/'"),
        ((None, 1, 2, 1, "h", ""), "non-empty"),
    ],
)
def test_bad_membership_settings_name_the_field(args: tuple, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        MembershipSettings(*args)


def test_membership_settings_take_only_rendezvous_settings() -> None:
    with pytest.raises(TypeError, match="must be a RendezvousSettings"):
        MembershipSettings(None, 1, 2, 1, "h", "job", rdzv={"join_timeout": 5})  # type: ignore[arg-type]
