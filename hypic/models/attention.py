"""The full-attention layer: GQA over paged KV with q/k RMSNorm, partial NeoX RoPE and a sigmoid output gate
(Qwen), or without q/k norm and gate, with RoPE or none (the Mamba2 hybrids), as the config says.

`qkv` hands back K after k_norm and *before* RoPE, so position-independent caching can keep segment
interiors un-rotated and rotate them at their global positions later; the pages hold rotated K.
"""
from __future__ import annotations

import torch
from torch import nn

from hypic.kernels.paged_attention import paged_attention, write_kv
from hypic.models.batch import ForwardBatch
from hypic.models.config import HybridConfig
from hypic.models.mamba2_config import Mamba2HybridConfig
from hypic.models.layers import RMSNorm, RotaryEmbedding


class GatedAttention(nn.Module):
    """Weights: qkv_proj rows are [q/gate interleaved per head (H * 2D, or H * D without the gate) |
    k (Hkv * D) | v (Hkv * D)]; o_proj [hidden, H * D]."""

    def __init__(self, config: HybridConfig | Mamba2HybridConfig) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.gated = c.attn_output_gate
        self.q_size = self.num_heads * self.head_dim * (2 if self.gated else 1)
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = c.attention_scale
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps) if c.attn_qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps) if c.attn_qk_norm else None
        self.rotary = RotaryEmbedding(c.rotary_dim, c.rope_theta)

    def qkv(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """(q rotated [N, H, D], gate [N, H * D] or None, k normed but NOT rotated [N, Hkv, D], v [N, Hkv, D])."""
        q, gate, k, v = self._projected(hidden, positions)
        return q, gate, self.k_norm(k) if self.k_norm is not None else k, v

    def _projected(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """`qkv` with k as projected (neither normed nor rotated)."""
        q_gate, k, v = self.qkv_proj(hidden).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q_gate = q_gate.reshape(-1, self.num_heads, self.q_size // self.num_heads)
        q, gate = q_gate.chunk(2, dim=-1) if self.gated else (q_gate, None)
        q = self.rotary(q, positions, norm=self.q_norm)
        gate = gate.reshape(hidden.shape[0], -1) if gate is not None else None
        return q, gate, k.reshape(-1, self.num_kv_heads, self.head_dim), v.reshape(-1, self.num_kv_heads, self.head_dim)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
               gate: torch.Tensor | None) -> torch.Tensor:
        """Causal (by position) attention over each sequence's pages, gated by sigmoid(gate) when given
        (inside the split-KV merge on the GPU); this step's K/V are already written."""
        return paged_attention(q, k_cache, v_cache, batch.block_tables, batch.kv_lens, batch.positions,
                               batch.cu_seqlens, scale=self.scale, num_decodes=batch.num_decodes,
                               seq_lens_cpu=batch.seq_lens_cpu, max_kv_len=batch.max_kv_len, gate=gate)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        if batch.plain_decode:  # k normed, rotated and written with v in one pass
            q, gate, k, v = self._projected(hidden, batch.positions)
            self.rotary.write(k, batch.positions, k_cache, batch.kv_write_slots, v, v_cache, norm=self.k_norm)
        else:
            q, gate, k, v = self.qkv(hidden, batch.positions)
            if batch.pic is not None and batch.pic.capture is not None:
                batch.pic.capture.add_full(k, v)
            write_kv(self.rotary(k, batch.positions), v, k_cache, v_cache, batch.kv_write_slots)
        o = self.attend(q, k_cache, v_cache, batch, gate)
        return self.o_proj(o.reshape(o.shape[0], -1))
