"""Ref-counted KV pages: which blocks are free and how many owners each used block has."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from hypic.errors import HypicError


class NoFreeBlocks(HypicError):
    """Fewer free KV blocks than asked for; the scheduler evicts, preempts or waits."""


class BlockPool:
    """Block ids 0..num_blocks-1. Invariant: a block is on the free list iff its refcount is 0."""

    def __init__(self, num_blocks: int) -> None:
        self._refcounts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with refcount 1; takes nothing when fewer than n are free."""
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._refcounts[i] = 1
        return ids

    def ref(self, ids: Iterable[int]) -> None:
        """One more owner for each block (a block may appear several times)."""
        for i in ids:
            if self._refcounts[i] == 0:
                raise RuntimeError(f"internal error: ref of free KV block {i}")
            self._refcounts[i] += 1

    def release(self, ids: Iterable[int]) -> None:
        """One owner fewer for each block; a block nobody owns goes back to the free list."""
        for i in ids:
            if self._refcounts[i] == 0:
                raise RuntimeError(f"internal error: release of free KV block {i}")
            self._refcounts[i] -= 1
            if self._refcounts[i] == 0:
                self._free.append(i)

    def refcount(self, block_id: int) -> int:
        return self._refcounts[block_id]
