"""BlockPool accounting against a plain reference count."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypic.cache.block_pool import BlockPool, NoFreeBlocks


def test_allocate_and_release_return_everything() -> None:
    pool = BlockPool(8)
    a, b = pool.allocate(3), pool.allocate(5)
    assert sorted(a + b) == list(range(8)) and pool.num_free == 0
    pool.release(a + b)
    assert pool.num_free == 8 and all(pool.refcount(i) == 0 for i in range(8))


def test_allocate_too_many_takes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(1)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(4)
    assert pool.num_free == 3
    assert pool.allocate(0) == []


def test_shared_block_is_freed_by_its_last_owner() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.ref(ids)
    assert [pool.refcount(i) for i in ids] == [2, 2]
    pool.release(ids)
    assert pool.num_free == 2
    pool.release(ids)
    assert pool.num_free == 4


def test_misuse_of_free_blocks_is_an_internal_error() -> None:
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.release([0])
    with pytest.raises(RuntimeError):
        pool.ref([1])
    ids = pool.allocate(1)
    pool.release(ids)
    with pytest.raises(RuntimeError):
        pool.release(ids)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "ref", "release"]), st.integers(0, 5)), max_size=40))
def test_random_operations_match_a_reference_count(ops: list[tuple[str, int]]) -> None:
    pool, owned, expected = BlockPool(12), [], Counter()  # owned: one entry per reference held
    for op, n in ops:
        if op == "alloc" and n <= pool.num_free:
            ids = pool.allocate(n)
            assert all(expected[i] == 0 for i in ids)
            owned += ids
            expected.update(ids)
        elif op == "ref" and owned:
            ids = owned[: n % 3 + 1]
            pool.ref(ids)
            owned += ids
            expected.update(ids)
        elif op == "release":
            ids = [owned.pop() for _ in range(min(n, len(owned)))]
            pool.release(ids)
            expected.subtract(ids)
        assert all(pool.refcount(i) == expected[i] for i in range(12))
        assert pool.num_free == sum(1 for i in range(12) if expected[i] == 0)
    pool.release(owned)
    assert pool.num_free == 12
