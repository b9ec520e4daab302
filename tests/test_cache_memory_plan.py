"""plan_cache and longest_context against numbers worked out by hand."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hypic.cache.memory_plan import CachePlan, longest_context, plan_cache
from hypic.cache.model_caches import CacheShape, LinearShape, ModelCaches
from hypic.errors import OutOfMemoryError, UnsupportedModelError
from hypic.kernels.linear_families import get_family

# page: 2 layers * 4 tokens * (K and V) * 2 heads * 4 dims * 2 bytes = 256 bytes
# slot: 3 layers * (2 heads * 4 * 4 * 4 bytes + 8 channels * 3 * 2 bytes) = 3 * (128 + 48) = 528 bytes
SHAPE = CacheShape(full_layers=(3, 7), linear_layers=(0, 1, 2), num_kv_heads=2, head_dim=4,
                   linear=(LinearShape(get_family("gdn"), value_heads=2, key_dim=4, value_dim=4, conv_dim=8,
                                       conv_kernel=4),) * 3)
ONE_REQUEST = 16 * 256 + 528  # max_model_len 64 = 16 pages, plus one slot


def plan(budget: int, max_num_seqs: int = 4, shape: CacheShape = SHAPE) -> CachePlan:
    return plan_cache(shape, budget_bytes=budget, block_size=4, dtype=torch.bfloat16, max_model_len=64,
                      max_num_seqs=max_num_seqs)


def test_shape_byte_counts() -> None:
    assert SHAPE.page_bytes(4, torch.bfloat16) == 256 and SHAPE.slot_bytes(torch.bfloat16) == 528


def test_large_budget_gives_two_slots_per_sequence_and_the_rest_to_pages() -> None:
    p = plan(100_000)
    assert (p.num_blocks, p.num_slots, p.kv_tokens) == ((100_000 - 8 * 528) // 256, 8, 374 * 4)
    assert str(p) == "374 KV blocks (1496 tokens), 8 state slots"


def test_slots_are_capped_by_one_full_context_request() -> None:
    p = plan(7_000, max_num_seqs=8)  # (7000 - 4096) // 528 = 5 slots, not 16
    assert (p.num_slots, p.num_blocks) == (5, (7_000 - 5 * 528) // 256)


def test_slots_take_at_most_half_the_budget() -> None:
    p = plan(10_000, max_num_seqs=8)  # 5000 // 528 = 9 slots, not 16 (one full context would allow 11)
    assert (p.num_slots, p.num_blocks) == (9, (10_000 - 9 * 528) // 256)


def test_exactly_one_request_fits() -> None:
    p = plan(ONE_REQUEST)
    assert (p.num_blocks, p.num_slots) == (16, 1)


def test_too_small_a_budget_says_what_it_needs() -> None:
    with pytest.raises(OutOfMemoryError) as err:
        plan(ONE_REQUEST - 1)
    message = str(err.value)
    assert str(ONE_REQUEST) in message and str(ONE_REQUEST - 1) in message and "max_model_len" in message


def test_the_longest_context_leaves_each_sequence_a_slot_and_a_checkpoint() -> None:
    """A budget too small for the model's own context: max_model_len is cut so that the plan still
    holds max_num_seqs sequences and a checkpoint each (not the two slots a full context would leave)."""
    longest = longest_context(SHAPE, budget_bytes=20_000, block_size=4, dtype=torch.bfloat16, max_num_seqs=4)
    assert longest == (20_000 - 8 * 528) // 256 * 4  # 8 slots, 61 pages
    p = plan_cache(SHAPE, budget_bytes=20_000, block_size=4, dtype=torch.bfloat16, max_model_len=longest,
                   max_num_seqs=4)
    assert (p.num_slots, p.num_blocks) == (8, 61)
    half = longest_context(SHAPE, budget_bytes=5_000, block_size=4, dtype=torch.bfloat16, max_num_seqs=8)
    assert half == (5_000 - 4 * 528) // 256 * 4  # slots take at most half the budget: 4 of them


def test_model_without_full_layers() -> None:
    p = plan(10 * 528, shape=CacheShape(**{**SHAPE.__dict__, "full_layers": ()}))
    assert (p.num_slots, p.num_blocks) == (8, 8 * 16)  # pages are free: each slot's sequence gets a full context


def test_model_without_linear_layers() -> None:
    p = plan(10_000, shape=CacheShape(**{**SHAPE.__dict__, "linear_layers": (), "linear": ()}))
    assert (p.num_slots, p.num_blocks) == (8, 10_000 // 256)


@settings(max_examples=100, deadline=None)
@given(budget=st.integers(ONE_REQUEST, 1 << 24), max_num_seqs=st.integers(1, 64))
def test_plan_fits_the_budget_and_one_full_request(budget: int, max_num_seqs: int) -> None:
    p = plan(budget, max_num_seqs)
    assert p.num_blocks * 256 + p.num_slots * 528 <= budget
    assert p.num_blocks >= 16 and 1 <= p.num_slots <= 2 * max_num_seqs


def test_each_linear_layer_keeps_its_own_shapes() -> None:
    scalar = LinearShape(get_family("scalar"), value_heads=3, key_dim=2, value_dim=5, conv_dim=6, conv_kernel=4)
    shape = CacheShape(**{**SHAPE.__dict__, "linear": (SHAPE.linear[0], scalar, SHAPE.linear[0])})
    # slot: 2 x 176 bytes as above + (3 * 2 * 5 * 4 + 6 * 3 * 2) = 120 + 36 for the scalar layer
    assert shape.slot_bytes(torch.bfloat16) == 2 * 176 + 156
    caches = ModelCaches(shape, num_blocks=2, block_size=4, num_slots=3, dtype=torch.bfloat16, device="cpu")
    ssm, conv = caches.state(1)
    assert ssm.shape == (3, 3, 2, 5) and conv.shape == (3, 6, 3) and caches.state(0)[0].shape == (3, 2, 4, 4)


def test_linear_layers_of_different_conv_widths_are_refused() -> None:
    wide = LinearShape(get_family("gdn"), value_heads=2, key_dim=4, value_dim=4, conv_dim=8, conv_kernel=5)
    with pytest.raises(UnsupportedModelError, match=r"different conv widths \[4, 5\]"):
        CacheShape(**{**SHAPE.__dict__, "linear": (SHAPE.linear[0], wide, SHAPE.linear[0])})
