"""Mamba2HybridModel: the Nemotron-H / Nemotron 3, Granite-4.0-H and Bamba stacks over a flat varlen
ForwardBatch, as one list of residual blocks h += m * block(plain_rms_norm(h)).

A block is a Mamba2 mixer, full attention (no q/k norm, no gate; RoPE or none), a dense MLP (relu^2
or SwiGLU) or a MoE (relu^2 experts behind the DeepSeek-style router with a shared expert, or
SwiGLU experts behind a softmax router beside Granite's shared MLP); Mamba2HybridConfig says which.
"""
from __future__ import annotations

import torch
from torch import nn

from hypic.cache.model_caches import CacheShape, ModelCaches
from hypic.models.attention import GatedAttention
from hypic.models.batch import ForwardBatch
from hypic.models.layers import (GroupedSigmoidRouter, ReluSquaredMLP, RMSNorm, RoutedMoeBlock, SoftmaxRouter,
                                 SwiGLUMLP, feed_forward)
from hypic.models.mamba2 import Mamba2Mixer
from hypic.models.mamba2_config import Mamba2HybridConfig
from hypic.models.stack import DecoderStack, add_norm


def build_mlp(config: Mamba2HybridConfig, width: int) -> nn.Module:
    return ReluSquaredMLP(config.hidden_size, width) if config.mlp_act == "relu2" else \
        SwiGLUMLP(config.hidden_size, width)


def build_moe(config: Mamba2HybridConfig) -> RoutedMoeBlock:
    c = config
    if c.router == "sigmoid_grouped":
        router = GroupedSigmoidRouter(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.n_group, c.topk_group,
                                      c.norm_topk_prob, c.routed_scaling_factor)
        shared = build_mlp(c, c.shared_intermediate_size) if c.shared_intermediate_size else None
    else:  # Granite: the shared MLP is the dense width
        router, shared = SoftmaxRouter(c.hidden_size, c.num_experts, c.num_experts_per_tok), build_mlp(
            c, c.intermediate_size)
    return RoutedMoeBlock(router, c.hidden_size, c.num_experts, c.moe_intermediate_size, c.mlp_act, shared)


def build_block(config: Mamba2HybridConfig, kind: str) -> nn.Module:
    if kind == "mamba":
        return Mamba2Mixer(config)
    if kind == "attention":
        return GatedAttention(config)
    return build_moe(config) if kind == "moe" else build_mlp(config, config.intermediate_size)


class Block(nn.Module):
    """norm -> mixer or MLP, times the residual multiplier: the stream's next delta."""

    def __init__(self, config: Mamba2HybridConfig, index: int) -> None:
        super().__init__()
        self.index, self.kind = index, config.blocks[index]
        self.linear_index = config.linear_layers.index(index) if self.kind == "mamba" else -1
        self.multiplier = config.residual_multiplier
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=False)
        self.mixer = build_block(config, self.kind)

    def mix(self, normed: torch.Tensor, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        if self.kind == "mamba":
            return self.mixer(normed, batch, *caches.state(self.index), self.linear_index)
        if self.kind == "attention":
            return self.mixer(normed, batch, *caches.kv(self.index))
        return feed_forward(self.mixer, normed, batch)

    def forward(self, delta: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                caches: ModelCaches) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = add_norm(self.norm, delta, residual)
        out = self.mix(normed, batch, caches)
        return (out * self.multiplier if self.multiplier != 1.0 else out), residual


class Mamba2HybridModel(DecoderStack):
    def __init__(self, config: Mamba2HybridConfig) -> None:
        super().__init__(config, offset=False, embedding_multiplier=config.embedding_multiplier,
                         logits_scaling=config.logits_scaling)
        self.layers = nn.ModuleList(Block(config, i) for i in range(len(config.blocks)))

    def cache_shape(self) -> CacheShape:
        """Pages for the attention blocks, a state slot for each Mamba2 block (its mixer's shapes)."""
        c = self.config
        linear = tuple(block.mixer.shape for block in self.layers if block.kind == "mamba")
        return CacheShape(c.full_layers, c.linear_layers, c.num_key_value_heads, c.head_dim, linear)
