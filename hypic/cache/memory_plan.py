"""How many KV pages and state slots a byte budget holds beside the capture workspace of cold segments."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hypic.cache.model_caches import CacheShape
from hypic.cache.segment_store import SegmentLayout
from hypic.errors import OutOfMemoryError
from hypic.kernels.gdn import CHUNK

# Cold segments whose interiors one step captures (the scheduler holds the rest to later steps). The
# capture workspace grows with the number of segments, not tokens: each stages its T, S0 and conv
# blocks (61 MiB on Qwen3.5-MoE) and a float32 tuple per linear layer, so a step of short documents
# would otherwise stage hundreds; 16 one-thousand-token documents already fill a 16k-token step.
CAPTURE_JOBS = 16
# Cold segments kept part-captured between steps (a long one, cut by the token budget, the long-prefill
# cap or memory): each keeps every linear layer's float32 tuple and its interior's K/V rows (as many as
# its pages) until its last chunk. One: a step cuts at most its last job, and a kept one goes first in
# the next step (long chunks in running order, the first always moves), so a second would only wait.
PARTIAL_JOBS = 1


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


def plan_beside_capture(shape: CacheShape, workspace: CaptureWorkspace, *, budget_bytes: int, max_model_len: int,
                        fit_context: bool, block_size: int, dtype: torch.dtype,
                        max_num_seqs: int) -> tuple[CachePlan, int]:
    """plan_cache over what the capture workspace leaves of the budget, and the context served:
    max_model_len, or with `fit_context` the longest up to it that fits beside the workspace (whose
    partial jobs' K/V grow with the context)."""
    args = dict(block_size=block_size, dtype=dtype, max_num_seqs=max_num_seqs)
    budget_bytes -= workspace.fixed_bytes
    if fit_context:
        longest = longest_context(shape, budget_bytes=budget_bytes, token_bytes=workspace.context_token_bytes, **args)
        max_model_len = min(max_model_len, longest)
    budget_bytes -= workspace.context_token_bytes * max_model_len
    try:
        return plan_cache(shape, budget_bytes=budget_bytes, max_model_len=max_model_len, **args), max_model_len
    except OutOfMemoryError as error:
        raise OutOfMemoryError(f"{error}; {_size(workspace.total(max_model_len))} of the budget was left first for "
                               "capturing cold segments (lower max_num_batched_tokens for less)") from None


def longest_context(shape: CacheShape, *, budget_bytes: int, block_size: int, dtype: torch.dtype,
                    max_num_seqs: int, token_bytes: int = 0) -> int:
    """The longest max_model_len whose pages (and `token_bytes` more a token of it) fit the budget
    beside the state slots plan_cache wants, so a budget too small for the model's own context still
    runs max_num_seqs sequences with checkpoints."""
    page, slot = shape.page_bytes(block_size, dtype), shape.slot_bytes(dtype)
    if not page:
        return 1 << 30
    left = budget_bytes - _slots_wanted(budget_bytes, slot, max_num_seqs) * slot
    return max(block_size, left // (page + token_bytes * block_size) * block_size)


@dataclass(frozen=True)
class CaptureWorkspace:
    """The most device memory the capture of cold segments holds during one step
    (`hypic.models.batch.Capture`), for the cache plan to leave free."""

    fixed_bytes: int  # whatever the context
    context_token_bytes: int  # and this much per token of max_model_len (the partial jobs' K/V rows)

    def total(self, max_model_len: int) -> int:
        return self.fixed_bytes + self.context_token_bytes * max_model_len

    @classmethod
    def of(cls, layout: SegmentLayout, *, step_tokens: int, jobs: int = CAPTURE_JOBS,
           partial_jobs: int = PARTIAL_JOBS) -> CaptureWorkspace:
        """For steps of `step_tokens` tokens: the staging of `jobs` ending tuples and of every row's
        K/V; at the largest linear layer, each job's float32 tuple and one per 64-token chunk of the
        step (the tuple kernels' per-chunk affine maps, a tuple's size each); for `partial_jobs`
        part-captured segments, all layers' float32 tuples twice (the last step's and this one's)
        and the K/V rows of an interior as long as the context."""
        if not layout.linear or not step_tokens:  # no linear layer or no step: nothing to capture
            return cls(0, 0)
        kv_row = layout.kv_token_stride * layout.model_dtype.itemsize
        tuples = [_tuple32_bytes(layout, i) for i in range(layout.num_linear)]
        staging = jobs * layout.fixed_bytes + step_tokens * kv_row
        per_layer = (jobs + -(-step_tokens // CHUNK) + jobs) * max(tuples)  # a span's padded last chunk: one each
        return cls(staging + per_layer + partial_jobs * 2 * sum(tuples), partial_jobs * kv_row)


def _tuple32_bytes(layout: SegmentLayout, linear_index: int) -> int:
    """One segment's T and S0 at one linear layer in float32, as the capture computes them."""
    return 4 * (math.prod(layout.t_shape(linear_index)) + math.prod(layout.s0_shape(linear_index)))


def _slots_wanted(budget_bytes: int, slot: int, max_num_seqs: int) -> int:
    """A slot per sequence and a checkpoint each, in at most half of the budget (but always two), so
    pages are never starved by them."""
    return min(2 * max_num_seqs, max(2, budget_bytes // 2 // slot)) if slot else 2 * max_num_seqs


def _size(num_bytes: int) -> str:
    return f"{num_bytes} bytes ({num_bytes / 2**20:.1f} MiB)"
