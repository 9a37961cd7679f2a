"""launcher.runtime.skip_init: a replacement's skipped random init, proven harmless or refused;
the first start's probe of the same window and the verdict a replacement follows."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import pytest
import torch
import torch.nn.init as nn_init
from helpers_runtime import DictStore

from launcher.protocol import plan as P
from launcher.runtime.rank_state import RankLinks, RuntimeOptions
from launcher.runtime.signals import StopSignal
from launcher.runtime.skip_init import HARMLESS, InitSkip, InitWindow


def mlp(seed: int | None = None) -> torch.nn.Module:
    if seed is not None:
        torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def covered(*models: torch.nn.Module) -> list[torch.Tensor]:
    return [t for m in models for t in m.state_dict().values()]


def test_covered_fills_are_skipped_and_leave_the_generator_untouched():
    torch.manual_seed(3)
    before = torch.get_rng_state()
    skip = InitSkip()
    skip.open()
    m = mlp()
    res = skip.close(covered(m))
    assert (res.skipped, res.diverged) == (4, None)  # 2 weights + 2 biases
    assert torch.equal(torch.get_rng_state(), before)  # nothing drew
    for t in covered(m):  # poisoned until the state arrives
        assert torch.isnan(t.reshape(-1)[0]) and torch.isnan(t.reshape(-1)[-1])
    copy = torch.nn.Sequential(*[torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)])
    copy.load_state_dict(m.state_dict())
    assert torch.isnan(copy(torch.ones(3, 8))).all()  # a copy taken meanwhile is loudly wrong


def test_functions_are_restored_after_close():
    originals = {n: getattr(nn_init, n) for n in ("uniform_", "normal_", "kaiming_uniform_")}
    mha_fill = torch.nn.modules.activation.xavier_uniform_
    seed = torch.manual_seed
    skip = InitSkip()
    skip.open()
    assert nn_init.uniform_ is not originals["uniform_"] and torch.manual_seed is not seed
    assert torch.nn.modules.activation.xavier_uniform_ is not mha_fill  # imported by name there
    skip.close([])
    assert {n: getattr(nn_init, n) for n in originals} == originals
    assert torch.manual_seed is seed and torch.nn.modules.activation.xavier_uniform_ is mha_fill
    t = torch.zeros(10)
    nn_init.uniform_(t)
    assert torch.count_nonzero(t) == 10  # runs for real again


def test_fills_outside_the_received_state_are_refused():
    torch.manual_seed(5)
    skip = InitSkip()
    skip.open()
    a, _b = mlp(), mlp()  # _b draws random fills too
    res = skip.close(covered(a))  # b is not part of the state: its values would be NaN
    assert res.skipped == 8 and res.diverged and "outside the received state" in res.diverged


def test_multihead_attention_inside_a_registered_model_is_skipped():
    torch.manual_seed(2)
    before = torch.get_rng_state()
    skip = InitSkip()
    skip.open()
    m = torch.nn.MultiheadAttention(8, 2)  # xavier_uniform_ imported by name; constant_ runs
    res = skip.close(covered(m))
    assert res.diverged is None and res.skipped >= 2
    assert torch.equal(torch.get_rng_state(), before)


def test_a_draw_after_a_skipped_fill_is_refused():
    torch.manual_seed(1)
    skip = InitSkip()
    skip.open()
    m = mlp()
    torch.randn(3)  # a normal start would draw this from a later generator state
    res = skip.close(covered(m))
    assert res.diverged and "drawn" in res.diverged


def test_a_draw_between_skipped_fills_is_refused():
    torch.manual_seed(1)
    skip = InitSkip()
    skip.open()
    a = mlp()
    torch.rand(2)
    b = mlp()
    res = skip.close(covered(a, b))
    assert res.diverged and "between two skipped inits" in res.diverged


def test_reseed_with_nothing_drawn_is_fine_and_later_draws_are_checked_again():
    skip = InitSkip()
    skip.open()
    a = mlp(1)
    b = mlp(2)  # nothing drew since a's fills: from here the generator is a normal start's
    res = skip.close(covered(a, b))
    assert res.diverged is None and res.skipped == 8
    skip = InitSkip()
    skip.open()
    a = mlp(1)
    b = mlp(2)
    torch.randn(1)  # after b's skipped fills: refused
    assert skip.close(covered(a, b)).diverged


def test_draws_after_a_reseed_without_later_skips_are_fine():
    skip = InitSkip()
    skip.open()
    m = mlp(1)
    torch.manual_seed(4)
    torch.randn(5)  # a normal start draws exactly this too
    res = skip.close(covered(m))
    assert res.diverged is None


def test_reseed_after_a_draw_is_refused():
    torch.manual_seed(1)
    skip = InitSkip()
    skip.open()
    m = mlp()
    torch.randn(2)
    torch.manual_seed(9)
    res = skip.close(covered(m))
    assert res.diverged and "manual_seed" in res.diverged


def test_explicit_generator_and_meta_tensors_are_not_skipped():
    skip = InitSkip()
    skip.open()
    g = torch.Generator().manual_seed(4)
    t = torch.zeros(1000)
    nn_init.uniform_(t, generator=g)
    meta = torch.empty(4, 4, device="meta")
    nn_init.normal_(meta)
    res = skip.close([])
    assert res.skipped == 0 and res.diverged is None
    assert torch.equal(t, torch.zeros(1000).uniform_(generator=torch.Generator().manual_seed(4)))


def test_views_inside_a_covered_tensor_count_as_covered():
    flat = torch.zeros(100)
    torch.manual_seed(0)
    skip = InitSkip()
    skip.open()
    nn_init.normal_(flat[10:30].view(4, 5))
    res = skip.close([flat])
    assert (res.skipped, res.diverged) == (1, None)
    skip = InitSkip()
    skip.open()
    nn_init.normal_(flat[90:])
    assert skip.close([flat[:50]]).diverged  # not inside the covered part


# ---------------------------------------------------------------- a probe: fills run, same verdict


def built_then_drawn() -> list[torch.nn.Module]:
    m = mlp(1)
    torch.randn(3)  # a dataset drawn after the model
    return [m]


def drawn_between() -> list[torch.nn.Module]:
    a = mlp(1)
    torch.rand(2)
    return [a, mlp()]


def reseeded() -> list[torch.nn.Module]:
    return [mlp(1), mlp(2)]


def reseeded_then_drawn() -> list[torch.nn.Module]:
    m = mlp(1)
    torch.manual_seed(4)
    torch.randn(5)
    return [m]


def drawn_then_reseeded() -> list[torch.nn.Module]:
    m = mlp(1)
    torch.randn(2)
    torch.manual_seed(9)
    return [m]


def unregistered() -> list[torch.nn.Module]:
    m = mlp(1)
    mlp()  # not part of the state
    return [m]


SCRIPTS: dict[str, tuple[Callable[[], list[torch.nn.Module]], bool]] = {
    "model only": (lambda: [mlp(1)], True),
    "drawn after": (built_then_drawn, False),
    "drawn between": (drawn_between, False),
    "reseeded": (reseeded, True),
    "reseeded, then drawn": (reseeded_then_drawn, True),
    "drawn, then reseeded": (drawn_then_reseeded, False),
    "unregistered": (unregistered, False),
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_probe_reaches_the_verdict_of_the_skip_it_stands_for(name):
    build, harmless = SCRIPTS[name]
    verdicts = []
    for probe in (False, True):
        torch.manual_seed(0)
        skip = InitSkip(probe=probe)
        skip.open()
        models = build()
        verdicts.append(skip.close(covered(*models)))
    skipped, probed = verdicts
    assert (skipped.diverged is None, probed.diverged is None) == (harmless, harmless)
    assert skipped.skipped == probed.skipped > 0


def test_a_probe_runs_the_fills_as_a_normal_start_does():
    torch.manual_seed(0)
    normal = built_then_drawn()[0]
    after_normal = torch.get_rng_state()
    torch.manual_seed(0)
    skip = InitSkip(probe=True)
    skip.open()
    probed = built_then_drawn()[0]
    assert torch.equal(torch.get_rng_state(), after_normal)
    skip.close(covered(probed))
    for a, b in zip(covered(normal), covered(probed)):
        assert torch.equal(a, b)


def test_a_fill_inside_a_probed_fill_is_part_of_it(monkeypatch):
    def calls_another(t: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return nn_init.normal_(t)  # looked up when called: the watched one

    monkeypatch.setattr(nn_init, "sparse_", calls_another)
    skip = InitSkip(probe=True)
    skip.open()
    t = torch.zeros(4)
    nn_init.sparse_(t, 0.1)
    res = skip.close([t])
    assert (res.skipped, res.diverged) == (1, None) and torch.count_nonzero(t) == 4


# ---------------------------------------------------------------- the window and its verdict


def start(
    store: DictStore,
    replacement: bool,
    build: Callable[[], list[torch.nn.Module]] = built_then_drawn,
    managed: bool = True,
    skip_init: bool = True,
) -> tuple[list[torch.nn.Module], list[str]]:
    """One start of rank 1 up to its first step: (its models, its log lines)."""
    env = SimpleNamespace(rank=1, managed=managed, skip_init=skip_init)
    lines: list[str] = []
    links = RankLinks(env, StopSignal(), lines.append, RuntimeOptions())  # type: ignore[arg-type]
    links.store = store
    window = InitWindow(links)
    torch.manual_seed(0)
    window.open(replacement)
    models = build()
    window.close(covered(*models))
    return models, lines


def is_poisoned(models: list[torch.nn.Module]) -> bool:
    return all(torch.isnan(t.reshape(-1)[0]) for t in covered(*models))


def test_a_replacement_skips_when_the_first_start_found_it_harmless():
    store = DictStore()
    first, lines = start(store, replacement=False, build=lambda: [mlp(1)])
    assert store.data == {P.skip_init_key(1): HARMLESS} and not lines
    assert not is_poisoned(first)  # the first start ran its fills
    models, lines = start(store, replacement=True, build=lambda: [mlp(1)])
    assert is_poisoned(models)  # until the state arrives
    assert lines == ["skipped 4 random parameter inits the received state overwrites"]


def test_a_replacement_runs_its_init_when_the_first_start_found_the_skip_harmful():
    store = DictStore()
    _, lines = start(store, replacement=False)
    verdict = store.data[P.skip_init_key(1)]
    assert verdict != HARMLESS and b"drawn" in verdict
    assert "a replacement of this rank will run its random parameter inits" in lines[0]
    normal, _ = start(store, replacement=False)
    models, lines = start(store, replacement=True)
    for a, b in zip(covered(*normal), covered(*models)):  # what a normal start built
        assert torch.equal(a, b)
    assert len(lines) == 1 and "random parameter inits run" in lines[0]


def test_a_replacement_without_a_verdict_probes_like_a_first_start():
    store = DictStore()
    models, lines = start(store, replacement=True)
    assert not is_poisoned(models) and b"drawn" in store.data[P.skip_init_key(1)]
    store = DictStore()
    start(store, replacement=True, build=lambda: [mlp(1)])
    assert store.data[P.skip_init_key(1)] == HARMLESS


def test_a_replacement_that_takes_another_path_warns_and_goes_on():
    store = DictStore()
    start(store, replacement=False, build=lambda: [mlp(1)])
    _, lines = start(store, replacement=True)  # draws where its first start did not
    assert "WARNING" in lines[0] and "going on" in lines[0]
    assert b"drawn" in store.data[P.skip_init_key(1)]  # later replacements run their inits


@pytest.mark.parametrize("kw", [{"skip_init": False}, {"managed": False}])
def test_no_window_without_the_skip_or_an_agent(kw):
    store = DictStore()
    for replacement in (False, True):
        models, lines = start(store, replacement=replacement, **kw)
        assert not is_poisoned(models) and not lines and not store.data
