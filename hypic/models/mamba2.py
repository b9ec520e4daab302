"""The Mamba2 mixer: in_proj -> (z, xBC, dt); causal conv1d (with bias) + silu over xBC; the SSD
recurrence S_t = exp(dt_t A) S_{t-1} + dt_t B_t x_t^T, y_t = C_t^T S_t + D x_t per head (state
[d_state, head_dim], float32; B and C shared by the heads of a group); grouped gated norm; out_proj.

The recurrence is the scalar-gated rule with q = C, k = B, v = dt x, g = dt A (`kernels/scalar_gated`),
so the pieces mirror GatedDeltaNet's: `project`, `recur`, `output`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hypic.engine.forward_batch import ForwardBatch
from hypic.kernels.conv1d import causal_conv1d
from hypic.kernels.scalar_gated import scalar_gated_rule
from hypic.models.layers import GroupedGatedRMSNorm
from hypic.models.mamba2_config import Mamba2HybridConfig


class Mamba2Mixer(nn.Module):
    """Weights: in_proj rows [z (H*P) | x (H*P) | B (G*N) | C (G*N) | dt (H)]; conv1d_weight
    [conv_dim, W] and conv1d_bias over [x | B | C]; A_log, dt_bias, D [H] in float32."""

    def __init__(self, config: Mamba2HybridConfig) -> None:
        super().__init__()
        c = config
        self.num_heads, self.head_dim, self.n_groups = c.mamba_num_heads, c.mamba_head_dim, c.n_groups
        self.state_size, self.inner, self.conv_dim = c.ssm_state_size, c.mamba_intermediate, c.mamba_conv_dim
        self.time_step_limit = c.time_step_limit
        self.scale = 1.0
        self.in_proj = nn.Linear(c.hidden_size, self.inner + self.conv_dim + self.num_heads, bias=False)
        self.conv1d_weight = nn.Parameter(torch.empty(self.conv_dim, c.conv_kernel))
        self.conv1d_bias = nn.Parameter(torch.empty(self.conv_dim)) if c.conv_bias else None
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.D = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.norm = GroupedGatedRMSNorm(self.inner, self.inner // self.n_groups, c.mamba_norm_eps)
        self.out_proj = nn.Linear(self.inner, c.hidden_size, bias=False)

    def in_projection(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(z [N, H*P], xBC [N, conv_dim] (the conv input), dt [N, H] before softplus)."""
        return self.in_proj(hidden).split((self.inner, self.conv_dim, self.num_heads), dim=-1)

    def conv(self, xbc: torch.Tensor, conv_pool: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return causal_conv1d(xbc, self.conv1d_weight, self.conv1d_bias, conv_pool, batch.slots, batch.has_state,
                             batch.cu_seqlens, num_decodes=batch.num_decodes, seq_lens_cpu=batch.seq_lens_cpu,
                             activation="silu")

    def split_heads(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-conv channels -> x [N, H, P], B and C [N, G, d_state]."""
        sizes = (self.inner, self.n_groups * self.state_size, self.n_groups * self.state_size)
        x, b, c = conv_out.split(sizes, dim=-1)
        groups = (-1, self.n_groups, self.state_size)
        return x.reshape(-1, self.num_heads, self.head_dim), b.reshape(groups), c.reshape(groups)

    def gates(self, dt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(dt = clamp(softplus(dt + dt_bias)), log-decay g = dt * A with A = -exp(A_log)), float32 [N, H]."""
        dt = F.softplus(dt.float() + self.dt_bias).clamp(*self.time_step_limit)
        return dt, dt * -torch.exp(self.A_log)

    def project(self, hidden: torch.Tensor, conv_pool: torch.Tensor,
                batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        """(C, B, dt x, g, x, z): the recurrence's q, k, v, g, then what the output needs."""
        z, xbc, dt = self.in_projection(hidden)
        x, b, c = self.split_heads(self.conv(xbc, conv_pool, batch))
        dt, g = self.gates(dt)
        return c, b, self.values(x, dt), g, x, z

    @staticmethod
    def values(x: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        """v = dt x, rounded to x's dtype (the kernels take q, k, v in one dtype)."""
        return (x.float() * dt[..., None]).to(x.dtype)

    def recur(self, c: torch.Tensor, b: torch.Tensor, v: torch.Tensor, g: torch.Tensor, ssm_pool: torch.Tensor,
              batch: ForwardBatch) -> torch.Tensor:
        return scalar_gated_rule(c, b, v, g, ssm_pool, batch.slots, batch.has_state, batch.cu_seqlens,
                                 scale=self.scale, num_decodes=batch.num_decodes, seq_lens_cpu=batch.seq_lens_cpu)

    def output(self, y: torch.Tensor, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y + D x, gated grouped norm, out projection: [N, H, P] -> [N, hidden]."""
        y = (y.float() + self.D[:, None] * x.float()).to(x.dtype).reshape(x.shape[0], self.inner)
        return self.out_proj(self.norm(y, z))

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, ssm_pool: torch.Tensor,
                conv_pool: torch.Tensor, linear_index: int) -> torch.Tensor:
        if batch.pic is not None:
            raise NotImplementedError("position-independent caching of Mamba2 layers awaits the "
                                      "family-agnostic PIC step (issue 24, item 1)")
        c, b, v, g, x, z = self.project(hidden, conv_pool, batch)
        return self.output(self.recur(c, b, v, g, ssm_pool, batch), x, z)
