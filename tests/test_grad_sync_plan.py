"""launcher.runtime.grad_sync_plan: a rank records its gradient syncs; its replacement installs
them before its first backward, whose buckets then launch during backward, with the same sums.
Unit tests on a dict store and a fake group; end to end (a replacement installs its
predecessor's sync, the job stays bit-identical): tests/test_faults_e2e.py's process faults."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers_runtime import DictStore

from launcher.protocol import plan as P
from launcher.runtime.buckets import GradComm, GradientSyncs
from launcher.runtime.grad_sync_plan import SyncPlan, SyncSpec
from launcher.runtime.rank_state import RankLinks, RankState, RuntimeOptions
from launcher.runtime.replicas import Layout
from launcher.runtime.signals import StopSignal
from launcher.runtime.state import Registered


def rank_of(store: DictStore, models: list[torch.nn.Module], managed: bool = True):
    env = SimpleNamespace(rank=1, managed=managed, world_size=2)
    lines: list[str] = []
    links = RankLinks(env, StopSignal(), lines.append, RuntimeOptions())  # type: ignore[arg-type]
    links.store = store
    state = RankState(0, False, Layout.ddp(2))
    state.reg = Registered(models, [], [], None, {}, None)
    state.registered = True
    return SyncPlan(links, state), lines


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def test_a_sync_over_registered_models_is_recorded_once():
    store, a, b = DictStore(), mlp(), mlp()
    plan, _ = rank_of(store, [a, b])
    plan.record((b,), None, True, 1 << 20)
    plan.record((b,), None, True, 1 << 20)  # the same sync: no second write
    plan.record((a, b), None, False, 4096)
    raw = json.loads(store.data[P.grad_syncs_key(1)])
    assert raw == [
        {"models": [1], "average": True, "bucket_bytes": 1 << 20},
        {"models": [0, 1], "average": False, "bucket_bytes": 4096},
    ]
    assert plan.recorded() == [SyncSpec((1,), True, 1 << 20), SyncSpec((0, 1), False, 4096)]


def test_user_groups_unregistered_models_and_plain_torchrun_are_not_recorded():
    store, a = DictStore(), mlp()
    plan, _ = rank_of(store, [a])
    plan.record((a,), "dp", True, 1 << 20)  # a user group: its handle is the script's
    plan.record((mlp(),), None, True, 1 << 20)  # not registered
    assert store.data == {}
    unmanaged, _ = rank_of(store, [a], managed=False)
    unmanaged.record((a,), None, True, 1 << 20)
    assert store.data == {} and unmanaged.recorded() == []


def test_install_makes_the_predecessors_syncs_and_skips_an_unknown_model():
    store, a = DictStore(), mlp()
    store.set(
        P.grad_syncs_key(1),
        json.dumps(
            [
                {"models": [0], "average": True, "bucket_bytes": 1 << 20},
                {"models": [3], "average": True, "bucket_bytes": 1 << 20},
            ]
        ).encode(),
    )
    plan, lines = rank_of(store, [a])
    made = []
    assert plan.install(lambda m, avg, cap: made.append((m, avg, cap))) == 1
    assert made == [((a,), True, 1 << 20)]
    assert any("names a model not registered here" in line for line in lines)
    plan.record((a,), None, True, 1 << 20)  # the installed sync is made: not written again
    assert len(json.loads(store.data[P.grad_syncs_key(1)])) == 2


def test_a_garbled_record_is_ignored_with_a_line():
    store, a = DictStore(), mlp()
    store.set(P.grad_syncs_key(1), b"not json")
    plan, lines = rank_of(store, [a])
    assert plan.install(lambda *args: pytest.fail("nothing to install")) == 0
    assert any("ignoring the predecessor's gradient sync record" in line for line in lines)


class FakeGroup:
    """A two-rank group whose peer contributes the same gradients: all_reduce doubles."""

    def __init__(self) -> None:
        self.launched = 0

    def allreduce(self, tensors, opts):
        self.launched += 1
        tensors[0].mul_(2)
        return SimpleNamespace(wait=lambda *a: True, is_completed=lambda: True)


class Coll:
    def check_stop(self, what: str) -> None:
        pass

    def wait(self, work, what, tensors) -> None:
        work.wait()


def test_a_prepared_sync_launches_its_buckets_during_backward_with_the_same_sums():
    grads = []
    for prepared in (False, True):
        model, group = mlp(), FakeGroup()
        syncs = GradientSyncs()
        comm = lambda: GradComm(Coll(), lambda: group, 2, 0, (0, 1))  # noqa: E731
        if prepared:
            syncs.prepare((model,), None, comm, True, 64)
        model(torch.ones(3, 4)).sum().backward()
        during_backward = group.launched
        syncs.sync((model,), None, comm, True, 64)
        assert during_backward == (group.launched if prepared else 0), (prepared, group.launched)
        assert group.launched > 1  # several buckets at a 64-byte cap
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(x, y) for x, y in zip(*grads))
