"""HybridModel: the Qwen3-Next / Qwen3.5 decoder stack over a flat varlen ForwardBatch.

One class serves every supported model type; the differences (layer roles, dense vs MoE MLPs, tied
embeddings) come from HybridConfig. The model writes K/V into the pages and states into the slab in
place through the kernel functions.
"""
from __future__ import annotations

from torch import nn

from hypic.cache.model_caches import CacheShape
from hypic.models.attention import GatedAttention
from hypic.models.config import HybridConfig
from hypic.models.gated_deltanet import GatedDeltaNet
from hypic.models.layers import SparseMoeBlock, SwiGLUMLP
from hypic.models.stack import DecoderStack, PreNormLayer


def build_mlp(config: HybridConfig, layer_id: int) -> nn.Module:
    c = config
    if layer_id in c.moe_layers:
        return SparseMoeBlock(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                              c.shared_expert_intermediate_size, c.norm_topk_prob)
    return SwiGLUMLP(c.hidden_size, c.intermediate_size)


class DecoderLayer(PreNormLayer):
    """The mixer is `linear_attn` (Gated DeltaNet) or `self_attn` (gated full attention)."""

    def __init__(self, config: HybridConfig, layer_id: int) -> None:
        super().__init__(config, layer_id, offset=True)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        self.mlp = build_mlp(config, layer_id)

    def mixer_module(self) -> nn.Module:
        return self.linear_attn if self.is_linear else self.self_attn


class HybridModel(DecoderStack):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__(config, offset=True)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))

    def cache_shape(self) -> CacheShape:
        """What the caches hold per page and slot, from the layers: each linear layer's mixer names its shapes."""
        c = self.config
        linear = tuple(layer.linear_attn.shape for layer in self.layers if layer.is_linear)
        return CacheShape(c.full_layers, c.linear_layers, c.num_key_value_heads, c.head_dim, linear)
