"""Multi-head latent attention (MLA) over latent pages, causal by position.

An MLA page holds per token one latent row shared by every head: [c (kv_lora_rank) | k_pe (rope
dim)], pages [num_blocks, block_size, 1, rank + rope] (the block-table conventions of
`hypic.kernels.paged_attention`). With the up-projections absorbed into the queries,
q_abs = [W_uk^T q_nope | q_pe] per head, attention is multi-query over the latent rows themselves:
scores q_abs . row, output sum_j p_j c_j (the first `rank` channels); the caller applies W_uv.

Paths: CPU -> `mla_attention_ref` (the latent rows serve as keys and values of one shared KV head
through the paged reference's SDPA; the output's rope channels are dropped); CUDA -> our Triton
kernel: one program per query token and tile of heads walks the token's causal KV range page by page
with an online softmax, reading each latent row once for all the tile's heads (decodes, and short
prefills over long context such as PIC seams). Host values only size the grid (no sync).
"""
from __future__ import annotations

from typing import Any

import torch

from hypic.kernels.paged_attention import paged_attention_ref
from hypic.kernels.triton_lazy import next_power_of_2, triton_kernel

tl: Any  # triton.language, bound by triton_lazy on first GPU use


def mla_attention(q_abs: torch.Tensor, pages: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor,
                  positions: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float, rank: int,
                  seq_lens_cpu: tuple[int, ...], max_kv_len: int) -> torch.Tensor:
    """q_abs [N, H, rank + rope] -> latent outputs [N, H, rank]; this step's rows are already written."""
    if q_abs.device.type == "cuda":
        return mla_attention_triton(q_abs, pages, block_tables, kv_lens, positions, cu_seqlens, scale=scale, rank=rank)
    return mla_attention_ref(q_abs, pages, block_tables, kv_lens, positions, cu_seqlens, scale=scale, rank=rank,
                             seq_lens_cpu=seq_lens_cpu, max_kv_len=max_kv_len)


def mla_attention_ref(q_abs: torch.Tensor, pages: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor,
                      positions: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float, rank: int,
                      seq_lens_cpu: tuple[int, ...], max_kv_len: int) -> torch.Tensor:
    """Same contract as `mla_attention`, float32 SDPA."""
    o = paged_attention_ref(q_abs, pages, pages, block_tables, kv_lens, positions, cu_seqlens, scale=scale,
                            num_decodes=0, seq_lens_cpu=seq_lens_cpu, max_kv_len=max_kv_len)
    return o[..., :rank]


def write_latents(rows: torch.Tensor, pages: torch.Tensor, kv_write_slots: torch.Tensor) -> None:
    """rows [N, 1, rank + rope]: token i goes to flat slot kv_write_slots[i] = block * block_size + offset."""
    pages.view(-1, *pages.shape[2:]).index_copy_(0, kv_write_slots, rows.to(pages.dtype))


def gather_latents(pages: torch.Tensor, block_table: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The first kv_len latent rows [kv_len, rank + rope] of one sequence's pages."""
    used = block_table[: -(-kv_len // pages.shape[1])]
    return pages[used].flatten(0, 1)[:kv_len, 0]


# ----------------------------------------------------------------------------- GPU: Triton

def mla_attention_triton(q_abs: torch.Tensor, pages: torch.Tensor, block_tables: torch.Tensor,
                         kv_lens: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float,
                         rank: int, block_n: int = 32) -> torch.Tensor:
    """Same contract as `mla_attention`; the token -> sequence map is built on the device (graph-capturable)."""
    q_abs = q_abs.contiguous()
    tokens, heads, width = q_abs.shape
    out = torch.empty(tokens, heads, rank, dtype=q_abs.dtype, device=q_abs.device)
    if not tokens:
        return out
    lengths = cu_seqlens.diff()
    seq_of_token = torch.repeat_interleave(torch.arange(lengths.numel(), dtype=torch.int32, device=q_abs.device),
                                           lengths, output_size=tokens)
    block_h = 16  # the smallest tile tl.dot takes; extra heads are masked
    grid = (tokens, -(-heads // block_h))
    _mla_kernel[grid](
        q_abs, pages, block_tables, kv_lens, positions, seq_of_token, out, scale, block_tables.stride(0),
        H=heads, R=rank, P=width - rank, BS=pages.shape[1], BH=block_h, BR=max(16, next_power_of_2(rank)),
        BP=max(16, next_power_of_2(width - rank)), BN=block_n,
        DOT_PRECISION="ieee" if q_abs.dtype == torch.float32 else "tf32", num_warps=8 if rank >= 256 else 4)
    return out


@triton_kernel
def _mla_kernel(q, pages, block_tables, kv_lens, positions, seq_of_token, out, scale, stride_bt,
                H: tl.constexpr, R: tl.constexpr, P: tl.constexpr, BS: tl.constexpr, BH: tl.constexpr,
                BR: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, DOT_PRECISION: tl.constexpr):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    b = tl.load(seq_of_token + i_t)
    end = tl.minimum(tl.load(kv_lens + b), tl.load(positions + i_t).to(tl.int32) + 1)  # causal by position
    o_h = i_h * BH + tl.arange(0, BH)
    o_r, o_p, o_n = tl.arange(0, BR), tl.arange(0, BP), tl.arange(0, BN)
    m_h, m_r, m_p = o_h < H, o_r < R, o_p < P
    q_rows = q + (i_t * H + o_h[:, None]) * (R + P)
    q_c = tl.load(q_rows + o_r[None, :], mask=m_h[:, None] & m_r[None, :], other=0.0)
    q_p = tl.load(q_rows + R + o_p[None, :], mask=m_h[:, None] & m_p[None, :], other=0.0)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BR], tl.float32)
    for start in range(0, end, BN):
        j = start + o_n
        m_j = j < end
        page = tl.load(block_tables + b * stride_bt + j // BS, mask=m_j, other=0).to(tl.int64)
        rows = pages + (page * BS + j % BS)[:, None] * (R + P)
        c = tl.load(rows + o_r[None, :], mask=m_j[:, None] & m_r[None, :], other=0.0)
        pe = tl.load(rows + R + o_p[None, :], mask=m_j[:, None] & m_p[None, :], other=0.0)
        s = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)
        s = (s + tl.dot(q_p, tl.trans(pe), input_precision=DOT_PRECISION)) * scale
        s = tl.where(m_j[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new
    o = acc / tl.maximum(l_i, 1.0e-30)[:, None]  # a token with no visible row (none here) stays 0
    tl.store(out + (i_t * H + o_h[:, None]) * R + o_r[None, :], o.to(out.dtype.element_ty),
             mask=m_h[:, None] & m_r[None, :])
