"""The spare fork server's process: what a fork must redo to be a fresh process (its library
thread pools, its generators' seeds)."""

from __future__ import annotations

import os

from launcher.workers.spare_server import (
    OPENBLAS_MAX_THREADS,
    assigned,
    blas_threads_for,
    fresh_seeds,
    own_pages,
)


def test_a_forked_rank_gets_the_blas_pool_a_fresh_process_with_its_environment_has() -> None:
    """OpenBLAS's own rule: OPENBLAS_NUM_THREADS, else GOTO_NUM_THREADS, else OMP_NUM_THREADS
    (the first positive one), else every CPU; never more than the CPUs."""
    assert blas_threads_for({}, 8) == 8
    assert blas_threads_for({"OMP_NUM_THREADS": "3"}, 8) == 3
    assert blas_threads_for({"OMP_NUM_THREADS": "3"}, 2) == 2
    assert blas_threads_for({"OMP_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "1"}, 8) == 1
    assert blas_threads_for({"OMP_NUM_THREADS": "4", "GOTO_NUM_THREADS": "2"}, 8) == 2
    assert blas_threads_for({"OPENBLAS_NUM_THREADS": "0", "OMP_NUM_THREADS": "5"}, 8) == 5
    assert blas_threads_for({"OMP_NUM_THREADS": "lots"}, 6) == 6
    assert blas_threads_for({}, 500) == OPENBLAS_MAX_THREADS


def test_forks_draw_their_own_numbers_after_fresh_seeds() -> None:
    """torch's CPU generator is seeded once per process at import: two forks of one server drew
    the same numbers until each seeded afresh (`fresh_seeds`, numpy's global generator too)."""
    import numpy
    import torch

    def draws(reseed: bool) -> list[tuple[float, float]]:
        got = []
        for _ in range(2):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: report its draws, exit at once
                os.close(r)
                if reseed:
                    fresh_seeds()
                os.write(w, f"{torch.rand(1).item()!r} {numpy.random.rand()!r}".encode())
                os._exit(0)
            os.close(w)
            with os.fdopen(r) as f:
                t, n = f.read().split()
            os.waitpid(pid, 0)
            got.append((float(t), float(n)))
        return got

    same = draws(reseed=False)
    assert same[0][0] == same[1][0]  # what a fork shares: the check can fail
    fresh = draws(reseed=True)
    assert fresh[0][0] != fresh[1][0] and fresh[0][1] != fresh[1][1]


def test_a_spare_assigned_while_it_owns_its_pages_stops_there() -> None:
    """Issue 32: a spare taken while it still prepares (own_pages: 0.1-0.4 s on a busy node)
    stops at the next bounded read instead of making the round wait for the rest."""
    r, w = os.pipe()
    try:
        assert not assigned(r)  # nothing yet: it goes on preparing
        os.write(w, b"{}\n")
        assert assigned(r)
        done, why = own_pages(lambda: assigned(r))
        assert done == 0 and why == "assigned before every page was its own"
        os.read(r, 16)
        os.close(w)
        w = -1
        assert assigned(r)  # EOF (the pool stopped): it stops too
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_owning_pages_checks_for_the_assignment_between_bounded_slices() -> None:
    """Issue 32 (step 1): a run of present pages was made private in one madvise (a 256 MB run
    took ~0.1 s), so a spare assigned meanwhile started that much later. Between two checks it
    now does at most POPULATE_CHUNK pages."""
    from launcher.workers.spare_server import PAGE, POPULATE_CHUNK

    block = bytearray(64 << 20)  # 64 MB of present pages: one long run
    block[::PAGE] = b"x" * len(block[::PAGE])
    calls = 0

    def until() -> bool:
        nonlocal calls
        calls += 1
        return calls > 3

    done, why = own_pages(until)
    assert calls == 4 and why == "assigned before every page was its own"
    assert done <= 3 * POPULATE_CHUNK * PAGE
    del block
