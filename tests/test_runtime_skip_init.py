"""launcher.runtime.skip_init: a replacement's skipped random init, proven harmless or refused."""

from __future__ import annotations

import torch
import torch.nn.init as nn_init

from launcher.runtime.skip_init import InitSkip


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
