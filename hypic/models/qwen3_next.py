"""HybridModel: the Qwen3-Next / Qwen3.5 decoder stack over a flat varlen ForwardBatch.

One class serves every supported model type; the differences (layer roles, dense vs MoE MLPs, tied
embeddings) come from HybridConfig. The model writes K/V into the pages and states into the slab in
place through the kernel functions.
"""
from __future__ import annotations

import torch
from torch import nn

from hypic.cache.model_caches import CacheShape, ModelCaches
from hypic.models.attention import GatedAttention
from hypic.models.batch import ForwardBatch
from hypic.models.config import HybridConfig
from hypic.models.gated_deltanet import GatedDeltaNet
from hypic.models.layers import RMSNorm, SparseMoeBlock, SwiGLUMLP


def build_mlp(config: HybridConfig, layer_id: int) -> nn.Module:
    c = config
    if layer_id in c.moe_layers:
        return SparseMoeBlock(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                              c.shared_expert_intermediate_size, c.norm_topk_prob)
    return SwiGLUMLP(c.hidden_size, c.intermediate_size)


class DecoderLayer(nn.Module):
    """Pre-norm block: h += mixer(norm(h)); h += mlp(norm(h)). The mixer is `linear_attn` (Gated DeltaNet)
    or `self_attn` (gated full attention), as layer_types says."""

    def __init__(self, config: HybridConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.is_linear = config.layer_types[layer_id] == "linear_attention"
        self.linear_index = config.linear_layers.index(layer_id) if self.is_linear else -1
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        self.mlp = build_mlp(config, layer_id)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def mix(self, hidden: torch.Tensor, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        if self.is_linear:
            return self.linear_attn(hidden, batch, *caches.state(self.layer_id), self.linear_index)
        return self.self_attn(hidden, batch, *caches.kv(self.layer_id))

    def forward(self, delta: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                caches: ModelCaches) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream is residual + delta, added inside the next norm (one fused pass on the GPU):
        returns this layer's (mlp output, stream before it)."""
        normed, residual = self.input_layernorm(delta, residual) if residual is not None else \
            (self.input_layernorm(delta), delta)
        normed, residual = self.post_attention_layernorm(self.mix(normed, batch, caches), residual)
        return self.mlp(normed), residual


class HybridModel(nn.Module):
    """embed -> decoder layers -> final norm (on the logits rows only) -> lm head (compute_logits)."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                         bias=False)

    def cache_shape(self) -> CacheShape:
        """What the caches hold per page and slot, from the layers: each linear layer's mixer names its shapes."""
        c = self.config
        linear = tuple(layer.linear_attn.shape for layer in self.layers if layer.is_linear)
        return CacheShape(c.full_layers, c.linear_layers, c.num_key_value_heads, c.head_dim, linear)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Hidden states [M, hidden] of the tokens at batch.logits_indices, after the final norm."""
        delta, residual = self.embed_tokens(batch.input_ids), None
        for layer in self.layers:
            delta, residual = layer(delta, residual, batch, caches)
        rows = batch.logits_indices
        return self.norm(delta[rows], residual[rows])[0] if residual is not None else self.norm(delta[rows])

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, hidden] -> [M, vocab_size] float32 (vocab_size may exceed the tokenizer's vocabulary)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()
