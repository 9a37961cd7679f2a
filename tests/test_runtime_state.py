"""Step-start snapshots, rollback and state flattening (single process)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from launcher.runtime.devices import DeviceAdapter
from launcher.runtime.state import (
    NumpyRng,
    PythonRng,
    Registered,
    capture_rng,
    flatten,
    restore_rng,
    slot_paths,
    tensor_paths,
    unflatten,
)


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1)
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    pos = {"i": 0}
    extra = torch.zeros(3)
    reg = Registered(
        [model], [opt], [], (lambda: dict(pos), lambda p: pos.update(p)), {"acc": extra}
    )
    return model, opt, pos, extra, reg


def draw():
    return random.random(), float(np.random.rand()), torch.rand(2)


def test_rollback_restores_rng_data_buffers_extras_and_zeroes_grads():
    model, opt, pos, extra, reg = make()
    dev = DeviceAdapter()
    snap = reg.snapshot(3, dev)
    expected = draw()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # the interrupted step: consumes RNG and data, updates BN stats and the extra tensor
    model(torch.randn(5, 4)).sum().backward()
    pos["i"] = 9
    extra += 1
    reg.restore(snap, dev)
    assert pos == {"i": 0}
    assert torch.equal(extra, torch.zeros(3))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())
    again = draw()
    assert (
        again[0] == expected[0] and again[1] == expected[1] and torch.equal(again[2], expected[2])
    )


def test_on_rollback_hook_gets_the_step():
    *_, reg = make()
    seen = []
    reg.on_rollback = seen.append
    reg.restore(reg.snapshot(7, DeviceAdapter()), DeviceAdapter())
    assert seen == [7]


def test_flatten_round_trip_keeps_structure_and_tensor_identity():
    t1, t2 = torch.ones(2), torch.zeros(3)
    obj = {"a": [t1, {"b": t2, "c": 5}], "d": ("x", t1), "e": None}
    tensors: list[torch.Tensor] = []
    skel = flatten(obj, tensors)
    assert len(tensors) == 3 and tensors[0] is t1
    back = unflatten(skel, tensors)
    assert back["a"][1]["c"] == 5 and back["a"][0] is t1 and back["d"][1] is t1
    assert slot_paths(skel)[1] == ("a", 1, "b")
    assert set(tensor_paths(obj)) == {("a", 0), ("a", 1, "b"), ("d", 1)}


def test_full_state_load_into_fresh_objects_matches():
    model, opt, pos, extra, reg = make()
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    extra += 2
    pos["i"] = 4
    snap = reg.snapshot(1, DeviceAdapter())
    state = reg.full_state(snap)
    m2, o2, p2, e2, reg2 = make()
    reg2.load_full_state(state, DeviceAdapter())
    for k, v in model.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k])
    assert torch.equal(e2, extra) and p2 == {"i": 4}
    s1, s2 = opt.state_dict()["state"], o2.state_dict()["state"]
    assert all(torch.equal(s1[i]["exp_avg"], s2[i]["exp_avg"]) for i in s1)


def test_full_state_shape_mismatch_is_a_clear_error():
    model, opt, pos, extra, reg = make()
    state = reg.full_state(reg.snapshot(0, DeviceAdapter()))
    state["models"][0]["0.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match="0.weight"):
        make()[-1].load_full_state(state, DeviceAdapter())


class WithExtraState(torch.nn.Linear):
    """A module whose state_dict carries a non-tensor `_extra_state` (megatron's layers: None)."""

    def __init__(self, extra: object) -> None:
        super().__init__(2, 2)
        self.extra = extra

    def get_extra_state(self) -> object:
        return self.extra

    def set_extra_state(self, state: object) -> None:
        self.extra = state


def test_full_state_load_accepts_non_tensor_extra_state():
    dev = DeviceAdapter()
    for sent, held in ((None, None), ({"fp8": 3}, {"fp8": 0})):
        src, dst = WithExtraState(sent), WithExtraState(held)
        a, b = Registered([src]), Registered([dst])
        b.load_full_state(a.full_state(a.snapshot(4, dev)), dev)
        assert dst.extra == sent
        assert torch.equal(dst.weight, src.weight)


def _same_numpy_state(a, b):
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and tuple(a[2:]) == tuple(b[2:])


DRAWS = {
    "nothing": lambda: None,
    "uniform": lambda: (random.random(), np.random.rand()),
    "gaussian": lambda: (
        random.gauss(0, 1),
        np.random.standard_normal(),
    ),  # caches one half of a pair
    "gaussian again": lambda: (
        random.gauss(0, 1),
        np.random.standard_normal(),
    ),  # uses the cached half
    "nothing again": lambda: None,
    "seed": lambda: (random.seed(7), np.random.seed(7)),
    "bits": lambda: (random.getrandbits(64), np.random.randint(0, 9)),
    # exactly one generator period of 32-bit words: the position is back where it was, every word
    # was rewritten (the fingerprint compares the position and the first words, not all 624)
    "one full twist": lambda: (
        [random.getrandbits(32) for _ in range(624)],
        np.random.randint(0, 2**32, size=624, dtype=np.uint64),
    ),
    "set back": lambda: None,
}


def test_rng_reads_reuse_a_state_only_while_it_is_unchanged():
    """The cheap reads return exactly what random.getstate()/np.random.get_state() would, after
    every kind of draw (a cached gaussian changes the state without moving the generator)."""
    py, npr = PythonRng(), NumpyRng()
    saved = None
    for name, act in DRAWS.items():
        if name == "set back":
            random.setstate(saved[0])
            np.random.set_state(saved[1])
        act()
        assert py.get() == random.getstate(), name
        assert _same_numpy_state(npr.get(), np.random.get_state()), name
        saved = saved or (random.getstate(), np.random.get_state())
    assert py._addr, "the raw layout check failed on CPython: the fast path is off"
    unchanged = py.get()
    assert py.get() is unchanged  # nothing drawn: the same tuple, not a fresh read


def test_restoring_a_reused_rng_state_replays_the_same_draws():
    dev = DeviceAdapter()
    first = capture_rng(dev)
    second = capture_rng(dev)  # nothing drawn in between: shares the first's python/numpy states
    expected = draw()
    draw()
    restore_rng(second, dev)
    assert draw()[:2] == expected[:2]
    restore_rng(first, dev)
    assert torch.equal(draw()[2], expected[2])


def test_buffers_match_module_buffers_after_reassignment_and_new_buffers():
    shared = torch.nn.BatchNorm1d(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 3), shared, torch.nn.Sequential(shared, torch.nn.BatchNorm1d(3))
    )
    other = torch.nn.BatchNorm1d(2)
    reg = Registered([model, other])

    def expected():
        return [id(b) for m in (model, other) for b in m.buffers()]

    assert [id(b) for b in reg.buffers()] == expected()
    shared.running_mean = torch.ones(3)  # a buffer replaced by assignment
    model[0].register_buffer("scale", torch.ones(1))  # a buffer added to a registered module
    model[2][1].running_var = None
    assert [id(b) for b in reg.buffers()] == expected()


def test_state_bytes_counts_model_optimizer_state_and_extras_once():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(3, 8)).sum().backward()
    opt.step()
    reg = Registered(
        models=[model],
        optimizers=[opt],
        extras={
            "scale": torch.ones(5, dtype=torch.float64),
            "on_meta": torch.empty(1000, device="meta"),
        },
    )
    params = sum(p.numel() for p in model.parameters()) * 4
    # Adam: exp_avg and exp_avg_sq per parameter (float32) and a float32 step per parameter; a
    # tensor off the host (a device's; here torch's meta device) needs no heap in a replacement
    assert reg.state_bytes() == params + 2 * params + 4 * 4 + 5 * 8
