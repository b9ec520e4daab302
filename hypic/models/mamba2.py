"""The Mamba2 mixer: in_proj -> (z, xBC, dt); causal conv1d (with bias) + silu over xBC; the SSD
recurrence S_t = exp(dt_t A) S_{t-1} + dt_t B_t x_t^T, y_t = C_t^T S_t + D x_t per head (state
[d_state, head_dim], float32; B and C shared by the heads of a group); grouped gated norm; out_proj.

As a `LinearMixer` of the scalar family: q = C, k = B (key heads = groups), v = dt x, g = dt A,
scale 1; the D skip and the gate stay in `output`. A plain decode step runs all of it but the
projections as one fused step (`hypic.kernels.mamba2_decode`).
"""
from __future__ import annotations

import torch
from torch import nn

from hypic.cache.model_caches import LinearShape
from hypic.kernels.linear_families import get_family
from hypic.kernels.mamba2_decode import Mamba2DecodeLayer, d_skip, mamba2_decode, split_xbc, ssd_gates
from hypic.kernels.varlen import Operands
from hypic.models.batch import ForwardBatch
from hypic.models.layers import GroupedGatedRMSNorm
from hypic.models.mamba2_config import Mamba2HybridConfig
from hypic.models.mixer import LinearMixer


class Mamba2Mixer(LinearMixer):
    """Weights: in_proj rows [z (H*P) | x (H*P) | B (G*N) | C (G*N) | dt (H)]; conv1d_weight
    [conv_dim, W] and conv1d_bias over [x | B | C]; A_log, dt_bias, D [H] in float32."""

    def __init__(self, config: Mamba2HybridConfig) -> None:
        super().__init__()
        c = config
        self.num_heads, self.head_dim, self.n_groups = c.mamba_num_heads, c.mamba_head_dim, c.n_groups
        self.state_size, self.inner, self.conv_dim = c.ssm_state_size, c.mamba_intermediate, c.mamba_conv_dim
        self.time_step_limit = c.time_step_limit
        self.shape = LinearShape(get_family("scalar"), self.num_heads, self.state_size, self.head_dim,
                                 self.conv_dim, c.conv_kernel)
        self.scale = 1.0
        self.in_proj = nn.Linear(c.hidden_size, self.inner + self.conv_dim + self.num_heads, bias=False)
        self.conv1d_weight = nn.Parameter(torch.empty(self.conv_dim, c.conv_kernel))
        self.conv1d_bias = nn.Parameter(torch.empty(self.conv_dim)) if c.conv_bias else None
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.D = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.norm = GroupedGatedRMSNorm(self.inner, self.inner // self.n_groups, c.mamba_norm_eps)
        self.out_proj = nn.Linear(self.inner, c.hidden_size, bias=False)

    def conv_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.conv1d_weight, self.conv1d_bias

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """xBC [N, conv_dim] (the conv input), and z [N, H*P], dt [N, H] before softplus."""
        z, xbc, dt = self.in_proj(hidden).split((self.inner, self.conv_dim, self.num_heads), dim=-1)
        return xbc, (z, dt)

    def operands(self, conv_out: torch.Tensor, side: tuple[torch.Tensor, ...]) -> Operands:
        """q = C, k = B [N, G, d_state]; v = dt x [N, H, P] and g = dt A (`ssd_gates`)."""
        x, b, c = self.split(conv_out)
        v, g = ssd_gates(x, side[1], self.dt_bias, self.A_log, self.time_step_limit)
        return Operands(c, b, v, g, None)

    def split(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-conv channels -> x [N, H, P], B and C [N, G, d_state]."""
        return split_xbc(conv_out, self.num_heads, self.n_groups, self.state_size)

    def output(self, o: torch.Tensor, conv_out: torch.Tensor, side: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """y = o + D x, gated grouped norm (gate z), out projection: [N, H, P] -> [N, hidden]."""
        x = conv_out[:, :self.inner].reshape(-1, self.num_heads, self.head_dim)
        return self.out_proj(self.norm(d_skip(o, x, self.D).reshape(x.shape[0], self.inner), side[0]))

    def fused_decode(self, conv_in: torch.Tensor, side: tuple[torch.Tensor, ...], ssm_pool: torch.Tensor,
                     conv_pool: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        z, dt = side
        normed = mamba2_decode(conv_in, z, dt, self.decode_layer(), ssm_pool, conv_pool, batch.slots, batch.has_state)
        return self.out_proj(normed)

    def decode_layer(self) -> Mamba2DecodeLayer:
        return Mamba2DecodeLayer(self.conv1d_weight, self.conv1d_bias, self.A_log, self.dt_bias, self.D,
                                 self.norm.weight, self.norm.eps, self.num_heads, self.head_dim, self.n_groups,
                                 self.state_size, self.time_step_limit)
