"""The Mamba2 mixer: in_proj -> (z, xBC, dt); causal conv1d (with bias) + silu over xBC; the SSD
recurrence S_t = exp(dt_t A) S_{t-1} + dt_t B_t x_t^T, y_t = C_t^T S_t + D x_t per head (state
[d_state, head_dim], float32; B and C shared by the heads of a group); grouped gated norm; out_proj.

As a `LinearMixer` of the scalar family: q = C, k = B (key heads = groups), v = dt x, g = dt A,
scale 1; the D skip and the gate stay in `output`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hypic.cache.model_caches import LinearShape
from hypic.kernels.linear_families import get_family
from hypic.kernels.varlen import Operands
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
        """q = C, k = B [N, G, d_state]; v = dt x [N, H, P] (rounded to x's dtype: the kernels take
        q, k, v in one dtype); g = dt A, dt = clamp(softplus(dt + dt_bias)), A = -exp(A_log) (float32)."""
        x, b, c = self.split(conv_out)
        dt = F.softplus(side[1].float() + self.dt_bias).clamp(*self.time_step_limit)
        v = (x.float() * dt[..., None]).to(x.dtype)
        return Operands(c, b, v, dt * -torch.exp(self.A_log), None)

    def split(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-conv channels -> x [N, H, P], B and C [N, G, d_state]."""
        sizes = (self.inner, self.n_groups * self.state_size, self.n_groups * self.state_size)
        x, b, c = conv_out.split(sizes, dim=-1)
        groups = (-1, self.n_groups, self.state_size)
        return x.reshape(-1, self.num_heads, self.head_dim), b.reshape(groups), c.reshape(groups)

    def output(self, o: torch.Tensor, conv_out: torch.Tensor, side: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """y = o + D x, gated grouped norm (gate z), out projection: [N, H, P] -> [N, hidden]."""
        x = conv_out[:, :self.inner].reshape(-1, self.num_heads, self.head_dim)
        y = (o.float() + self.D[:, None] * x.float()).to(x.dtype).reshape(x.shape[0], self.inner)
        return self.out_proj(self.norm(y, side[0]))
