"""Multi-head latent attention (MLA) over latent pages, causal by position.

An MLA page holds per token one latent row shared by every head: [c (kv_lora_rank) | k_pe (rope
dim)], pages [num_blocks, block_size, 1, rank + rope] (the block-table conventions of
`hypic.kernels.paged_attention`). With the up-projections absorbed into the queries,
q_abs = [W_uk^T q_nope | q_pe] per head, attention is multi-query over the latent rows themselves:
scores q_abs . row, output sum_j p_j c_j (the first `rank` channels); the caller applies W_uv.

Paths: CPU -> `mla_attention_ref` (the latent rows serve as keys and values of one shared KV head
through the paged reference's SDPA; the output's rope channels are dropped); CUDA -> our Triton
kernel (decodes, and short prefills over long context such as PIC seams). One program takes a tile
of `LatentTiling.tokens` query tokens of one sequence times its heads (rows = token x head: each
latent row read once for all of them, tokens with their own causal ends), and one of
`LatentTiling.parts` slices of the rank output channels: the [rows, rank] float32 accumulator of
rank 512 does not fit a program's registers, so two programs each compute the full 576-wide scores
and half the output. When that grid leaves SMs idle the KV range is split over programs and the
partial softmaxes merged (`paged_attention.merge_splits`). Host values only size the grid (no sync):
graph-capturable.

A prefill chunk with many queries of its own expands its sequence's latents to per-head keys and
values instead (`hypic.models.mla`) and attends through `mla_expanded_attention`: on CUDA torch's
flash attention, causal from the bottom right (the chunk is the sequence's last tokens).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from hypic.kernels.paged_attention import (MAX_KV_SPLITS, attend_ref, merge_splits, paged_attention_ref,
                                           streaming_multiprocessors)
from hypic.kernels.triton_lazy import next_power_of_2, triton_kernel
from hypic.kernels.varlen_tiles import num_tiles, tile_start

tl: Any  # triton.language, bound by triton_lazy on first GPU use


def mla_attention(q_abs: torch.Tensor, pages: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor,
                  positions: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float, rank: int,
                  seq_lens_cpu: tuple[int, ...], max_kv_len: int) -> torch.Tensor:
    """q_abs [N, H, rank + rope] -> latent outputs [N, H, rank]; this step's rows are already written."""
    if q_abs.device.type == "cuda":
        return mla_attention_triton(q_abs, pages, block_tables, kv_lens, positions, cu_seqlens, scale=scale, rank=rank,
                                    seq_lens_cpu=seq_lens_cpu, max_kv_len=max_kv_len)
    return mla_attention_ref(q_abs, pages, block_tables, kv_lens, positions, cu_seqlens, scale=scale, rank=rank,
                             seq_lens_cpu=seq_lens_cpu, max_kv_len=max_kv_len)


def mla_attention_ref(q_abs: torch.Tensor, pages: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor,
                      positions: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float, rank: int,
                      seq_lens_cpu: tuple[int, ...], max_kv_len: int) -> torch.Tensor:
    """Same contract as `mla_attention`, float32 SDPA."""
    o = paged_attention_ref(q_abs, pages, pages, block_tables, kv_lens, positions, cu_seqlens, scale=scale,
                            num_decodes=0, seq_lens_cpu=seq_lens_cpu, max_kv_len=max_kv_len)
    return o[..., :rank]


def mla_expanded_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Queries q [n, H, D] at a sequence's last n positions over all its expanded keys [L, H, D] and
    values [L, H, Dv], key j seen by query i when j <= L - n + i: [n, H, Dv] in q's dtype. CUDA: SDPA
    in the inputs' dtype with V zero-padded to D (torch's flash kernels take one head dim; causal from
    the bottom right); CPU: the float32 reference."""
    n, length, width = q.shape[0], keys.shape[0], values.shape[-1]
    if q.device.type != "cuda":
        return attend_ref(q, keys, values, torch.arange(length - n, length), scale)
    heads_first = [t.transpose(0, 1)[None] for t in (q, keys, F.pad(values, (0, q.shape[-1] - width)))]
    o = F.scaled_dot_product_attention(*heads_first, attn_mask=causal_lower_right(n, length), scale=scale)
    return o[0, ..., :width].transpose(0, 1)


def write_latents(rows: torch.Tensor, pages: torch.Tensor, kv_write_slots: torch.Tensor) -> None:
    """rows [N, 1, rank + rope]: token i goes to flat slot kv_write_slots[i] = block * block_size + offset."""
    pages.view(-1, *pages.shape[2:]).index_copy_(0, kv_write_slots, rows.to(pages.dtype))


def gather_latents(pages: torch.Tensor, block_table: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The first kv_len latent rows [kv_len, rank + rope] of one sequence's pages."""
    used = block_table[: -(-kv_len // pages.shape[1])]
    return pages[used].flatten(0, 1)[:kv_len, 0]


# ----------------------------------------------------------------------------- GPU: Triton

@dataclass(frozen=True)
class LatentTiling:
    """A program's tile: `tokens` query tokens of one sequence x `heads` heads (a power of two; the
    heads split over programs beyond it), one of `parts` slices of the output channels, a KV tile of
    `kv_block` rows; the KV range in `splits` pieces."""

    tokens: int
    heads: int
    parts: int
    kv_block: int
    splits: int
    warps: int
    stages: int = 2

    @property
    def rows(self) -> int:
        return self.tokens * self.heads

    @staticmethod
    def choose(q_abs: torch.Tensor, rank: int, seq_lens: tuple[int, ...], max_kv_len: int) -> LatentTiling:
        """Sizes checked with ptxas on sm90 at the 48B shape (32 heads, rank 512 + rope 64, bf16; no
        spills): a decode tile is one token's heads (32 rows, mma.sync, 178 registers); a longer
        chunk's packs four tokens (128 rows: wgmma, each KV tile read once for all four; 238 registers,
        216 KB of shared memory) and then the [128, 512] float32 accumulator takes two programs of half
        the channels each. On the H200 a warm 16 x 1k step's 384 seam rows over 16k keys take 0.99 ms with
        four tokens a tile, 2.37 ms with two (each KV tile is read by every tile of the chunk).
        KV tiles of 32 rows (16 in float32, twice the bytes). Splits as `latent_splits` picks them."""
        heads = next_power_of_2(q_abs.shape[1])
        head_tile = min(heads, 64)
        longest = max(seq_lens)
        rows = 32 if longest == 1 or q_abs.dtype == torch.float32 else chunk_rows(q_abs.device)
        tokens = max(min(max(1, rows // head_tile), next_power_of_2(longest)), 16 // head_tile, 1)
        parts = 2 if tokens * head_tile * rank > 32 * 512 else 1
        tiling = LatentTiling(tokens, head_tile, parts, 16 if q_abs.dtype == torch.float32 else 32, 1, 8)
        splits = latent_splits(tiling.programs(seq_lens, heads), max_kv_len, q_abs.device)
        return dataclasses.replace(tiling, splits=splits)

    def check(self, rank: int) -> None:
        """tl.dot's operands are at least 16 wide; the kernel knows one or two output parts; the merge reads
        up to MAX_KV_SPLITS splits."""
        if self.parts not in (1, 2) or rank % self.parts or self.rows < 16 or rank // self.parts < 16 \
                or self.heads & (self.heads - 1) or not 1 <= self.splits <= MAX_KV_SPLITS:
            raise ValueError(f"a latent tile of {self.tokens} tokens x {self.heads} heads in {self.parts} parts of "
                             f"rank {rank} in {self.splits} KV splits needs rows >= 16, 1 or 2 parts of >= 16 "
                             f"channels, a power-of-two head tile, 1 to {MAX_KV_SPLITS} splits")

    def programs(self, seq_lens: tuple[int, ...], heads: int) -> int:
        """Programs with work: token tiles of each sequence x head tiles x output parts."""
        return sum(-(-n // self.tokens) for n in seq_lens) * (heads // self.heads) * self.parts


def chunk_rows(device: torch.device) -> int:
    """Rows of a chunk's tile: four tokens of 32 heads where a program may take their 216 KB of shared
    memory (Hopper: 227 KB), two (147 KB) on GPUs with less (A100: 163 KB)."""
    if device.type != "cuda":
        return 128
    return 128 if torch.cuda.get_device_properties(device).shared_memory_per_multiprocessor >= 228 * 1024 else 64


def latent_splits(programs: int, max_kv_len: int, device: torch.device) -> int:
    """Enough KV splits for about four programs an SM (one fits at a time: the last wave idles less
    than with two), none shorter than 256 keys, at most 32 (the merge reads every split of a row)."""
    return max(1, min(-(-4 * streaming_multiprocessors(device) // programs), max_kv_len // 256, 32))


def mla_attention_triton(q_abs: torch.Tensor, pages: torch.Tensor, block_tables: torch.Tensor,
                         kv_lens: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float,
                         rank: int, seq_lens_cpu: tuple[int, ...], max_kv_len: int,
                         tiling: LatentTiling | None = None) -> torch.Tensor:
    """Same contract as `mla_attention`; `tiling` forces a tile (tests). Tiles find their sequence on
    the device; the host lengths only size the grid and the splits."""
    q_abs = q_abs.contiguous()
    tokens, heads, _ = q_abs.shape
    out = torch.empty(tokens, heads, rank, dtype=q_abs.dtype, device=q_abs.device)
    if not tokens:
        return out
    t = tiling or LatentTiling.choose(q_abs, rank, seq_lens_cpu, max_kv_len)
    t.check(rank)
    grid = (num_tiles(tokens, len(seq_lens_cpu), t.tokens), -(-heads // t.heads) * t.parts, t.splits)
    if t.splits == 1:
        _launch(q_abs, pages, block_tables, kv_lens, positions, cu_seqlens, out, None, scale, rank, grid, t)
        return out
    # per-split results (inside a CUDA graph capture these come from the graph's memory pool)
    partial = torch.empty((t.splits, tokens, heads, rank), dtype=torch.float32, device=q_abs.device)
    lse = torch.empty(partial.shape[:3], dtype=torch.float32, device=q_abs.device)
    _launch(q_abs, pages, block_tables, kv_lens, positions, cu_seqlens, partial, lse, scale, rank, grid, t)
    merge_splits(partial, lse, out)
    return out


def _launch(q_abs: torch.Tensor, pages: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor,
            positions: torch.Tensor, cu_seqlens: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
            scale: float, rank: int, grid: tuple[int, int, int], t: LatentTiling) -> None:
    """`out` is [N, H, rank], or [splits, N, H, rank] float32 (dense) with `lse` [splits, N, H] (log2 units)."""
    _mla_kernel[grid](
        q_abs, pages, block_tables, kv_lens, positions, cu_seqlens, out, lse, len(cu_seqlens) - 1, q_abs.shape[0],
        t.splits, scale * math.log2(math.e), block_tables.stride(0), num_warps=t.warps, num_stages=t.stages,
        **launch_constants(q_abs.shape[1], rank, q_abs.shape[2] - rank, pages.shape[1], q_abs.dtype, t))


def launch_constants(heads: int, rank: int, rope: int, page: int, dtype: torch.dtype,
                     t: LatentTiling) -> dict[str, int | str]:
    """The kernel's compile-time constants (shared with scripts/kernel_resources.py): the tile's, never the
    split count's (a runtime value: one variant serves every split count above 1)."""
    channels = rank // t.parts
    return dict(H=heads, R=rank, P=rope, PAGE=page, BT=t.tokens, BH=t.heads, PARTS=t.parts, C=channels,
                BC=next_power_of_2(channels), BP=max(16, next_power_of_2(rope)), BN=t.kv_block, SPLIT=t.splits > 1,
                DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32")


# per-step values; the index tensors are a step's sequences, views at offsets that change with the batch
@triton_kernel(do_not_specialize=("num_seqs", "num_tokens", "num_splits", "stride_bt"),
               do_not_specialize_on_alignment=("block_tables", "kv_lens", "positions"))
def _mla_kernel(q, pages, block_tables, kv_lens, positions, cu_seqlens, out, lse, num_seqs, num_tokens, num_splits,
                scale_log2, stride_bt, H: tl.constexpr, R: tl.constexpr, P: tl.constexpr, PAGE: tl.constexpr,
                BT: tl.constexpr, BH: tl.constexpr, PARTS: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
                BP: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    i_hc, i_split = tl.program_id(1), tl.program_id(2)
    seq, t0 = tile_start(cu_seqlens, 0, num_seqs, tl.program_id(0), BT)
    # row r = token t0 + r // BH, head (i_hc // PARTS) * BH + r % BH; output channels from `mine`
    o_m = tl.arange(0, BT * BH)
    o_tok = t0 + o_m // BH
    o_head = (i_hc // PARTS) * BH + o_m % BH
    m_row = (o_tok < tl.load(cu_seqlens + seq + 1)) & (o_head < H)
    mine = (i_hc % PARTS) * C
    o_c, o_p = tl.arange(0, BC), tl.arange(0, BP)
    m_c, m_p = o_c < C, o_p < P
    p_q = q + (o_tok.to(tl.int64) * H + o_head)[:, None] * (R + P)
    q_mine = tl.load(p_q + mine + o_c[None, :], mask=m_row[:, None] & m_c[None, :], other=0.0)
    q_pe = tl.load(p_q + R + o_p[None, :], mask=m_row[:, None] & m_p[None, :], other=0.0)
    if PARTS == 2:  # the other half of the score channels
        q_other = tl.load(p_q + (C - mine) + o_c[None, :], mask=m_row[:, None] & m_c[None, :], other=0.0)
    pos = tl.load(positions + o_tok, mask=m_row, other=-1).to(tl.int32)
    kv_len = tl.load(kv_lens + seq)
    # split i_split covers [start, start + split_len); causality caps it at the tile's largest position
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BN) * BN
    start = i_split * split_len
    stop = tl.minimum(tl.minimum(kv_len, tl.max(pos, axis=0) + 1), start + split_len)
    # finite, not -inf: a row that sees no key here (an empty split; an earlier token of the tile)
    # keeps alpha = 1 and p = 0, so l = 0 and lse = -inf, no NaN
    m_i = tl.full((BT * BH,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((BT * BH,), dtype=tl.float32)
    acc = tl.zeros((BT * BH, BC), dtype=tl.float32)
    for j0 in range(start, stop, BN):
        o_n = j0 + tl.arange(0, BN)
        m_n = o_n < stop
        page = tl.load(block_tables + seq * stride_bt + o_n // PAGE, mask=m_n, other=0).to(tl.int64)
        p_row = pages + (page * PAGE + o_n % PAGE)[:, None] * (R + P)
        c_mine = tl.load(p_row + mine + o_c[None, :], mask=m_n[:, None] & m_c[None, :], other=0.0)
        pe = tl.load(p_row + R + o_p[None, :], mask=m_n[:, None] & m_p[None, :], other=0.0)
        s = tl.dot(q_mine, tl.trans(c_mine), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(pe), s, input_precision=DOT_PRECISION)
        if PARTS == 2:
            c_other = tl.load(p_row + (C - mine) + o_c[None, :], mask=m_n[:, None] & m_c[None, :], other=0.0)
            s = tl.dot(q_other, tl.trans(c_other), s, input_precision=DOT_PRECISION)
        s = tl.where(m_n[None, :] & (o_n[None, :] <= pos[:, None]), s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c_mine.dtype), c_mine, input_precision=DOT_PRECISION)
        m_i = m_new
    o = acc / tl.maximum(l_i, 1.0e-30)[:, None]
    row = o_tok.to(tl.int64) * H + o_head
    p_o = out + i_split * (num_tokens * H * R) + row[:, None] * R + mine + o_c[None, :]  # i_split 0 unsplit
    tl.store(p_o, o.to(out.dtype.element_ty), mask=m_row[:, None] & m_c[None, :])
    if SPLIT:
        if i_hc % PARTS == 0:  # every part computes the same softmax: part 0 writes it
            row_lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1.0e-30)), float("-inf"))
            tl.store(lse + i_split * (num_tokens * H) + row, row_lse, mask=m_row)
