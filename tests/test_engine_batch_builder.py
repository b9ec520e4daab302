"""The step's flat tensors against the per-token formulas they replace (issue 29: built by page
runs and arrays, not a loop over tokens), and the one pinned copy that moves them to a GPU."""
from __future__ import annotations

import random

import pytest
import torch

from hypic.engine.batch_builder import TENSOR_FIELDS, build_forward_batch, to_device
from hypic.engine.pic.pieces import Cached, cut_chunk
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.engine.scheduler import ScheduledBatch, ScheduledChunk
from hypic.engine.sequence import RequestInfo, Sequence
from hypic.kernels.host_copy import host_to_device_packed
from hypic.sampling_params import SamplingParams

BLOCK = 16


def scheduled(rng: random.Random, computed: int, length: int, budget: int, pieces=()) -> ScheduledChunk:
    """A sequence of `length` tokens with `computed` done, its pages shuffled, and its next chunk."""
    ids = [rng.randrange(3, 300) for _ in range(length)]
    seq = Sequence(RequestInfo("r", SamplingParams(), SegmentedPrompt((tuple(ids),)), None, "none"), 0)
    seq.num_computed, seq.slot = computed, rng.randrange(8)
    seq.block_ids = rng.sample(range(1000), -(-length // BLOCK))
    cached = [Cached(start, end, None, True) for start, end in pieces]
    return ScheduledChunk(seq, cut_chunk(seq.token_ids, computed, length, budget, cached))


def batch() -> ScheduledBatch:
    rng = random.Random(0)
    decodes = [scheduled(rng, n - 1, n, 1) for n in (1 + 16, 33, 48)]  # at pages' first offsets, and a last
    prefills = [scheduled(rng, 5, 100, 90), scheduled(rng, 0, 200, 200, pieces=[(0, 20), (37, 70), (70, 90)])]
    return ScheduledBatch(decodes + prefills, num_decodes=len(decodes))


def test_forward_batch_matches_the_per_token_formulas():
    chunks = batch().chunks
    forward = build_forward_batch(batch(), BLOCK, torch.device("cpu"))
    tokens = [(c, p, t) for c in chunks for p, t in zip(c.chunk.positions, c.chunk.token_ids)]
    assert forward.positions.tolist() == [p for _, p, _ in tokens]
    assert forward.input_ids.tolist() == [t for _, _, t in tokens]
    assert forward.kv_write_slots.tolist() == [c.seq.block_ids[p // BLOCK] * BLOCK + p % BLOCK for c, p, _ in tokens]
    width = max(len(c.seq.block_ids) for c in chunks)
    assert forward.block_tables.tolist() == [c.seq.block_ids + [0] * (width - len(c.seq.block_ids)) for c in chunks]
    assert forward.slots.tolist() == [c.seq.slot for c in chunks]
    ends = torch.tensor([c.chunk.num_tokens for c in chunks]).cumsum(0) - 1
    assert forward.logits_indices.tolist() == [e for e, c in zip(ends.tolist(), chunks) if c.samples]
    assert forward.positions.dtype == forward.kv_write_slots.dtype == torch.long


@pytest.mark.gpu
def test_one_packed_copy_moves_every_tensor():
    host = build_forward_batch(batch(), BLOCK, torch.device("cpu"))
    moved = to_device(host, torch.device("cuda"))
    for name in TENSOR_FIELDS:
        before, after = getattr(host, name), getattr(moved, name)
        assert after.device.type == "cuda" and after.dtype == before.dtype and torch.equal(after.cpu(), before)
    odd = [torch.tensor([True, False, True]), torch.arange(5, dtype=torch.int32), torch.empty(0, dtype=torch.long)]
    assert all(torch.equal(a.cpu(), b) for a, b in zip(host_to_device_packed(odd, "cuda"), odd))
