"""FTRUN_FAULT_PLAN parsing and firing (raised kinds in-process, process kinds in a child)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from helpers_runtime import base_env

from launcher.runtime.devices import InjectedFault
from launcher.runtime.faultplan import FaultInjector, parse_plan


def test_parse_and_validate():
    specs = parse_plan(
        json.dumps(
            [
                {"rank": 1, "step": 3, "phase": "backward", "kind": "kill"},
                {"rank": 0, "step": 0, "phase": "optimizer", "kind": "uce-low", "generation": 2},
            ]
        )
    )
    assert (specs[0].generation, specs[1].generation) == (0, 2)
    assert parse_plan(None) == [] and parse_plan("") == []
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_plan("{")
    with pytest.raises(ValueError, match="phase='loss'"):
        parse_plan('[{"rank":0,"step":0,"phase":"loss","kind":"kill"}]')
    with pytest.raises(ValueError, match="kind='boom'"):
        parse_plan('[{"rank":0,"step":0,"phase":"forward","kind":"boom"}]')
    with pytest.raises(ValueError, match="lacks 'step'"):
        parse_plan('[{"rank":0,"phase":"forward","kind":"kill"}]')
    with pytest.raises(ValueError, match="unknown keys"):
        parse_plan('[{"rank":0,"step":1,"phase":"forward","kind":"kill","when":1}]')


def test_raised_fault_fires_once_only_on_match():
    logs: list[str] = []
    inj = FaultInjector(
        parse_plan('[{"rank":2,"step":4,"phase":"forward","kind":"uce-high","generation":1}]'),
        2,
        logs.append,
    )
    inj.maybe_fire(0, 4, "forward")  # wrong generation
    inj.maybe_fire(1, 4, "backward")  # wrong phase
    with pytest.raises(InjectedFault) as err:
        inj.maybe_fire(1, 4, "forward")
    assert err.value.kind == "uce-high"
    inj.maybe_fire(1, 4, "forward")  # fired already
    assert logs == ["INJECTED fault kind=uce-high at step 4 forward"]
    FaultInjector(
        parse_plan('[{"rank":2,"step":4,"phase":"forward","kind":"exception"}]'), 1, print
    ).maybe_fire(0, 4, "forward")  # other rank: nothing


@pytest.mark.parametrize(
    "kind,code", [("kill", -signal.SIGKILL), ("segv", -signal.SIGSEGV), ("exit", 3)]
)
def test_process_faults_are_real(kind, code):
    spec = json.dumps([{"rank": 0, "step": 1, "phase": "forward", "kind": kind}])
    prog = (
        "from launcher.runtime.faultplan import FaultInjector, parse_plan\n"
        f"FaultInjector(parse_plan({spec!r}), 0, print).maybe_fire(0, 1, 'forward')\n"
        "print('survived')"
    )
    res = subprocess.run(
        [sys.executable, "-c", prog], env=base_env(), capture_output=True, text=True, timeout=60
    )
    assert res.returncode == code and "survived" not in res.stdout
    assert f"INJECTED fault kind={kind}" in res.stdout


def test_injection_forwarded_by_the_agent_fires_in_any_generation():
    logs: list[str] = []
    inj = FaultInjector([], 1, logs.append)
    inj.arm(
        {"op": "inject", "kind": "network", "step": 5, "phase": None}
    )  # phase defaults to forward
    inj.maybe_fire(3, 4, "forward")
    inj.maybe_fire(3, 5, "backward")
    with pytest.raises(InjectedFault) as err:
        inj.maybe_fire(3, 5, "forward")
    assert err.value.kind == "network"
    inj.maybe_fire(3, 5, "forward")  # once only
    assert logs[0] == "INJECTED fault kind=network armed by ftctl inject: fires at step 5 forward"
    assert logs[1] == "INJECTED fault kind=network at step 5 forward"


def test_injection_without_a_step_fires_at_the_next_phase_edge_one_per_edge():
    logs: list[str] = []
    inj = FaultInjector([], 0, logs.append)
    inj.arm({"op": "inject", "kind": "uce-low", "step": None, "phase": None})
    inj.arm({"op": "inject", "kind": "uce-high", "step": None, "phase": None})
    with pytest.raises(InjectedFault, match="uce-low"):
        inj.maybe_fire(0, 7, "backward")
    with pytest.raises(InjectedFault, match="uce-high"):
        inj.maybe_fire(0, 7, "optimizer")
    inj.maybe_fire(0, 8, "forward")


@pytest.mark.parametrize(
    "msg,why",
    [
        ({"kind": "boom"}, "kind='boom'"),
        ({"kind": "hang", "step": -1}, "step=-1"),
        ({"kind": "hang", "step": 2, "phase": "loss"}, "phase='loss'"),
    ],
)
def test_bad_injection_is_ignored_with_one_line(msg, why):
    logs: list[str] = []
    inj = FaultInjector([], 0, logs.append)
    inj.arm({"op": "inject", **msg})
    inj.maybe_fire(0, 2, "forward")  # nothing armed
    assert (
        len(logs) == 1 and logs[0].startswith("ignored injection from the agent") and why in logs[0]
    )


def test_kill_forwarded_without_a_step_is_a_real_signal_at_once():
    prog = (
        "import time\nfrom launcher.runtime.faultplan import FaultInjector\n"
        "FaultInjector([], 0, print).arm("
        "{'op': 'inject', 'kind': 'kill', 'step': None, 'phase': None})\n"
        "print('survived')"
    )
    res = subprocess.run(
        [sys.executable, "-c", prog], env=base_env(), capture_output=True, text=True, timeout=60
    )
    assert res.returncode == -signal.SIGKILL and "survived" not in res.stdout
    assert "INJECTED fault kind=kill" in res.stdout


def test_transfer_phase_fires_only_at_the_transfer_edge_of_its_round():
    logs: list[str] = []
    spec = '[{"rank":0,"step":3,"phase":"transfer","kind":"uce-low","generation":1}]'
    inj = FaultInjector(parse_plan(spec), 0, logs.append)
    inj.maybe_fire(1, 3, "forward")  # a training edge of the same step and generation
    inj.maybe_fire(0, 3, "transfer")  # the transfer edge of another round
    with pytest.raises(InjectedFault, match="step 3 transfer"):
        inj.maybe_fire(1, 3, "transfer")


def test_rebuild_phase_fires_only_before_the_group_build_of_its_round():
    logs: list[str] = []
    spec = '[{"rank":0,"step":3,"phase":"rebuild","kind":"uce-low","generation":1}]'
    inj = FaultInjector(parse_plan(spec), 0, logs.append)
    inj.maybe_fire(1, 3, "transfer")  # another edge of the same round
    inj.maybe_fire(2, 3, "rebuild")  # the build of another round
    with pytest.raises(InjectedFault, match="step 3 rebuild"):
        inj.maybe_fire(1, 3, "rebuild")
