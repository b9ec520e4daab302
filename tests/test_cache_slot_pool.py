"""SlotPool accounting."""
from __future__ import annotations

import pytest

from hypic.cache.slot_pool import NoFreeSlots, SlotPool


def test_slot_pool_accounting() -> None:
    pool = SlotPool(3)
    slots = [pool.allocate() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and pool.num_free == 0
    with pytest.raises(NoFreeSlots):
        pool.allocate()
    pool.release(slots[1])
    assert pool.allocate() == slots[1]
    for s in slots:
        pool.release(s)
    assert pool.num_free == 3
    with pytest.raises(RuntimeError):
        pool.release(0)
