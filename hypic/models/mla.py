"""Multi-head latent attention (MLA, DeepSeek-V2 style) as Kimi-Linear uses it: no positional encoding
at all (NoPE; the decoupled "rope" key part is one unrotated row shared by the heads), q with or
without a LoRA, softmax scale (nope + rope)^-1/2.

The pages hold the per-token latent [c | k_pe] (kv_lora_rank + rope channels, one row for all
heads). Decode tokens and short chunks attend in the latent space with the up-projections absorbed
(q_nope through W_uk, the output through W_uv); a long chunk of an eager step expands its sequence's
latents to per-head K/V once and runs flash attention over them (`mla_expanded_attention`), which
costs less when its queries outnumber `expand_from` (see `LatentAttention`). A chunk that composes
cached PIC pieces stays latent: its positions jump over the pieces, and only the latent kernel masks
by each token's own position. A step captured into a CUDA graph attends in the latent space
throughout: its host lengths are the capture batch's, so it reads every length from the device.
"""
from __future__ import annotations

import itertools
import math

import torch
from torch import nn

from hypic.kernels.mla_attention import gather_latents, mla_attention, mla_expanded_attention, write_latents
from hypic.models.batch import ForwardBatch
from hypic.models.kimi_config import KimiLinearConfig
from hypic.models.layers import RMSNorm

LATENT_NORM_EPS = 1e-6  # transformers' q_a / kv_a layernorms keep the RMSNorm default, not rms_norm_eps


class LatentAttention(nn.Module):
    """Weights: q_proj [H*(nope+rope), hidden] or q_a_proj / q_a_layernorm / q_b_proj; kv_a_proj_with_mqa
    [rank + rope, hidden]; kv_a_layernorm [rank]; kv_b_proj [H*(nope+v), rank] (per head: W_uk rows,
    then W_uv rows); o_proj [hidden, H*v]."""

    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__()
        c = config
        self.num_heads, self.rank, self.rope = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
        self.nope, self.v_dim = c.qk_nope_head_dim, c.v_head_dim
        self.scale = c.qk_head_dim ** -0.5
        q_out = self.num_heads * c.qk_head_dim
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS, offset=False)
            self.q_b_proj = nn.Linear(c.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.latent_dim, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, offset=False)
        self.kv_b_proj = nn.Linear(self.rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, c.hidden_size, bias=c.attention_bias)
        # n queries over L keys: expanding costs 2 L rank H (nope + v) + 2 n L H (qk + v) FLOPs, the
        # latent form 2 n L H (2 rank + rope); expand from the n where the first is the smaller
        saving = 2 * self.rank + self.rope - c.qk_head_dim - self.v_dim
        self.expand_from = math.ceil(self.rank * (self.nope + self.v_dim) / saving) if saving > 0 else 1

    def queries(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H, nope + rope]."""
        q = self.q_proj(hidden) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        return q.reshape(hidden.shape[0], self.num_heads, -1)

    def latents(self, hidden: torch.Tensor) -> torch.Tensor:
        """The page rows [N, 1, rank + rope]: normed latent c, then the shared key part k_pe."""
        c, k_pe = self.kv_a_proj_with_mqa(hidden).split((self.rank, self.rope), dim=-1)
        return torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1)[:, None]

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_uk [H, nope, rank] and W_uv [H, v, rank] from kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, :self.nope], w[:, self.nope:]

    def attend_absorbed(self, q: torch.Tensor, pages: torch.Tensor, batch: ForwardBatch, seqs: slice,
                        rows: slice) -> torch.Tensor:
        """Sequences `seqs` (tokens `rows`) in the latent space: [n, H, v]."""
        w_uk, w_uv = self.up_weights()
        q_abs = torch.cat([torch.einsum("nhd,hdr->nhr", q[rows, :, :self.nope], w_uk), q[rows, :, self.nope:]], -1)
        cu = batch.cu_seqlens[seqs.start:seqs.stop + 1]
        o = mla_attention(q_abs, pages, batch.block_tables[seqs], batch.kv_lens[seqs], batch.positions[rows],
                          cu - cu[0], scale=self.scale, rank=self.rank, seq_lens_cpu=batch.seq_lens_cpu[seqs],
                          max_kv_len=batch.max_kv_len)
        return torch.einsum("nhr,hvr->nhv", o, w_uv)

    def attend_expanded(self, q: torch.Tensor, pages: torch.Tensor, batch: ForwardBatch, seq: int,
                        rows: slice) -> torch.Tensor:
        """One sequence with its latents expanded to per-head K [L, H, nope + rope] and V [L, H, v]; its
        chunk's tokens are its last ones (positions L - n .. L - 1: a chunk that composes no pieces)."""
        latent = gather_latents(pages, batch.block_tables[seq], batch.kv_lens_cpu[seq])
        kv = self.kv_b_proj(latent[:, :self.rank]).view(-1, self.num_heads, self.nope + self.v_dim)
        k_pe = latent[:, None, self.rank:].expand(-1, self.num_heads, -1)
        keys = torch.cat([kv[..., :self.nope], k_pe], dim=-1)
        return mla_expanded_attention(q[rows], keys, kv[..., self.nope:], self.scale)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        """k_cache is the latent pages (v_cache the same tensor: the latent is key and value)."""
        q, rows = self.queries(hidden), self.latents(hidden)
        if batch.pic is not None and batch.pic.capture is not None:  # position-free: cached as they are
            batch.pic.capture.add_full(rows, None)
        write_latents(rows, k_cache, batch.kv_write_slots)
        return self.o_proj(self.attend(q, k_cache, batch).flatten(1))

    def attend(self, q: torch.Tensor, pages: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """[N, H, v]. In a CUDA graph the host lengths are the capture's: one latent pass over every
        sequence, which the kernel splits on the device."""
        if batch.in_graph:
            return self.attend_absorbed(q, pages, batch, slice(0, batch.num_seqs), slice(0, q.shape[0]))
        return self.attend_eager(q, pages, batch)

    def attend_eager(self, q: torch.Tensor, pages: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Decodes in one latent pass, each prefill chunk latent or expanded by its length (host lengths);
        chunks that compose cached pieces latent."""
        o = q.new_empty(q.shape[0], self.num_heads, self.v_dim)
        nd = batch.num_decodes
        if nd:
            o[:nd] = self.attend_absorbed(q, pages, batch, slice(0, nd), slice(0, nd))
        starts = list(itertools.accumulate(batch.seq_lens_cpu, initial=0))
        composing = batch.pic.assembly.seqs if batch.pic is not None and batch.pic.assembly is not None else ()
        for b in range(nd, batch.num_seqs):
            rows = slice(starts[b], starts[b + 1])
            if batch.seq_lens_cpu[b] >= self.expand_from and b not in composing:
                o[rows] = self.attend_expanded(q, pages, batch, b, rows)
            else:
                o[rows] = self.attend_absorbed(q, pages, batch, slice(b, b + 1), rows)
        return o
