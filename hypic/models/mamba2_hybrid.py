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
                                 SwiGLUMLP)
from hypic.models.mamba2 import Mamba2Mixer
from hypic.models.mamba2_config import Mamba2HybridConfig


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
    """norm -> mixer or MLP; the caller adds it to the stream (times the residual multiplier)."""

    def __init__(self, config: Mamba2HybridConfig, index: int) -> None:
        super().__init__()
        self.index, self.kind = index, config.blocks[index]
        self.linear_index = config.linear_layers.index(index) if self.kind == "mamba" else -1
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=False)
        self.mixer = build_block(config, self.kind)

    def forward(self, normed: torch.Tensor, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        if self.kind == "mamba":
            return self.mixer(normed, batch, *caches.state(self.index), self.linear_index)
        if self.kind == "attention":
            return self.mixer(normed, batch, *caches.kv(self.index))
        return self.mixer(normed)


class Mamba2HybridModel(nn.Module):
    """embed (x embedding_multiplier) -> blocks -> final norm (logits rows only) -> lm head / logits_scaling."""

    def __init__(self, config: Mamba2HybridConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(len(config.blocks)))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=False)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                         bias=False)

    def cache_shape(self) -> CacheShape:
        """Pages for the attention blocks, a state slot for each Mamba2 block (its mixer's shapes)."""
        c = self.config
        linear = tuple(block.mixer.shape for block in self.blocks if block.kind == "mamba")
        return CacheShape(c.full_layers, c.linear_layers, c.num_key_value_heads, c.head_dim, linear)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Hidden states [M, hidden] of the tokens at batch.logits_indices, after the final norm."""
        hidden = self.embed_tokens(batch.input_ids)
        if self.config.embedding_multiplier != 1.0:
            hidden = hidden * self.config.embedding_multiplier
        delta, multiplier = None, self.config.residual_multiplier
        for block in self.blocks:
            if delta is None:
                normed = block.norm(hidden)
            else:
                normed, hidden = block.norm(delta, hidden)  # the stream is hidden + delta, added in the norm
            delta = block(normed, batch, caches)
            delta = delta * multiplier if multiplier != 1.0 else delta
        rows = batch.logits_indices
        return self.norm(delta[rows], hidden[rows])[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, hidden] -> [M, vocab_size] float32 (vocab_size may exceed the tokenizer's vocabulary)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = torch.nn.functional.linear(hidden, weight)
        scaling = self.config.logits_scaling
        return (logits / scaling if scaling != 1.0 else logits).float()
