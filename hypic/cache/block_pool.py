"""Ref-counted KV pages: which blocks are free and how many owners each used block has."""
from __future__ import annotations

from collections.abc import Iterable

from hypic.errors import HypicError


class NoFreeBlocks(HypicError):
    """Fewer free KV blocks than asked for; the scheduler evicts, preempts or waits."""


class BlockPool:
    """Block ids 0..num_blocks-1. Invariant: a block is on the free list iff its refcount is 0.

    A warm 16k-token request takes, refs and releases ~1000 blocks several times over, on the host
    before its first token: the free list is a stack (slices, not a block at a time) and the loops
    bind their lists locally."""

    def __init__(self, num_blocks: int) -> None:
        self._refcounts = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # the end is taken first: 0, 1, 2, ...

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with refcount 1; takes nothing when fewer than n are free."""
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        free, refcounts = self._free, self._refcounts
        ids = free[len(free) - n:][::-1]
        del free[len(free) - n:]
        for i in ids:
            refcounts[i] = 1
        return ids

    def ref(self, ids: Iterable[int]) -> None:
        """One more owner for each block (a block may appear several times)."""
        refcounts = self._refcounts
        for i in ids:
            if not refcounts[i]:
                raise RuntimeError(f"internal error: ref of free KV block {i}")
            refcounts[i] += 1

    def release(self, ids: Iterable[int]) -> None:
        """One owner fewer for each block; a block nobody owns goes back to the free list."""
        refcounts, free = self._refcounts, self._free
        for i in ids:
            owners = refcounts[i]
            if not owners:
                raise RuntimeError(f"internal error: release of free KV block {i}")
            refcounts[i] = owners - 1
            if owners == 1:
                free.append(i)

    def refcount(self, block_id: int) -> int:
        return self._refcounts[block_id]
