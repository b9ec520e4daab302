"""Attention of a flat varlen batch of queries over paged KV, causal by position, with GQA.

KV caches are [num_blocks, block_size, Hkv, D]; sequence b's KV index j lives in page
block_tables[b, j // block_size] at offset j % block_size. Token i of sequence b attends every
j < kv_lens[b] with j <= positions[i].

Paths: CPU -> `paged_attention_ref` (gather pages, SDPA); CUDA -> our Triton kernel. One program
takes a tile of query tokens times the G query heads of one KV head (rows = token x head), so each
KV page is read once per group. When the grid is too small to fill the GPU (decodes, and short
prefills over long KV such as a warm PIC assembly step), the KV range is split over several programs
and the partial softmaxes are merged; larger prefills walk each tile's whole causal range.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hypic.kernels.activation import sigmoid_gate, sigmoid_gate_triton, sigmoid_gated
from hypic.kernels.triton_lazy import next_power_of_2, triton_kernel
from hypic.kernels.varlen_tiles import num_tiles, tile_start

tl: Any  # triton.language, bound by triton_lazy on first GPU use

REF_QUERY_CHUNK = 256  # queries per SDPA call on CPU: bounds the [Hq, chunk, kv_len] score matrix


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             kv_write_slots: torch.Tensor) -> None:
    """k, v: [N, Hkv, D]; token i goes to flat slot kv_write_slots[i] = block * block_size + offset."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, kv_write_slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, kv_write_slots, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    kv_lens: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float,
                    num_decodes: int, seq_lens_cpu: tuple[int, ...], max_kv_len: int,
                    gate: torch.Tensor | None = None) -> torch.Tensor:
    """q: [N, Hq, D], Hq a multiple of Hkv. Returns [N, Hq, D], times sigmoid(gate) ([N, Hq * D], a
    row-strided view is fine: Qwen's output gate) when given. This step's K/V are already written."""
    if q.device.type != "cuda":
        out = paged_attention_ref(q, k_cache, v_cache, block_tables, kv_lens, positions, cu_seqlens, scale=scale,
                                  num_decodes=num_decodes, seq_lens_cpu=seq_lens_cpu, max_kv_len=max_kv_len)
        return out if gate is None else _gated(out, gate)
    out = torch.empty_like(q)
    nd = num_decodes
    groups = ((0, 0, seq_lens_cpu[:nd]), (nd, nd, seq_lens_cpu[nd:]))  # decodes: first nd tokens
    for first_seq, first_token, seq_lens in groups:
        if seq_lens:
            paged_attention_triton(q, k_cache, v_cache, block_tables, kv_lens, positions, cu_seqlens,
                                   scale=scale, out=out, first_seq=first_seq, first_token=first_token,
                                   seq_lens=seq_lens, max_kv_len=max_kv_len, gate=gate)
    return out


def _gated(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """out [T, Hq, D] times sigmoid(gate [T, Hq * D]), as the unfused gate rounds it."""
    return sigmoid_gate(out.reshape(out.shape[0], -1), gate).view(out.shape)


# ----------------------------------------------------------------------------- torch reference

def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        kv_lens: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float,
                        num_decodes: int, seq_lens_cpu: tuple[int, ...], max_kv_len: int) -> torch.Tensor:
    """Same contract as `paged_attention`: gathers each sequence's pages, float32 SDPA."""
    out = torch.empty_like(q)
    starts = list(itertools.accumulate(seq_lens_cpu, initial=0))
    for b, kv_len in enumerate(kv_lens.tolist()):
        keys, values = (_gather_pages(cache, block_tables[b], kv_len) for cache in (k_cache, v_cache))
        for s in range(starts[b], starts[b + 1], REF_QUERY_CHUNK):
            e = min(s + REF_QUERY_CHUNK, starts[b + 1])
            out[s:e] = attend_ref(q[s:e], keys, values, positions[s:e], scale)
    return out


def _gather_pages(cache: torch.Tensor, block_table: torch.Tensor, kv_len: int) -> torch.Tensor:
    pages = block_table[: -(-kv_len // cache.shape[1])]
    return cache[pages].flatten(0, 1)[:kv_len]  # [kv_len, Hkv, D]


def attend_ref(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               scale: float) -> torch.Tensor:
    """q [n, Hq, D] over one sequence's keys [L, Hkv, D] and values [L, Hkv, Dv], key j seen by the
    query at position p when j <= p; float32 SDPA, [n, Hq, Dv] in q's dtype."""
    mask = torch.arange(keys.shape[0], device=q.device)[None, :] <= positions[:, None]
    heads_first = [t.float().transpose(0, 1)[None] for t in (q, keys, values)]
    o = F.scaled_dot_product_attention(*heads_first, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1).to(q.dtype)


# ----------------------------------------------------------------------------- GPU: Triton

def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           kv_lens: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float,
                           out: torch.Tensor, first_seq: int, first_token: int, seq_lens: tuple[int, ...],
                           max_kv_len: int, splits: int | None = None, shape: Tiling | None = None,
                           gate: torch.Tensor | None = None) -> None:
    """Sequences first_seq.. of the batch (their tokens start at first_token). `Tiling.choose` may
    split the KV range over several programs; `splits` forces the count and `shape` the tile
    (benchmarks, tests). A `gate` (rows of every token of the batch) multiplies these tokens' output
    by its sigmoid: in the merge of a split range (no launch of its own), else in place after.
    Programs read KV lengths and positions on the device and host values only size the grid
    (max_kv_len picks the split count), so a captured CUDA graph stays correct for any KV lengths at
    replay."""
    tiling = Tiling.choose(q, k_cache, seq_lens, max_kv_len, splits, shape)
    num_tokens = sum(seq_lens)
    rows = slice(first_token, first_token + num_tokens)  # these sequences' tokens in out and gate
    if tiling.splits == 1:
        def launch(t: Tiling) -> None:
            grid = (num_tiles(num_tokens, len(seq_lens), t.tokens), k_cache.shape[2], 1)
            _launch(q, k_cache, v_cache, block_tables, kv_lens, positions, cu_seqlens, scale, out, None, 0, grid,
                    t, first_seq, len(seq_lens))
        if tiling.candidates:
            tiling = _fastest(tiling, num_tokens, q, k_cache, launch)
        launch(tiling)
        if gate is not None:
            gated = out[rows].view(num_tokens, -1)
            sigmoid_gate_triton(gated, gate[rows], out=gated)
        return
    grid = (num_tiles(num_tokens, len(seq_lens), tiling.tokens), k_cache.shape[2], tiling.splits)
    # per-split results of this group's tokens only: row 0 is token first_token (allocated per call:
    # inside a CUDA graph capture this comes from the graph's memory pool)
    partial = torch.empty((tiling.splits, num_tokens, *q.shape[1:]), dtype=torch.float32, device=q.device)
    lse = torch.empty(partial.shape[:3], dtype=torch.float32, device=q.device)
    _launch(q, k_cache, v_cache, block_tables, kv_lens, positions, cu_seqlens, scale, partial, lse, first_token,
            grid, tiling, first_seq, len(seq_lens))
    merge_splits(partial, lse, out[rows], gate[rows] if gate is not None else None)


def merge_splits(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, gate: torch.Tensor | None = None
                 ) -> None:
    """Softmax-weighted sum of per-split outputs [S, T, Hq, D] into out [T, Hq, D]; lse [S, T, Hq] in
    log2 units, -inf for empty splits; times sigmoid(gate [T, Hq * D]) when given, rounded as the
    unfused gate rounds. CUDA: one Triton pass (seven torch launches otherwise, plus the gate's)."""
    if partial.device.type != "cuda":
        weights = torch.exp2(lse - lse.amax(0, keepdim=True))
        out.copy_((partial * weights[..., None]).sum(0) / weights.sum(0)[..., None])
        if gate is not None:
            out.copy_(_gated(out, gate))
        return
    merge_splits_triton(partial, lse, out, gate)


def merge_splits_triton(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor,
                        gate: torch.Tensor | None = None) -> None:
    """One compiled merge serves every split count up to MAX_KV_SPLITS (a runtime loop, not a constexpr)."""
    splits, tokens, heads, dim = partial.shape
    if splits > MAX_KV_SPLITS:
        raise ValueError(f"the split-KV merge takes at most {MAX_KV_SPLITS} splits, got {splits}")
    partial, lse = partial.contiguous(), lse.contiguous()  # the kernel derives their split strides
    gate_stride = gate.stride(0) if gate is not None else 0
    _merge_kernel[(tokens, heads)](partial, lse, out, gate, tokens, splits, partial.stride(1), partial.stride(2),
                                   lse.stride(1), out.stride(0), out.stride(1), gate_stride, BS=MAX_KV_SPLITS, D=dim,
                                   BD=next_power_of_2(dim), GATED=gate is not None)


# Prefill tiles (rows, kv_block, warps, stages) for wide heads (D > 128) and narrow ones (D <= 128;
# 128 x 64 is FlashAttention's tile for D = 128), all spill-free on sm90 (ptxas). Which is fastest
# depends on the chip and the chunk, so the first chunk of each size times them.
WIDE_PREFILL_TILINGS = ((64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2), (64, 64, 8, 3),
                        (128, 32, 8, 3))
NARROW_PREFILL_TILINGS = ((128, 64, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 3))
# A split prefill (a warm assembly step) re-reads its keys once per query tile: the widest tile
# re-reads least (H200, Qwen3.5's 256-wide heads, 320 seam and query tokens over 16k keys: 0.29 ms vs
# 0.58 in 64 x 32; bench/results/attention_h200_qwen3_5_moe.json). Narrow heads in a group of 16
# (Nemotron 3: 32 query heads over 2 KV heads) fit only 4 tokens in 64 rows: 128 rows halve the re-reads.
SPLIT_TILING = (128, 64, 8, 2)
_FASTEST: dict[tuple, Tiling] = {}


def _fastest(default: Tiling, num_tokens: int, q: torch.Tensor, k_cache: torch.Tensor,
             launch: Callable[[Tiling], None]) -> Tiling:
    """The quickest candidate on this workload's shape class, timed once (three runs each, CUDA
    events) and remembered; the kernel is idempotent, so trial runs only rewrite the same output."""
    key = (q.shape[1:], k_cache.shape[1:], q.dtype, min(next_power_of_2(num_tokens), 16384))
    if key not in _FASTEST:
        timings = {t: _time(lambda t=t: launch(t)) for t in default.candidates}
        _FASTEST[key] = min(timings, key=timings.get)
    return _FASTEST[key]


def _time(run: Callable[[], None], reps: int = 3) -> float:
    run()  # compiles
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


@dataclass(frozen=True)
class Tiling:
    """Rows per program (query tokens x padded head group), KV tile, splits of the KV range, warps."""

    rows: int
    group: int
    kv_block: int
    splits: int
    warps: int
    stages: int = 2
    candidates: tuple[Tiling, ...] = ()  # alternatives worth timing on the device (wide-head prefill)

    @property
    def tokens(self) -> int:
        return self.rows // self.group

    @staticmethod
    def choose(q: torch.Tensor, k_cache: torch.Tensor, seq_lens: tuple[int, ...], max_kv_len: int,
               splits: int | None = None, shape: Tiling | None = None) -> Tiling:
        """Sizes that compile without register spills on sm90 (checked with ptxas, D = 128 and 256)
        unless `shape` forces rows, KV tile, warps and stages (its group must be the heads'); KV
        splits as `_kv_splits` picks them for that tile unless `splits` forces a count. A prefill
        with timed candidates that splits takes SPLIT_TILING, split for that tile's programs."""
        decode = max(seq_lens) == 1
        tiling = _tile_shape(q, k_cache, decode) if shape is None else _forced_shape(shape, q, k_cache)
        if splits is None:
            splits = _kv_splits(_programs(tiling, seq_lens, k_cache), max_kv_len, q.device, decode)
            if splits > 1 and tiling.candidates:  # a timed prefill that splits: its own tile and count
                rows, kv_block, warps, stages = SPLIT_TILING
                tiling = Tiling(rows, tiling.group, kv_block, 1, warps, stages)
                splits = _kv_splits(_programs(tiling, seq_lens, k_cache), max_kv_len, q.device, decode)
        if not 1 <= splits <= MAX_KV_SPLITS:
            raise ValueError(f"paged attention needs at least one KV split and at most {MAX_KV_SPLITS} (what the "
                             f"merge reads), got {splits}")
        # the timed candidates are for prefills that fill the GPU unsplit
        return tiling if splits == 1 else dataclasses.replace(tiling, splits=splits, candidates=())


def _tile_shape(q: torch.Tensor, k_cache: torch.Tensor, decode: bool) -> Tiling:
    """The unsplit tiling: rows, KV tile, warps (the split count changes none of them). A 16-bit
    prefill on the GPU has candidates to time; the first sizes the split rule's grid."""
    group = next_power_of_2(q.shape[1] // k_cache.shape[2])
    if q.dtype == torch.float32:  # twice the bytes per element: small tiles
        return Tiling(max(16, group), group, 16, 1, 4)
    if decode:
        return Tiling(max(16, group), group, 32, 1, 4)
    narrow = q.shape[2] <= 128
    if group > 64 or q.device.type != "cuda":
        return Tiling(max(64, group), group, 64 if narrow else 32, 1, 8)
    table = NARROW_PREFILL_TILINGS if narrow else WIDE_PREFILL_TILINGS
    candidates = tuple(Tiling(rows, group, kv_block, 1, warps, stages) for rows, kv_block, warps, stages in table)
    return dataclasses.replace(candidates[0], candidates=candidates)


def _programs(tiling: Tiling, seq_lens: tuple[int, ...], k_cache: torch.Tensor) -> int:
    """Programs with work (the grid's numbering leaves some empty): tiles of each sequence x KV heads."""
    return sum(-(-n // tiling.tokens) for n in seq_lens) * k_cache.shape[2]


def _forced_shape(shape: Tiling, q: torch.Tensor, k_cache: torch.Tensor) -> Tiling:
    """A caller's tile, checked against the heads: whole padded head groups per program, untimed."""
    group = next_power_of_2(q.shape[1] // k_cache.shape[2])
    if shape.group != group or shape.rows % group:
        raise ValueError(f"a tile of {shape.rows} rows in groups of {shape.group} does not fit {q.shape[1]} "
                         f"query heads over {k_cache.shape[2]} KV heads (groups of {group})")
    return dataclasses.replace(shape, candidates=())


# A prefill over fewer keys walks short tiles anyway: splitting it would not repay the merge.
PREFILL_SPLIT_MIN_KV = 1024
# The most KV splits of a row: the merge kernel's bound, a compile-time constant so that one merge
# serves every split count.
MAX_KV_SPLITS = 64


def streaming_multiprocessors(device: torch.device) -> int:
    """The SMs the split rules fill; the interpreter (CPU) has none: a few, so that tests exercise the
    split path."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _kv_splits(programs: int, max_kv_len: int, device: torch.device, decode: bool) -> int:
    """Enough KV splits to give every SM about two programs, none shorter than 128 keys: 1 once the
    unsplit grid fills the GPU. Decodes always qualify; prefills whose grid leaves SMs idle over a
    long KV range (a warm PIC assembly step: a few hundred seam and query tokens over 4k-20k keys),
    where the last tiles would walk every key alone. A prefill that already has a program per SM
    stays whole: split, it loses its timed tiling (H200: 1000 tokens over 4k keys, 250 programs,
    2 splits ran 2.5x slower; 192 tokens, 48 programs, 6 splits ran 2x faster)."""
    sms = streaming_multiprocessors(device)
    if not decode and (max_kv_len < PREFILL_SPLIT_MIN_KV or programs >= sms):
        return 1
    return max(1, min(-(-2 * sms // programs), max_kv_len // 128, MAX_KV_SPLITS))


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            kv_lens: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
            out: torch.Tensor, lse: torch.Tensor | None, out_row0: int, grid: tuple[int, int, int],
            tiling: Tiling, first_seq: int, num_seqs: int) -> None:
    """`out` is [N, Hq, D], or [splits, tokens, Hq, D] float32 (dense) with `lse` [splits, tokens, Hq];
    out's row 0 holds query token out_row0. The split count and the sizes of this step are runtime
    arguments, so that a tiling compiles once (twice: whole and split) whatever the batch."""
    head_dim = q.shape[2]
    split_rows = out.shape[1] if lse is not None else 0  # tokens of one split's slice of out and lse
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, lse, out_row0, split_rows, block_tables, kv_lens, positions, cu_seqlens,
        first_seq, num_seqs, tiling.splits, scale * math.log2(math.e), q.stride(0), q.stride(1), out.stride(-3),
        out.stride(-2), lse.stride(-2) if lse is not None else 0, k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0),
        G=q.shape[1] // k_cache.shape[2], GP=tiling.group, D=head_dim, BD=next_power_of_2(head_dim),
        BM=tiling.rows, BN=tiling.kv_block, PAGE=k_cache.shape[1], SPLIT=lse is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=tiling.warps,
        num_stages=tiling.stages)


# per-step values (a block table is as wide as the step's longest sequence needs)
@triton_kernel(do_not_specialize=("out_row0", "split_rows", "first_seq", "num_seqs", "num_splits", "stride_bt"))
def _paged_attention_kernel(q, k_cache, v_cache, out, lse, out_row0, split_rows, block_tables, kv_lens, positions,
                            cu_seqlens, first_seq, num_seqs, num_splits, scale_log2, stride_qt, stride_qh, stride_ot,
                            stride_oh, stride_lt, stride_kb, stride_kt, stride_kh, stride_bt,
                            G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr,
                            DOT_PRECISION: tl.constexpr):
    i_kvh, i_split = tl.program_id(1), tl.program_id(2)
    seq, t0 = tile_start(cu_seqlens, first_seq, num_seqs, tl.program_id(0), BM // GP)
    eos = tl.load(cu_seqlens + seq + 1)
    # row r = query token t0 + r // GP, query head i_kvh * G + r % GP (rows past G are padding)
    o_m = tl.arange(0, BM)
    o_tok = t0 + o_m // GP
    o_head = i_kvh * G + o_m % GP
    m_row = (o_tok < eos) & (o_m % GP < G)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    p_q = q + o_tok.to(tl.int64)[:, None] * stride_qt + o_head[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_row[:, None] & m_d[None, :], other=0.0)
    pos = tl.load(positions + o_tok, mask=m_row, other=-1).to(tl.int32)
    kv_len = tl.load(kv_lens + seq)
    # split i_split covers [start, start + split_len); causality caps it at the tile's largest position
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BN) * BN
    start = i_split * split_len
    stop = tl.minimum(tl.minimum(kv_len, tl.max(pos, axis=0) + 1), start + split_len)
    # finite, not -inf: a row that sees no key here (an empty split; an earlier token of a tile whose
    # later tokens reach into the split) keeps alpha = 1 and p = 0, so l = 0 and lse = -inf, no NaN
    m_i = tl.full((BM,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, BD), dtype=tl.float32)
    for j0 in range(start, stop, BN):
        o_n = j0 + tl.arange(0, BN)
        m_n = o_n < stop
        page = tl.load(block_tables + seq * stride_bt + o_n // PAGE, mask=m_n, other=0).to(tl.int64)
        p_kv = page * stride_kb + (o_n % PAGE) * stride_kt + i_kvh * stride_kh
        b_kt = tl.load(k_cache + p_kv[None, :] + o_d[:, None], mask=m_n[None, :] & m_d[:, None], other=0.0)
        scores = tl.dot(b_q, b_kt, input_precision=DOT_PRECISION) * scale_log2
        visible = m_n[None, :] & (o_n[None, :] <= pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        b_v = tl.load(v_cache + p_kv[:, None] + o_d[None, :], mask=m_n[:, None] & m_d[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
        m_i = m_new
    o = acc / tl.maximum(l_i, 1.0e-30)[:, None]
    o_row = (o_tok - out_row0).to(tl.int64)
    # split slices of split_rows rows (i_split is 0 unsplit); a product of the specialised token stride keeps
    # its divisibility, so the stores still vectorise
    p_o = out + i_split * (split_rows * stride_ot) + o_row[:, None] * stride_ot + o_head[:, None] * stride_oh
    tl.store(p_o + o_d[None, :], o.to(out.dtype.element_ty), mask=m_row[:, None] & m_d[None, :])
    if SPLIT:
        row_lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1.0e-30)), float("-inf"))
        tl.store(lse + i_split * (split_rows * stride_lt) + o_row * stride_lt + o_head, row_lse, mask=m_row)


@triton_kernel(do_not_specialize=("tokens", "splits"))
def _merge_kernel(partial, lse, out, gate, tokens, splits, stride_pt, stride_ph, stride_lt, stride_ot, stride_oh,
                  stride_gt, BS: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, GATED: tl.constexpr):
    """partial [splits, tokens, Hq, D] and lse [splits, tokens, Hq] dense; splits <= BS. The split count
    is a runtime value: the row's lse are one vector load masked to it, the partials a loop over it
    (one [BD] accumulator, whatever the count)."""
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_s, o_d = tl.arange(0, BS), tl.arange(0, BD)
    m_d = o_d < D
    stride_ps, stride_ls = tokens * stride_pt, tokens * stride_lt
    row_lse = tl.load(lse + o_s * stride_ls + t * stride_lt + h, mask=o_s < splits, other=float("-inf"))
    top = tl.max(row_lse, axis=0)
    total = tl.sum(tl.exp2(row_lse - top), axis=0)
    acc = tl.zeros((BD,), dtype=tl.float32)
    for s in range(0, splits):  # in split order; the compiler unrolls it by four, loads ahead (sm90 SASS)
        weight = tl.exp2(tl.load(lse + s * stride_ls + t * stride_lt + h) - top)
        acc += weight * tl.load(partial + s * stride_ps + t * stride_pt + h * stride_ph + o_d, mask=m_d, other=0.0)
    merged = (acc / total).to(out.dtype.element_ty)
    if GATED:
        b_g = tl.load(gate + t * stride_gt + h * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        merged = sigmoid_gated(merged.to(tl.float32), b_g, out)
    tl.store(out + t * stride_ot + h * stride_oh + o_d, merged, mask=m_d)
