"""How many KV pages and state slots a byte budget holds."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hypic.cache.model_caches import CacheShape
from hypic.errors import OutOfMemoryError


@dataclass(frozen=True)
class CachePlan:
    num_blocks: int
    num_slots: int
    block_size: int

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def __str__(self) -> str:
        return f"{self.num_blocks} KV blocks ({self.kv_tokens} tokens), {self.num_slots} state slots"


def plan_cache(shape: CacheShape, *, budget_bytes: int, block_size: int, dtype: torch.dtype,
               max_model_len: int, max_num_seqs: int) -> CachePlan:
    """A state slot for each of max_num_seqs sequences and as many checkpoints again (fewer if they
    would take more than half the budget, or not fit beside one full-context request's pages); the
    rest of the budget as KV pages."""
    page, slot = shape.page_bytes(block_size, dtype), shape.slot_bytes(dtype)
    pages_per_seq = -(-max_model_len // block_size)
    needed = pages_per_seq * page + slot
    if budget_bytes < needed:
        raise OutOfMemoryError(
            f"the cache budget of {_size(budget_bytes)} cannot hold one request of max_model_len="
            f"{max_model_len}: that needs {_size(needed)} ({pages_per_seq} KV pages of {page} bytes + "
            f"one state slot of {slot} bytes); lower max_model_len or give the cache more memory "
            "(gpu_memory_utilization on GPU, cpu_cache_bytes on CPU)")
    wanted = _slots_wanted(budget_bytes, slot, max_num_seqs) if page else 2 * max_num_seqs
    num_slots = min(wanted, (budget_bytes - pages_per_seq * page) // slot) if slot else wanted
    # Without full-attention layers pages cost nothing: enough that blocks never run out first.
    num_blocks = (budget_bytes - num_slots * slot) // page if page else num_slots * pages_per_seq
    return CachePlan(num_blocks, num_slots, block_size)


def longest_context(shape: CacheShape, *, budget_bytes: int, block_size: int, dtype: torch.dtype,
                    max_num_seqs: int) -> int:
    """The longest max_model_len whose pages fit the budget beside the state slots plan_cache wants,
    so a budget too small for the model's own context still runs max_num_seqs sequences with checkpoints."""
    page, slot = shape.page_bytes(block_size, dtype), shape.slot_bytes(dtype)
    if not page:
        return 1 << 30
    left = budget_bytes - _slots_wanted(budget_bytes, slot, max_num_seqs) * slot
    return max(block_size, left // page * block_size)


def _slots_wanted(budget_bytes: int, slot: int, max_num_seqs: int) -> int:
    """A slot per sequence and a checkpoint each, in at most half of the budget (but always two), so
    pages are never starved by them."""
    return min(2 * max_num_seqs, max(2, budget_bytes // 2 // slot)) if slot else 2 * max_num_seqs


def _size(num_bytes: int) -> str:
    return f"{num_bytes} bytes ({num_bytes / 2**20:.1f} MiB)"
