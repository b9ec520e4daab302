"""What the hybrid stacks share: DecoderStack (embed -> residual layers -> final norm on the logits rows
only -> lm head) and PreNormLayer, the two-norm decoder layer of Qwen3-Next and Kimi-Linear.

The residual stream is carried as (delta, residual): each norm adds the last layer's output to the
stream inside one fused pass on the GPU (add_norm), so no layer writes the stream itself.
"""
from __future__ import annotations

import torch
from torch import nn

from hypic.cache.model_caches import ModelCaches
from hypic.models.batch import ForwardBatch
from hypic.models.config import HybridConfig
from hypic.models.kimi_config import KimiLinearConfig
from hypic.models.layers import RMSNorm, feed_forward
from hypic.models.mamba2_config import Mamba2HybridConfig

StackConfig = HybridConfig | KimiLinearConfig | Mamba2HybridConfig

def add_norm(norm: RMSNorm, delta: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(stream), stream) with stream = residual + delta; before the first layer the stream is delta."""
    return norm(delta, residual) if residual is not None else (norm(delta), delta)


class DecoderStack(nn.Module):
    """embed (x embedding_multiplier) -> layers -> final norm (logits rows only) -> lm head / logits_scaling.
    A subclass fills `layers`, each mapping (delta, residual, batch, caches) -> (delta, residual)."""

    # a prefill chunk may run in a CUDA graph padded within its own sequence (hypic.engine.pic.cold_graphs):
    # no layer splits a chunk by its host length
    prefill_graphs = True

    def __init__(self, config: StackConfig, offset: bool, embedding_multiplier: float = 1.0,
                 logits_scaling: float = 1.0) -> None:
        super().__init__()
        self.config = config
        self.embedding_multiplier, self.logits_scaling = embedding_multiplier, logits_scaling
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=offset)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                         bias=False)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Hidden states [M, hidden] of the tokens at batch.logits_indices, after the final norm."""
        delta = self.embed_tokens(batch.input_ids)
        if self.embedding_multiplier != 1.0:
            delta = delta * self.embedding_multiplier
        residual = None
        for layer in self.layers:
            delta, residual = layer(delta, residual, batch, caches)
        rows = batch.logits_indices
        return add_norm(self.norm, delta[rows], None if residual is None else residual[rows])[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, hidden] -> [M, vocab_size] float32 (vocab_size may exceed the tokenizer's vocabulary)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = torch.nn.functional.linear(hidden, weight)
        return (logits / self.logits_scaling if self.logits_scaling != 1.0 else logits).float()


class PreNormLayer(nn.Module):
    """h += mixer(norm(h)); h += mlp(norm(h)). The mixer is a linear one (its state in the cache's slot)
    or full attention (its K/V in the pages), as layer_types says; a subclass builds `mixer` and `mlp`."""

    def __init__(self, config: HybridConfig | KimiLinearConfig, layer_id: int, offset: bool) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.is_linear = config.layer_types[layer_id] == "linear_attention"
        self.linear_index = config.linear_layers.index(layer_id) if self.is_linear else -1
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=offset)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=offset)

    def mixer_module(self) -> nn.Module:
        """The layer's mixer; Qwen keeps its checkpoint's two names (linear_attn / self_attn) instead."""
        return self.mixer

    def mix(self, hidden: torch.Tensor, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        if self.is_linear:
            return self.mixer_module()(hidden, batch, *caches.state(self.layer_id), self.linear_index)
        return self.mixer_module()(hidden, batch, *caches.kv(self.layer_id))

    def forward(self, delta: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                caches: ModelCaches) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns this layer's (mlp output, stream before it)."""
        normed, residual = add_norm(self.input_layernorm, delta, residual)
        normed, residual = self.post_attention_layernorm(self.mix(normed, batch, caches), residual)
        return feed_forward(self.mlp, normed, batch), residual
