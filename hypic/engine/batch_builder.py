"""Turns the scheduler's chunks into the flat tensors of a ForwardBatch (built on the host)."""
from __future__ import annotations

import array
import dataclasses
import itertools
from collections.abc import Iterable

import torch

from hypic.cache.segment_store import SegmentStore
from hypic.engine.pic.pieces import Chunk
from hypic.engine.pic.step import build_pic_step
from hypic.engine.scheduler import ScheduledBatch, ScheduledChunk
from hypic.kernels.host_copy import host_to_device_packed
from hypic.models.batch import ForwardBatch


def build_step(batch: ScheduledBatch, block_size: int, store: SegmentStore, device: torch.device) -> ForwardBatch:
    """The ForwardBatch of a step with its PIC part over the segment store `store`."""
    forward = build_forward_batch(batch, block_size, device)
    forward.pic = build_pic_step(batch.chunks, forward.seq_lens_cpu, forward.num_decodes, store, device)
    return forward


def build_forward_batch(batch: ScheduledBatch, block_size: int, device: torch.device) -> ForwardBatch:
    chunks = batch.chunks
    seq_lens = tuple(c.chunk.num_tokens for c in chunks)
    cu = [0, *itertools.accumulate(seq_lens)]
    ends = tuple(c.chunk.end for c in chunks)
    host = ForwardBatch(
        input_ids=_long(itertools.chain.from_iterable(c.chunk.token_ids for c in chunks)),
        positions=_long(itertools.chain.from_iterable(c.chunk.positions for c in chunks)),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        slots=_long(c.seq.slot for c in chunks),
        has_state=torch.tensor([c.chunk.start > 0 for c in chunks], dtype=torch.bool),
        block_tables=_pad([c.seq.block_ids for c in chunks]),
        kv_lens=torch.tensor(ends, dtype=torch.int32),
        kv_write_slots=_write_slots(chunks, block_size),
        logits_indices=_long(cu[i + 1] - 1 for i, c in enumerate(chunks) if c.samples),
        num_decodes=batch.num_decodes,
        seq_lens_cpu=seq_lens,
        kv_lens_cpu=ends,
        max_kv_len=max(ends),
    )
    return to_device(host, device)


def _long(values: Iterable[int]) -> torch.Tensor:
    """An int64 host tensor (through an array: torch.tensor walks a long prefill's ids ~4x slower)."""
    buffer = array.array("q", list(values))  # array() takes a list faster than a generator
    return torch.frombuffer(buffer, dtype=torch.long) if buffer else torch.empty(0, dtype=torch.long)


def to_device(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    """The batch's tensors onto the device in one copy; its host fields as they are."""
    moved = host_to_device_packed([getattr(batch, name) for name in TENSOR_FIELDS], device)
    return dataclasses.replace(batch, **dict(zip(TENSOR_FIELDS, moved)))


TENSOR_FIELDS = ("input_ids", "positions", "cu_seqlens", "slots", "has_state", "block_tables",
                  "kv_lens", "kv_write_slots", "logits_indices")


def _write_slots(chunks: list[ScheduledChunk], block_size: int) -> torch.Tensor:
    """block_id * block_size + offset of each token's K/V, one range per page a run of consecutive
    positions covers (plain Python: a loop over a long prefill's tokens cost milliseconds, and
    small CPU tensor ops cost more than this on a busy host)."""
    slots: list[int] = []
    for scheduled in chunks:
        for start, end in _position_runs(scheduled.chunk):
            while start < end:
                page = start // block_size
                stop = min(end, (page + 1) * block_size)
                shift = (scheduled.seq.block_ids[page] - page) * block_size
                slots += range(start + shift, stop + shift)
                start = stop
    return _long(slots)


def _position_runs(chunk: Chunk) -> list[tuple[int, int]]:
    """[start, end) ranges of the chunk's positions: consecutive but where they jump a cached piece."""
    cuts = [0, *(at for at, _ in chunk.cached), chunk.num_tokens]
    return [(chunk.positions[lo], chunk.positions[lo] + hi - lo) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]


def _pad(rows: list[list[int]]) -> torch.Tensor:
    """[B, max blocks] int32, padded with 0, in one tensor construction."""
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([[*r, *(0,) * (width - len(r))] for r in rows], dtype=torch.int32)
