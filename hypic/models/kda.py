"""The KDA mixer of Kimi-Linear (Kimi Delta Attention) as a `LinearMixer` of the kda family.

Three short convs (q, k, v) are one depthwise conv over [q | k | v] (each channel has its own filter,
so concatenating them changes nothing); silu after it; q, k l2-normalised; the per-key forget gate
g = -exp(A_log) softplus(f_b f_a x + dt_bias) per head and key channel (float32); beta = sigmoid(b x);
the output is RMSNorm per head gated by a *sigmoid* of the low-rank g_b g_a x, then o_proj. Every
projection of x is one matmul (in_proj), the two low-rank up projections one batched matmul.
"""
from __future__ import annotations

import torch
from torch import nn

from hypic.cache.model_caches import LinearShape
from hypic.kernels.gdn_inputs import qk_l2norm
from hypic.kernels.kda_decode import KdaDecodeLayer, kda_decode, kda_gates
from hypic.kernels.linear_families import get_family
from hypic.kernels.varlen import Operands
from hypic.models.batch import ForwardBatch
from hypic.models.kimi_config import KimiLinearConfig
from hypic.models.layers import GatedRMSNorm
from hypic.models.mixer import LinearMixer


class KimiDeltaAttention(LinearMixer):
    """Weights: in_proj rows [q | k | v (H*K each) | b (H) | f_a | g_a (K each)]; conv1d_weight [3*H*K, W]
    (no bias); low_rank_up [2, H*K, K]: f_b and g_b (the low-rank gates' second halves); A_log [H] and
    dt_bias [H*K] float32; o_norm weight [K]; o_proj [hidden, H*K]."""

    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__()
        c = config
        self.num_heads, self.head_dim = c.linear_num_heads, c.linear_head_dim
        self.qkv_dim = self.num_heads * self.head_dim
        self.shape = LinearShape(get_family("kda"), self.num_heads, self.head_dim, self.head_dim, 3 * self.qkv_dim,
                                 c.linear_conv_kernel_dim)
        self.scale = self.head_dim ** -0.5
        self.in_proj = nn.Linear(c.hidden_size, 3 * self.qkv_dim + self.num_heads + 2 * self.head_dim, bias=False)
        self.conv1d_weight = nn.Parameter(torch.empty(3 * self.qkv_dim, c.linear_conv_kernel_dim))
        self.low_rank_up = nn.Parameter(torch.empty(2, self.qkv_dim, self.head_dim))
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(self.qkv_dim, dtype=torch.float32))
        self.o_norm = GatedRMSNorm(self.head_dim, c.rms_norm_eps, activation="sigmoid")
        self.o_proj = nn.Linear(self.qkv_dim, c.hidden_size, bias=False)

    def conv_weights(self) -> tuple[torch.Tensor, None]:
        return self.conv1d_weight, None

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """[q | k | v] [N, 3*H*K] (the conv input), and b [N, H], the forget-gate input f [N, H*K] and
        the output gate [N, H, K]."""
        sizes = (3 * self.qkv_dim, self.num_heads, 2 * self.head_dim)
        qkv, b, low_rank = self.in_proj(hidden).split(sizes, dim=-1)
        f, gate = torch.bmm(low_rank.unflatten(1, (2, self.head_dim)).transpose(0, 1), self.low_rank_up.mT)
        return qkv, (b, f, gate.reshape(-1, self.num_heads, self.head_dim))

    def operands(self, conv_out: torch.Tensor, side: tuple[torch.Tensor, ...]) -> Operands:
        """l2-normalised q, k [N, H, K], v [N, H, K]; g [N, H, K] float32 log-decay; beta [N, H]."""
        b, f, _ = side
        q, k = qk_l2norm(conv_out, self.num_heads, self.head_dim)
        v = conv_out[:, 2 * self.qkv_dim:].reshape(-1, self.num_heads, self.head_dim)
        return Operands(q, k, v, *kda_gates(f, b, self.A_log, self.dt_bias))

    def output(self, o: torch.Tensor, conv_out: torch.Tensor, side: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Sigmoid-gated RMSNorm per head, then o_proj: [N, H, K] -> [N, hidden]."""
        return self.o_proj(self.o_norm(o, side[2]).reshape(o.shape[0], self.qkv_dim))

    def fused_decode(self, conv_in: torch.Tensor, side: tuple[torch.Tensor, ...], ssm_pool: torch.Tensor,
                     conv_pool: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        b, f, gate = side
        layer = KdaDecodeLayer(self.conv1d_weight, self.A_log, self.dt_bias, self.o_norm.weight, self.o_norm.eps,
                               self.num_heads, self.head_dim, self.scale)
        normed = kda_decode(conv_in, b, f, gate, layer, ssm_pool, conv_pool, batch.slots, batch.has_state)
        return self.o_proj(normed.reshape(normed.shape[0], self.qkv_dim))
