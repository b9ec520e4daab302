"""LPT assignment against the brute-force optimum (Graham's 4/3 bound) and its edge cases."""
from __future__ import annotations

import itertools
import random

import pytest

from hypic.dist.lpt import lpt_assign


def brute_force_makespan(sizes: list[int], workers: int, start: list[int]) -> int:
    best = None
    for owners in itertools.product(range(workers), repeat=len(sizes)):
        loads = list(start)
        for size, owner in zip(sizes, owners):
            loads[owner] += size
        best = max(loads) if best is None else min(best, max(loads))
    return best


def test_lpt_is_within_four_thirds_of_the_optimum_on_random_instances():
    rng = random.Random(0)
    for _ in range(150):
        workers = rng.randint(1, 4)
        sizes = [rng.randint(1, 3000) for _ in range(rng.randint(1, 6))]
        got = lpt_assign(sizes, workers)
        opt = brute_force_makespan(sizes, workers, [0] * workers)
        assert got.makespan * 3 * workers <= (4 * workers - 1) * opt  # 4/3 - 1/(3m)
        assert sorted(got.loads) == sorted(_loads(sizes, got.owner, workers, [0] * workers))


def test_lpt_with_start_loads_never_exceeds_the_optimum_plus_one_segment():
    rng = random.Random(1)
    for _ in range(100):
        workers = rng.randint(1, 4)
        sizes = [rng.randint(1, 1000) for _ in range(rng.randint(1, 6))]
        start = [rng.randint(0, 1500) for _ in range(workers)]
        got = lpt_assign(sizes, workers, start)
        assert list(got.loads) == _loads(sizes, got.owner, workers, start)
        # Greedy list scheduling: the last-finishing worker was least loaded when its last segment came.
        assert got.makespan <= brute_force_makespan(sizes, workers, start) + max(sizes)


def test_the_classic_worst_case_is_exactly_four_thirds():
    # m = 2: sizes 3,3,2,2,2 -> LPT 7 vs optimum 6 (3+3 | 2+2+2).
    got = lpt_assign([3, 3, 2, 2, 2], 2)
    assert got.makespan == 7 and brute_force_makespan([3, 3, 2, 2, 2], 2, [0, 0]) == 6


def test_ties_are_deterministic_and_orders_largest_first():
    got = lpt_assign([5, 5, 5, 5], 2)
    assert got.owner == (0, 1, 0, 1)
    assert got.order == (0, 1, 2, 3)
    uneven = lpt_assign([1, 9, 4, 9], 2)
    assert uneven.order == (1, 3, 2, 0)
    assert uneven.segments_of(0) == (1, 2) and uneven.segments_of(1) == (3, 0)


def test_more_workers_than_segments_leaves_workers_idle():
    got = lpt_assign([10, 20], 5)
    assert sorted(got.loads) == [0, 0, 0, 10, 20]
    assert len(set(got.owner)) == 2


def test_start_loads_steer_segments_away_from_busy_workers():
    got = lpt_assign([100, 100], 3, start_loads=[0, 1000, 50])
    assert got.owner == (0, 2)
    assert lpt_assign([], 2).loads == (0, 0)


@pytest.mark.parametrize("args", [([1], 0, None), ([-1], 1, None), ([1], 2, [0]), ([1], 2, [0, -3])])
def test_invalid_inputs_are_refused(args):
    with pytest.raises(ValueError):
        lpt_assign(*args)


def _loads(sizes: list[int], owner: tuple[int, ...], workers: int, start: list[int]) -> list[int]:
    loads = list(start)
    for size, w in zip(sizes, owner):
        loads[w] += size
    return loads
