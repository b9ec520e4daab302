"""Tiles of a flat varlen batch, found on the device (no host tables: graph-capturable).

Sequences first_seq .. first_seq + num_seqs - 1 own tokens cu[b] .. cu[b+1]. Each sequence's tiles
of `block` tokens start at its first token; sequence b's tiles are numbered from
(cu[b] - cu[first_seq]) // block + (b - first_seq), which leaves each sequence at least as many
numbers as it has tiles. A launch over `num_tiles(...)` programs covers every token; a program
whose tile starts past its sequence's end has nothing to do.
"""
from __future__ import annotations

from typing import Any

from hypic.kernels.triton_lazy import triton_kernel

tl: Any  # triton.language, bound by triton_lazy on first GPU use


def num_tiles(num_tokens: int, num_seqs: int, block: int) -> int:
    return num_tokens // block + num_seqs


@triton_kernel
def tile_start(cu_seqlens, first_seq, num_seqs, tile_id, BLOCK: tl.constexpr):
    """(sequence index, first token of this tile); binary search over the tile numbering."""
    base = tl.load(cu_seqlens + first_seq)
    lo = tl.full((), 0, tl.int32)  # tensors, not constants: both are re-assigned in the loop
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_tile = (tl.load(cu_seqlens + first_seq + mid) - base) // BLOCK + mid
        if first_tile <= tile_id:
            lo = mid
        else:
            hi = mid
    seq = first_seq + lo
    bos = tl.load(cu_seqlens + seq)
    return seq, bos + (tile_id - (bos - base) // BLOCK - lo) * BLOCK
