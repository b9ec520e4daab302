"""Turns the scheduler's chunks into the flat tensors of a ForwardBatch (built on the host)."""
from __future__ import annotations

import itertools

import torch

from hypic.cache.segment_store import SegmentStore
from hypic.engine.pic.step import build_pic_step
from hypic.engine.scheduler import ScheduledBatch
from hypic.kernels.host_copy import host_to_device
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
    positions = [p for c in chunks for p in c.chunk.positions]
    # plain Python: on a busy host small CPU tensor ops (repeat_interleave, index) took ~1-6 ms each
    # in the H200 profile, more than this loop over a warm step's tokens
    write_slots = [c.seq.block_ids[p // block_size] * block_size + p % block_size
                   for c in chunks for p in c.chunk.positions]
    host = ForwardBatch(
        input_ids=torch.tensor([t for c in chunks for t in c.chunk.token_ids], dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        slots=torch.tensor([c.seq.slot for c in chunks], dtype=torch.long),
        has_state=torch.tensor([c.chunk.start > 0 for c in chunks], dtype=torch.bool),
        block_tables=_pad([c.seq.block_ids for c in chunks]),
        kv_lens=torch.tensor([c.chunk.end for c in chunks], dtype=torch.int32),
        kv_write_slots=torch.tensor(write_slots, dtype=torch.long),
        logits_indices=torch.tensor([cu[i + 1] - 1 for i, c in enumerate(chunks) if c.samples],
                                    dtype=torch.long),
        num_decodes=batch.num_decodes,
        seq_lens_cpu=seq_lens,
        kv_lens_cpu=tuple(c.chunk.end for c in chunks),
        max_kv_len=max(c.chunk.end for c in chunks),
    )
    return to_device(host, device)


def to_device(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    if device.type == "cpu":
        return batch
    host = {name: getattr(batch, name) for name in TENSOR_FIELDS}
    moved = {name: host_to_device(tensor, tensor.dtype, device) for name, tensor in host.items()}
    return ForwardBatch(**moved, num_decodes=batch.num_decodes, seq_lens_cpu=batch.seq_lens_cpu,
                        kv_lens_cpu=batch.kv_lens_cpu, max_kv_len=batch.max_kv_len)


TENSOR_FIELDS = ("input_ids", "positions", "cu_seqlens", "slots", "has_state", "block_tables",
                  "kv_lens", "kv_write_slots", "logits_indices")


def _pad(rows: list[list[int]]) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, row in enumerate(rows):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return table
