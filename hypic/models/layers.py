"""Building blocks shared by the hybrid layers: norms, RoPE, SwiGLU MLP, sparse MoE with a shared expert."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hypic.kernels.moe import fused_moe


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: the weight is stored as an offset, y = x / rms(x) * (1 + w), in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Norm-then-gate over the last dim: y = w * (x / rms(x)) * silu(gate). The weight is not an offset."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class RotaryEmbedding:
    """NeoX-style RoPE on the first `rotary_dim` channels of each head (partial rotary); the rest pass.
    Stateless (no buffers): cos/sin come from the positions on the fly, so weights can load on meta."""

    def __init__(self, rotary_dim: int, theta: float) -> None:
        self.rotary_dim, self.theta = rotary_dim, theta

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N] positions -> cos, sin of shape [N, 1, rotary_dim / 2] (float32)."""
        exponent = torch.arange(0, self.rotary_dim, 2, device=positions.device, dtype=torch.float32)
        inv_freq = 1.0 / (self.theta ** (exponent / self.rotary_dim))
        freqs = positions.float()[:, None] * inv_freq
        return freqs.cos()[:, None, :], freqs.sin()[:, None, :]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x [N, heads, D] at positions [N]; the math runs in float32."""
        cos, sin = self.cos_sin(positions)
        half = self.rotary_dim // 2
        x1, x2 = x[..., :half].float(), x[..., half:self.rotary_dim].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return torch.cat((rotated, x[..., self.rotary_dim:]), dim=-1)


class SwiGLUMLP(nn.Module):
    """down(silu(gate x) * up x); gate and up are one matmul (rows: gate first, then up)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoeBlock(nn.Module):
    """Softmax router -> top-k experts (weights renormalised when norm_topk_prob), plus a shared expert
    scaled by sigmoid(shared_expert_gate x). Expert weights are stacked: [E, 2I, H] and [E, H, I]."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, moe_intermediate_size: int,
                 shared_intermediate_size: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, 2 * moe_intermediate_size, hidden_size))
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden_size, moe_intermediate_size))
        self.shared_expert = SwiGLUMLP(hidden_size, shared_intermediate_size) if shared_intermediate_size else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_intermediate_size else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k weights [N, k] float32 and expert ids [N, k] int64."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = fused_moe(x, self.experts_gate_up, self.experts_down, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
