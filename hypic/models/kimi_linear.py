"""KimiLinearModel: the Kimi-Linear stack over a flat varlen ForwardBatch. Pre-norm decoder layers
(plain RMSNorm): h += mixer(norm(h)), the mixer KDA or MLA as layer_types says; h += mlp(norm(h)),
a dense SwiGLU MLP or SwiGLU experts behind the DeepSeek-style router with shared experts beside.
"""
from __future__ import annotations

import torch
from torch import nn

from hypic.cache.model_caches import CacheShape, ModelCaches
from hypic.models.batch import ForwardBatch
from hypic.models.kda import KimiDeltaAttention
from hypic.models.kimi_config import KimiLinearConfig
from hypic.models.layers import GroupedSigmoidRouter, RMSNorm, RoutedMoeBlock, SwiGLUMLP
from hypic.models.mla import LatentAttention


def build_mlp(config: KimiLinearConfig, layer_id: int) -> nn.Module:
    c = config
    if layer_id not in c.moe_layers:
        return SwiGLUMLP(c.hidden_size, c.intermediate_size)
    router = GroupedSigmoidRouter(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.n_group, c.topk_group,
                                  c.norm_topk_prob, c.routed_scaling_factor)
    shared = SwiGLUMLP(c.hidden_size, c.moe_intermediate_size * c.num_shared_experts) if c.num_shared_experts else None
    return RoutedMoeBlock(router, c.hidden_size, c.num_experts, c.moe_intermediate_size, "silu", shared)


class DecoderLayer(nn.Module):
    def __init__(self, config: KimiLinearConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.is_linear = config.layer_types[layer_id] == "linear_attention"
        self.linear_index = config.linear_layers.index(layer_id) if self.is_linear else -1
        self.mixer = KimiDeltaAttention(config) if self.is_linear else LatentAttention(config)
        self.mlp = build_mlp(config, layer_id)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=False)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=False)

    def mix(self, hidden: torch.Tensor, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        if self.is_linear:
            return self.mixer(hidden, batch, *caches.state(self.layer_id), self.linear_index)
        return self.mixer(hidden, batch, *caches.kv(self.layer_id))

    def forward(self, delta: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                caches: ModelCaches) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream is residual + delta, added inside the next norm: returns (mlp output, stream before it)."""
        normed, residual = self.input_layernorm(delta, residual) if residual is not None else \
            (self.input_layernorm(delta), delta)
        normed, residual = self.post_attention_layernorm(self.mix(normed, batch, caches), residual)
        return self.mlp(normed), residual


class KimiLinearModel(nn.Module):
    """embed -> decoder layers -> final norm (on the logits rows only) -> lm head (compute_logits)."""

    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=False)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                         bias=False)

    def cache_shape(self) -> CacheShape:
        """Latent pages (one row of rank + rope channels a token) for the MLA layers, a state slot for each
        KDA layer (its mixer's shapes)."""
        c = self.config
        linear = tuple(layer.mixer.shape for layer in self.layers if layer.is_linear)
        return CacheShape(c.full_layers, c.linear_layers, 1, c.latent_dim, linear, shared_kv=True)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Hidden states [M, hidden] of the tokens at batch.logits_indices, after the final norm."""
        delta, residual = self.embed_tokens(batch.input_ids), None
        for layer in self.layers:
            delta, residual = layer(delta, residual, batch, caches)
        rows = batch.logits_indices
        return self.norm(delta[rows], residual[rows])[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, hidden] -> [M, vocab_size] float32."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()
