"""The linear-attention layer of Qwen3-Next / Qwen3.5: Gated DeltaNet with a causal conv1d over its
q/k/v projection, as a `LinearMixer` of the gdn family."""
from __future__ import annotations

import torch
from torch import nn

from hypic.cache.model_caches import LinearShape
from hypic.kernels.gdn_decode import GdnDecodeLayer, gdn_decode
from hypic.kernels.gdn_inputs import gdn_gates, qk_l2norm
from hypic.kernels.linear_families import get_family
from hypic.kernels.varlen import Operands
from hypic.models.batch import ForwardBatch
from hypic.models.config import HybridConfig
from hypic.models.layers import GatedRMSNorm
from hypic.models.mixer import LinearMixer


class GatedDeltaNet(LinearMixer):
    """Weights: in_proj rows are [q (H*K) | k (H*K) | v (HV*V) | z (HV*V) | b (HV) | a (HV)] (one matmul);
    conv1d_weight [conv_dim, W] over the q/k/v channels (no bias); A_log, dt_bias [HV] in float32."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        c = config
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = c.linear_key_dim, c.linear_value_dim, c.linear_conv_dim
        self.shape = LinearShape(get_family("gdn"), self.num_v_heads, self.head_k_dim, self.head_v_dim,
                                 self.conv_dim, c.linear_conv_kernel_dim)
        self.scale = self.head_k_dim ** -0.5
        self.in_proj = nn.Linear(c.hidden_size, self.conv_dim + self.value_dim + 2 * self.num_v_heads, bias=False)
        self.conv1d_weight = nn.Parameter(torch.empty(self.conv_dim, c.linear_conv_kernel_dim))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32))
        self.norm = GatedRMSNorm(self.head_v_dim, c.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, c.hidden_size, bias=False)

    def conv_weights(self) -> tuple[torch.Tensor, None]:
        return self.conv1d_weight, None

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """mixed_qkv [N, conv_dim] (the conv input), and z [N, HV, V], b, a [N, HV]."""
        sizes = (self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads)
        mixed_qkv, z, b, a = self.in_proj(hidden).split(sizes, dim=-1)
        return mixed_qkv, (z.reshape(-1, self.num_v_heads, self.head_v_dim), b, a)

    def operands(self, conv_out: torch.Tensor, side: tuple[torch.Tensor, ...]) -> Operands:
        """l2-normalised q, k [N, H, K], v [N, HV, V]; log-decay g = -exp(A_log) * softplus(a + dt_bias)
        (float32) and beta = sigmoid(b) [N, HV]."""
        _, b, a = side
        q, k = qk_l2norm(conv_out, self.num_k_heads, self.head_k_dim)
        v = conv_out[:, 2 * self.key_dim:].reshape(-1, self.num_v_heads, self.head_v_dim)
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
        return Operands(q, k, v, g, beta)

    def output(self, o: torch.Tensor, conv_out: torch.Tensor, side: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Gated RMSNorm per value head (gate z), then the out projection: [N, HV, V] -> [N, hidden]."""
        return self.out_proj(self.norm(o, side[0]).reshape(o.shape[0], self.value_dim))

    def fused_decode(self, conv_in: torch.Tensor, side: tuple[torch.Tensor, ...], ssm_pool: torch.Tensor,
                     conv_pool: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        z, b, a = side
        layer = GdnDecodeLayer(self.conv1d_weight, self.A_log, self.dt_bias, self.norm.weight, self.norm.eps,
                               self.num_k_heads, self.head_k_dim, self.head_v_dim, self.scale)
        normed = gdn_decode(conv_in, z, a, b, layer, ssm_pool, conv_pool, batch.slots, batch.has_state)
        return self.out_proj(normed.reshape(normed.shape[0], self.value_dim))
