"""launcher.workers.spare_vintage: which idle spares make way for fresh forks."""

from __future__ import annotations

from launcher.workers.spare_vintage import SpareVintage


def test_spares_with_too_little_heap_are_retired_once_fresh_ones_are_ready() -> None:
    v = SpareVintage()
    v.forked(10, 0)  # forked before any rank said how much heap it needs
    v.forked(11, 100)
    v.heap_needed({10, 11}, 120)  # 100 >= 3/4 of 120: 11 is good enough
    assert v.old() == {10}
    assert v.retire([10, 11], ready={10, 11}, count=2) == set()  # one fresh ready: both serve
    v.forked(12, 120)
    assert v.retire([10, 11, 12], ready={10, 11, 12}, count=2) == {10}
    assert v.old() == set() and 10 not in v.heap_of


def test_stale_for_imports_until_the_server_added_nothing() -> None:
    v = SpareVintage()
    v.forked(1, 50)
    v.imports_added({1})
    assert v.old() == {1}
    v.no_new_modules()
    assert v.old() == set()


def test_a_taken_or_dead_spare_is_forgotten() -> None:
    v = SpareVintage()
    v.forked(1, 0)
    v.forked(2, 0)
    v.heap_needed({1, 2}, 64)
    v.forget(1)
    v.keep_only({3})
    assert v.old() == {2} and v.heap_of == {}
    v.heap_needed({2}, 64)  # a spare not forked here (started alone) prepares no heap: kept
    assert v.thin == set()
