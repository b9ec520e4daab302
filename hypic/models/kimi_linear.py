"""KimiLinearModel: the Kimi-Linear stack over a flat varlen ForwardBatch. Pre-norm decoder layers
(plain RMSNorm): h += mixer(norm(h)), the mixer KDA or MLA as layer_types says; h += mlp(norm(h)),
a dense SwiGLU MLP or SwiGLU experts behind the DeepSeek-style router with shared experts beside.
"""
from __future__ import annotations

from torch import nn

from hypic.cache.model_caches import CacheShape
from hypic.models.kda import KimiDeltaAttention
from hypic.models.kimi_config import KimiLinearConfig
from hypic.models.layers import GroupedSigmoidRouter, RoutedMoeBlock, SwiGLUMLP
from hypic.models.mla import LatentAttention
from hypic.models.stack import DecoderStack, PreNormLayer


def build_mlp(config: KimiLinearConfig, layer_id: int) -> nn.Module:
    c = config
    if layer_id not in c.moe_layers:
        return SwiGLUMLP(c.hidden_size, c.intermediate_size)
    router = GroupedSigmoidRouter(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.n_group, c.topk_group,
                                  c.norm_topk_prob, c.routed_scaling_factor)
    shared = SwiGLUMLP(c.hidden_size, c.moe_intermediate_size * c.num_shared_experts) if c.num_shared_experts else None
    return RoutedMoeBlock(router, c.hidden_size, c.num_experts, c.moe_intermediate_size, "silu", shared)


class DecoderLayer(PreNormLayer):
    def __init__(self, config: KimiLinearConfig, layer_id: int) -> None:
        super().__init__(config, layer_id, offset=False)
        self.mixer = KimiDeltaAttention(config) if self.is_linear else LatentAttention(config)
        self.mlp = build_mlp(config, layer_id)


class KimiLinearModel(DecoderStack):
    prefill_graphs = False  # latent attention expands a long chunk's keys, as its host length says

    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__(config, offset=False)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))

    def cache_shape(self) -> CacheShape:
        """Latent pages (one row of rank + rope channels a token) for the MLA layers, a state slot for each
        KDA layer (its mixer's shapes)."""
        c = self.config
        linear = tuple(layer.mixer.shape for layer in self.layers if layer.is_linear)
        return CacheShape(c.full_layers, c.linear_layers, 1, c.latent_dim, linear, shared_kv=True)
