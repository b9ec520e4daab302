"""What a step with PIC work adds to its ForwardBatch, and the per-layer operations that use it.

Two kinds of PIC work ride in an ordinary step:
- assembly chunks: sequences whose chunk composes cached interiors. At each linear layer their
  recurrence runs through `compose_and_recur` (S <- T S + S0 at a piece, token recurrence between
  pieces) and each interior's conv tail is spliced into the conv input right where the interior
  sits, so the seam tokens after it see the interior's last k-1 pre-conv inputs (DESIGN §2).
- cold segments: isolated prefills whose interior inputs are captured at every layer; the tuple
  (T, S0, conv tail, pre-RoPE K and V) is built from them right there.
Sequences without pieces in the same step take the ordinary kernels.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import torch

from hypic.cache.segment_store import SegmentStore
from hypic.engine.forward_batch import ForwardBatch
from hypic.engine.pic.plan import SegmentJob
from hypic.engine.pic.pieces import walk_length
from hypic.kernels.compose import CachedPieces, StateCheckpoints, compose_and_recur
from hypic.kernels.conv1d import causal_conv1d
from hypic.kernels.gdn import gated_delta_rule
from hypic.kernels.host_copy import host_to_device
from hypic.kernels.linear_families import LinearFamily


@dataclass
class Assembly:
    """The step's sequences that compose cached pieces, split at each one's last piece: the walk
    (tokens up to it, composed and recurred token by token) and the tail (tokens after it, which
    continue from the composed state through the ordinary chunked kernel, with the sequences that
    compose nothing)."""

    walk_slots: torch.Tensor  # [A] state slots of the assembling sequences
    walk_has_state: torch.Tensor  # [A] whether each starts from its slot's state (else zeros)
    walk_rows: torch.Tensor  # [R] their walk tokens' rows in the flat batch, in order
    walks_every_row: bool  # walk_rows is every row of the step (a warm request alone): no gathers
    walk_cu_seqlens: torch.Tensor  # [A+1] int32, offsets into walk_rows
    pieces: CachedPieces  # `at` indexes walk_rows; offsets of linear layer 0
    rest_slots: torch.Tensor  # state slots of the other sequences, then of the non-empty tails
    rest_rows: torch.Tensor
    rest_has_state: torch.Tensor  # tails continue from the composed state in their slot
    rest_cu_seqlens: torch.Tensor
    rest_lens: tuple[int, ...]
    rest_decodes: int
    saves: StateCheckpoints  # per walking sequence: state before its last token (at -1: none), into a slot
    save_conv_rows: torch.Tensor  # [A, W-1] spliced conv rows before that token, into the same slot
    # (a sequence without a checkpoint rewrites its own slot with its last W-1 rows: no change)
    tail_offsets: torch.Tensor  # [P*(W-1)] int64: model_src offset of (piece, tap) at linear layer 0
    conv_index: torch.Tensor  # rows of cat([x, tails]) forming the spliced conv input
    conv_keep: torch.Tensor  # rows of the spliced conv output that belong to real tokens
    conv_cu_seqlens: torch.Tensor
    conv_lens: tuple[int, ...]


@dataclass
class Capture:
    """Cold segments of the step: where their interiors and conv tails sit in the flat batch."""

    jobs: list[SegmentJob]
    rows: torch.Tensor  # [R] interior token rows, job after job
    cu_seqlens: torch.Tensor  # [J+1] int32 offsets into rows
    seq_lens: tuple[int, ...]  # [J] interior lengths, on the host
    tail_rows: torch.Tensor  # [J, W-1] rows of the pre-conv inputs just before each interior's end
    T: list[torch.Tensor] = field(default_factory=list)  # per linear layer [J, HV, *t_shape]
    S0: list[torch.Tensor] = field(default_factory=list)  # per linear layer [J, HV, K, V]
    conv_tail: list[torch.Tensor] = field(default_factory=list)  # per linear layer [J, conv_dim, W-1]
    K: list[torch.Tensor] = field(default_factory=list)  # per full layer [R, Hkv, D] pre-RoPE
    V: list[torch.Tensor] = field(default_factory=list)


@dataclass
class PicStep:
    family: LinearFamily
    assembly: Assembly | None
    capture: Capture | None
    store: SegmentStore  # where the composed pieces' tuples and conv tails are read in place

    # -- linear layers -------------------------------------------------------------------------

    def conv(self, layer, mixed_qkv: torch.Tensor, conv_pool: torch.Tensor, batch: ForwardBatch,
             linear_index: int) -> torch.Tensor:
        """Causal conv1d with every composed interior's conv tail spliced in before its seam tokens."""
        a = self.assembly
        if a is None:
            return layer.conv(mixed_qkv, conv_pool, batch)
        spliced = torch.cat([mixed_qkv, self._conv_tails(a, linear_index)])[a.conv_index]
        out = causal_conv1d(spliced, layer.conv1d_weight, None, conv_pool, batch.slots, batch.has_state,
                            a.conv_cu_seqlens, num_decodes=batch.num_decodes, seq_lens_cpu=a.conv_lens,
                            activation="silu")
        conv_pool[a.saves.slots] = spliced[a.save_conv_rows].transpose(1, 2).to(conv_pool.dtype)
        return out[a.conv_keep]

    def _conv_tails(self, a: Assembly, linear_index: int) -> torch.Tensor:
        """[P*(W-1), conv_dim]: every composed piece's tail rows, gathered from the store in place
        (tensor offsets, not a list of views, so a CUDA graph can replay it for other pieces)."""
        rows = a.tail_offsets + linear_index * self.store.layout.conv_layer_stride
        return self.store.model_src[rows[:, None] + self.store.conv_channels[None, :]]

    def recur(self, layer, q, k, v, g, beta, ssm_pool: torch.Tensor, batch: ForwardBatch,
              linear_index: int) -> torch.Tensor:
        a = self.assembly
        if a is None:
            return layer.recur(q, k, v, g, beta, ssm_pool, batch)
        layout = self.store.layout
        pieces = a.pieces.shifted(linear_index * layout.t_layer_stride, linear_index * layout.s0_layer_stride)
        walk = functools.partial(compose_and_recur, ssm_pool=ssm_pool, slots=a.walk_slots,
                                 has_state=a.walk_has_state, cu_seqlens=a.walk_cu_seqlens,
                                 pieces=pieces, t_src=self.store.t_src, s0_src=self.store.s0_src,
                                 family=self.family, scale=layer.scale, checkpoints=a.saves)
        if a.walks_every_row:
            return walk(q, k, v, g, beta)
        o = torch.empty_like(v)
        r = a.walk_rows
        o[r] = walk(q[r], k[r], v[r], g[r], beta[r])
        if a.rest_rows.numel():  # after the walk: the tails read the composed states from the slots
            r = a.rest_rows
            o[r] = gated_delta_rule(q[r], k[r], v[r], g[r], beta[r], ssm_pool, a.rest_slots,
                                    a.rest_has_state, a.rest_cu_seqlens, scale=layer.scale,
                                    num_decodes=a.rest_decodes, seq_lens_cpu=a.rest_lens)
        return o

    def capture_linear(self, mixed_qkv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor) -> None:
        c = self.capture
        if c is None:
            return
        r = c.rows
        T, S0 = self.family.extract_tuple(k[r], v[r], g[r], beta[r], c.cu_seqlens, c.seq_lens)
        for j, job in enumerate(c.jobs):
            if job.identity_T:
                T[j] = self.family.identity_T(T.shape[1], k.shape[-1], T.dtype, T.device)
        c.T.append(T)
        c.S0.append(S0)
        c.conv_tail.append(mixed_qkv[c.tail_rows].transpose(1, 2).contiguous())

    def capture_full(self, k_pre_rope: torch.Tensor, v: torch.Tensor) -> None:
        if self.capture is not None:
            self.capture.K.append(k_pre_rope[self.capture.rows])
            self.capture.V.append(v[self.capture.rows])


# -- building a step's PIC part on the host --------------------------------------------------------

def build_pic_step(chunks: list, seq_lens: tuple[int, ...], num_decodes: int, store: SegmentStore,
                   family: LinearFamily, device: torch.device) -> PicStep | None:
    """The PIC part of a step over the segment store `store`; None when no chunk needs one."""
    width = store.layout.conv_kernel
    assembly = build_assembly(chunks, seq_lens, num_decodes, width, device)
    capture = build_capture(chunks, seq_lens, width, device)
    if assembly is None and capture is None:
        return None
    return PicStep(family, assembly, capture, store)


def build_assembly(chunks: list, seq_lens: tuple[int, ...], num_decodes: int, conv_width: int,
                   device: torch.device) -> Assembly | None:
    """`chunks`: the step's ScheduledChunks (decodes first). None when no chunk composes pieces."""
    composing = [i for i, c in enumerate(chunks) if c.chunk.cached]
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
        tail_offsets += [p.entry.conv_offset(0) + tap for _, p in chunks[i].chunk.cached
                         for tap in range(conv_width - 1)]
        offset += walk_len[i]
    rest_spans = [(cu[i], cu[i + 1]) for i in others] + [(cu[i] + walk_len[i], cu[i + 1]) for i in tails]
    conv_index, conv_keep, conv_lens = _splice(chunks, cu, seq_lens, conv_width)
    saves, save_conv_rows = _saves(chunks, composing, walk_len, conv_keep, conv_lens, cu, conv_width, device)
    return Assembly(
        walk_slots=_long([chunks[i].seq.slot for i in composing], device),
        walk_has_state=host_to_device([chunks[i].chunk.start > 0 for i in composing], torch.bool, device),
        walk_rows=_long([r for i in composing for r in range(cu[i], cu[i] + walk_len[i])], device),
        walks_every_row=not others and not tails,
        walk_cu_seqlens=_cumsum([walk_len[i] for i in composing], device),
        pieces=CachedPieces.build(piece_rows, device),
        rest_slots=_long([chunks[i].seq.slot for i in others + tails], device),
        rest_rows=_long([r for start, end in rest_spans for r in range(start, end)], device),
        rest_has_state=host_to_device([chunks[i].chunk.start > 0 for i in others] + [True] * len(tails),
                                      torch.bool, device),
        rest_cu_seqlens=_cumsum([end - start for start, end in rest_spans], device),
        rest_lens=tuple(end - start for start, end in rest_spans), rest_decodes=num_decodes,
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


def build_capture(chunks: list, seq_lens: tuple[int, ...], conv_width: int,
                  device: torch.device) -> Capture | None:
    cu = [0, *itertools.accumulate(seq_lens)]
    jobs = [(i, c.seq.segment_job) for i, c in enumerate(chunks) if c.seq.segment_job is not None]
    if not jobs:
        return None
    rows = [r for i, job in jobs for r in range(cu[i] + job.interior[0], cu[i] + job.interior[1])]
    tails = [[cu[i] + job.interior[1] - conv_width + 1 + t for t in range(conv_width - 1)] for i, job in jobs]
    lens = tuple(job.interior[1] - job.interior[0] for _, job in jobs)
    return Capture(jobs=[job for _, job in jobs], rows=_long(rows, device), cu_seqlens=_cumsum(lens, device),
                   seq_lens=lens, tail_rows=_long(tails, device))


def _long(values: list, device: torch.device) -> torch.Tensor:
    return host_to_device(values, torch.long, device)


def _cumsum(lengths: list[int] | tuple[int, ...], device: torch.device) -> torch.Tensor:
    return host_to_device([0, *itertools.accumulate(lengths)], torch.int32, device)
