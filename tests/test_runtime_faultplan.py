"""FTRUN_FAULT_PLAN parsing and firing (raised kinds in-process, process kinds in a child)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from launcher.runtime.devices import InjectedFault
from launcher.runtime.faultplan import FaultInjector, parse_plan
from helpers_runtime import base_env


def test_parse_and_validate():
    specs = parse_plan(json.dumps([{"rank": 1, "step": 3, "phase": "backward", "kind": "kill"},
                                   {"rank": 0, "step": 0, "phase": "optimizer", "kind": "uce-low", "generation": 2}]))
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
    inj = FaultInjector(parse_plan('[{"rank":2,"step":4,"phase":"forward","kind":"uce-high","generation":1}]'),
                        2, logs.append)
    inj.maybe_fire(0, 4, "forward")  # wrong generation
    inj.maybe_fire(1, 4, "backward")  # wrong phase
    with pytest.raises(InjectedFault) as err:
        inj.maybe_fire(1, 4, "forward")
    assert err.value.kind == "uce-high"
    inj.maybe_fire(1, 4, "forward")  # fired already
    assert logs == ["INJECTED fault kind=uce-high at step 4 forward"]
    FaultInjector(parse_plan('[{"rank":2,"step":4,"phase":"forward","kind":"exception"}]'), 1, print) \
        .maybe_fire(0, 4, "forward")  # other rank: nothing


@pytest.mark.parametrize("kind,code", [("kill", -signal.SIGKILL), ("segv", -signal.SIGSEGV), ("exit", 3)])
def test_process_faults_are_real(kind, code):
    spec = json.dumps([{"rank": 0, "step": 1, "phase": "forward", "kind": kind}])
    prog = ("from launcher.runtime.faultplan import FaultInjector, parse_plan\n"
            f"FaultInjector(parse_plan({spec!r}), 0, print).maybe_fire(0, 1, 'forward')\nprint('survived')")
    res = subprocess.run([sys.executable, "-c", prog], env=base_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == code and "survived" not in res.stdout
    assert f"INJECTED fault kind={kind}" in res.stdout
