"""State-slab slots: one per running sequence or prefix-cache checkpoint."""
from __future__ import annotations

from collections import deque

from hypic.errors import HypicError


class NoFreeSlots(HypicError):
    """Every state slot is in use; the scheduler evicts checkpoints, preempts or waits."""


class SlotPool:
    """Slot ids 0..num_slots-1, each free or owned by exactly one user."""

    def __init__(self, num_slots: int) -> None:
        self._free: deque[int] = deque(range(num_slots))
        self._used = [False] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeSlots(f"all {len(self._used)} state slots are in use")
        slot = self._free.popleft()
        self._used[slot] = True
        return slot

    def release(self, slot: int) -> None:
        if not self._used[slot]:
            raise RuntimeError(f"internal error: release of free state slot {slot}")
        self._used[slot] = False
        self._free.append(slot)
