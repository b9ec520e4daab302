"""Multi-head latent attention (MLA) over latent pages, causal by position.

An MLA page holds per token one latent row shared by every head: [c (kv_lora_rank) | k_pe (rope
dim)], pages [num_blocks, block_size, 1, rank + rope] (the block-table conventions of
`hypic.kernels.paged_attention`). With the up-projections absorbed into the queries,
q_abs = [W_uk^T q_nope | q_pe] per head, attention is multi-query over the latent rows themselves:
scores q_abs . row, output sum_j p_j c_j (the first `rank` channels); the caller applies W_uv.

Paths: every device -> `mla_attention_ref` (the latent rows serve as keys and values of one shared
KV head through the paged reference's SDPA; the output's rope channels are dropped).
"""
from __future__ import annotations

import torch

from hypic.kernels.paged_attention import paged_attention_ref


def mla_attention(q_abs: torch.Tensor, pages: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor,
                  positions: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float, rank: int,
                  seq_lens_cpu: tuple[int, ...], max_kv_len: int) -> torch.Tensor:
    """q_abs [N, H, rank + rope] -> latent outputs [N, H, rank]; this step's rows are already written."""
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
