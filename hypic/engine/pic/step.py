"""Builds a step's PIC part on the host (`hypic.models.batch.PicStep`): the assembly of the chunks
that compose cached pieces and the capture of cold segments, as index tensors the linear and
full layers use (see `hypic.models.batch` for what each holds)."""
from __future__ import annotations

import itertools

import torch

from hypic.cache.segment_store import SegmentLayout, SegmentStore, TupleStaging
from hypic.engine.pic.pieces import walk_length
from hypic.kernels.compose import CachedPieces, StateCheckpoints
from hypic.kernels.host_copy import host_to_device
from hypic.kernels.varlen import RowSpans, StateSpans
from hypic.models.batch import Assembly, Capture, PicStep


def build_pic_step(chunks: list, seq_lens: tuple[int, ...], num_decodes: int, store: SegmentStore,
                   device: torch.device) -> PicStep | None:
    """The PIC part of a step over the segment store `store`; None when no chunk needs one."""
    width = store.layout.conv_kernel
    assembly = build_assembly(chunks, seq_lens, num_decodes, width, device)
    capture = build_capture(chunks, seq_lens, store.layout, device)
    if assembly is None and capture is None:
        return None
    return PicStep(assembly, capture, store)


def build_assembly(chunks: list, seq_lens: tuple[int, ...], num_decodes: int, conv_width: int,
                   device: torch.device) -> Assembly | None:
    """`chunks`: the step's ScheduledChunks (decodes first). None when no chunk composes pieces or
    is walked."""
    composing = [i for i, c in enumerate(chunks) if c.chunk.cached or c.walked]
    if not composing:
        return None
    cu = [0, *itertools.accumulate(seq_lens)]
    walk_len = {i: walk_length(chunks[i].chunk) for i in composing}
    others = [i for i in range(len(chunks)) if i not in walk_len]
    tails = [i for i in composing if walk_len[i] < seq_lens[i]]
    piece_rows, tail_offsets, offset = [], [], 0
    for i in composing:
        piece_rows.append([(offset + at, p.entry.t_offset(0), p.entry.s0_offset(0))
                           for at, p in chunks[i].chunk.cached])
        tail_offsets += [row for _, p in chunks[i].chunk.cached for row in p.entry.tail_offsets()]
        offset += walk_len[i]
    rest_spans = [(cu[i], cu[i + 1]) for i in others] + [(cu[i] + walk_len[i], cu[i + 1]) for i in tails]
    conv_index, conv_keep, conv_lens = _splice(chunks, cu, seq_lens, conv_width)
    saves, save_conv_rows = _saves(chunks, composing, walk_len, conv_keep, conv_lens, cu, conv_width, device)
    walk_lens = [walk_len[i] for i in composing]
    rest_lens = tuple(end - start for start, end in rest_spans)
    return Assembly(
        seqs=tuple(composing),
        walk=StateSpans(_long([chunks[i].seq.slot for i in composing], device),
                        host_to_device([chunks[i].chunk.start > 0 for i in composing], torch.bool, device),
                        _cumsum(walk_lens, device), 0, tuple(walk_lens)),
        walk_rows=_long([r for i in composing for r in range(cu[i], cu[i] + walk_len[i])], device),
        walks_every_row=not others and not tails,
        pieces=CachedPieces.build(piece_rows, device),
        rest=StateSpans(_long([chunks[i].seq.slot for i in others + tails], device),
                        host_to_device([chunks[i].chunk.start > 0 for i in others] + [True] * len(tails),
                                       torch.bool, device),
                        _cumsum(rest_lens, device), num_decodes, rest_lens),
        rest_rows=_long([r for start, end in rest_spans for r in range(start, end)], device),
        saves=saves, save_conv_rows=save_conv_rows,
        tail_offsets=_long(tail_offsets, device), conv_index=_long(conv_index, device),
        conv_keep=_long(conv_keep, device),
        conv_cu_seqlens=_cumsum(conv_lens, device), conv_lens=tuple(conv_lens))


def _saves(chunks: list, composing: list[int], walk_len: dict[int, int], conv_keep: list[int],
           conv_lens: list[int], cu: list[int], width: int,
           device: torch.device) -> tuple[StateCheckpoints, torch.Tensor]:
    """Where each walking sequence keeps the state before its last token, if its chunk asks
    (`ScheduledChunk.checkpoint_slot`: the scheduler asks only when the whole chunk is walked)."""
    at, slots, conv_rows, walk_offset = [], [], [], 0
    conv_ends = list(itertools.accumulate(conv_lens))
    for i in composing:
        slot = chunks[i].checkpoint_slot
        last_row = conv_ends[i] if slot is None else conv_keep[cu[i + 1] - 1]
        at.append(-1 if slot is None else walk_offset + walk_len[i] - 1)
        slots.append(chunks[i].seq.slot if slot is None else slot)
        conv_rows.append(list(range(last_row - width + 1, last_row)))
        walk_offset += walk_len[i]
    return StateCheckpoints(_long(at, device), _long(slots, device)), _long(conv_rows, device)


def _splice(chunks: list, cu: list[int], seq_lens: tuple[int, ...], width: int):
    """Rows of cat([x, tails]) for the spliced conv input: each piece's W-1 tail rows go right
    before the token the piece is composed in front of (or at the end of the sequence)."""
    tail_base = cu[-1]
    index, keep, lens = [], [], []
    for i, scheduled in enumerate(chunks):
        start = len(index)
        cursor = 0
        for at, _ in scheduled.chunk.cached:
            keep += range(len(index), len(index) + at - cursor)
            index += range(cu[i] + cursor, cu[i] + at)
            index += range(tail_base, tail_base + width - 1)
            tail_base += width - 1
            cursor = at
        keep += range(len(index), len(index) + seq_lens[i] - cursor)
        index += range(cu[i] + cursor, cu[i + 1])
        lens.append(len(index) - start)
    return index, keep, lens


def build_capture(chunks: list, seq_lens: tuple[int, ...], layout: SegmentLayout,
                  device: torch.device) -> Capture | None:
    """The interior rows each cold job's chunk holds (a long segment is prefilled chunk by chunk; the
    scheduler never cuts inside its last W-1 interior tokens, so its conv tail lies in one chunk), and
    the staging its layers capture the ending jobs' tuples into."""
    cu = [0, *itertools.accumulate(seq_lens)]
    jobs = [(i, c.seq.pic.job, c.chunk, c.seq.pic.captured) for i, c in enumerate(chunks)
            if c.seq.pic.job is not None and interior_rows(c.seq.pic.job, c.chunk) is not None]
    if not jobs:
        return None
    spans = [interior_rows(job, chunk) for _, job, chunk, _ in jobs]
    ends = tuple(chunk.end >= job.interior[1] for _, job, chunk, _ in jobs)
    width = layout.conv_kernel
    tails = [[cu[i] + job.interior[1] - chunk.start - width + 1 + t for t in range(width - 1)]
             for (i, job, chunk, _), end in zip(jobs, ends) if end]
    rows = RowSpans.build(tuple(cu[i] + a - chunk.start for (i, _, chunk, _), (a, _) in zip(jobs, spans)),
                          tuple(b - a for a, b in spans), device)
    return Capture(jobs=tuple(i for i, *_ in jobs),
                   identity_T=tuple(job.identity_T and end for (_, job, _, _), end in zip(jobs, ends)),
                   priors=tuple(None if chunk.start <= job.interior[0] else so_far for _, job, chunk, so_far in jobs),
                   ends=ends, spans=rows, tail_rows=_long(tails, device).reshape(len(tails), width - 1),
                   staged=TupleStaging(layout, len(tails), rows.rows.numel(), device),
                   ending=None if all(ends) else _long([j for j, end in enumerate(ends) if end], device),
                   going_on=None if all(ends) else _long([j for j, end in enumerate(ends) if not end], device))


def interior_rows(job, chunk) -> tuple[int, int] | None:
    """Positions [start, end) of the job's interior that `chunk` holds; None if it holds none."""
    start, end = max(chunk.start, job.interior[0]), min(chunk.end, job.interior[1])
    return (start, end) if start < end else None


def _long(values: list, device: torch.device) -> torch.Tensor:
    return host_to_device(values, torch.long, device)


def _cumsum(lengths: list[int] | tuple[int, ...], device: torch.device) -> torch.Tensor:
    return host_to_device([0, *itertools.accumulate(lengths)], torch.int32, device)
