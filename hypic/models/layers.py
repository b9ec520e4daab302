"""Building blocks shared by the hybrid layers: norms, RoPE, SwiGLU and relu^2 MLPs, sparse MoE blocks."""
from __future__ import annotations

import torch
from torch import nn

from hypic.kernels.activation import silu_and_mul
from hypic.kernels.moe import Routing, SharedExpert, Valid, routed_moe
from hypic.kernels.norms import (add_rms_norm, gated_rms_norm, grouped_gated_rms_norm, rms_norm, rms_norm_rope,
                                 rms_norm_rope_write)
from hypic.kernels.scatter_kv import rope_inv_freq
from hypic.models.batch import ForwardBatch


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm (Qwen): the weight is stored as an offset, y = x / rms(x) * (1 + w), in
    float32; with offset=False the plain y = w * round(x / rms(x)) (Nemotron-H, Granite, Bamba).
    Given a residual it first adds it (rounded to the model dtype) and returns the sum as well."""

    def __init__(self, dim: int, eps: float, offset: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.offset)
        return add_rms_norm(x, residual, self.weight, self.eps, self.offset)


class GatedRMSNorm(nn.Module):
    """Norm-then-gate over the last dim: y = w * (x / rms(x)) * act(gate), act silu (Gated DeltaNet) or
    sigmoid (KDA). The weight is not an offset."""

    def __init__(self, dim: int, eps: float, activation: str = "silu") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.activation = eps, activation

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps, self.activation)


class GroupedGatedRMSNorm(nn.Module):
    """Mamba2's gated norm: gate first, then RMSNorm over groups of `group` channels:
    y = w * norm_per_group(x * silu(gate))."""

    def __init__(self, dim: int, group: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group, self.eps = group, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return grouped_gated_rms_norm(x, gate, self.weight, self.group, self.eps)


class RotaryEmbedding:
    """NeoX-style RoPE on the first `rotary_dim` channels of each head (partial rotary); the rest pass.
    No buffers (weights load on meta): the inverse frequencies are made on first use, on the CPU
    exactly as the PIC scatter makes them, and kept per device."""

    def __init__(self, rotary_dim: int, theta: float) -> None:
        self.rotary_dim, self.theta = rotary_dim, theta
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = rope_inv_freq(self.rotary_dim, self.theta).to(device)
        return self._inv_freq[device]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, norm: RMSNorm | None = None) -> torch.Tensor:
        """Rotate x [N, heads, D] at positions [N] (float32 math), after `norm` per head if given."""
        if not self.rotary_dim and norm is None:  # no positional encoding (NoPE attention)
            return x.contiguous()  # dense, as the rotation's output is
        weight, eps = (norm.weight, norm.eps) if norm is not None else (None, 0.0)
        return rms_norm_rope(x, weight, eps, positions, self.inv_freq(positions.device))

    def write(self, x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor,
              v: torch.Tensor, v_cache: torch.Tensor, norm: RMSNorm | None = None) -> None:
        """`self(x, positions, norm)` written into a KV cache at flat rows [N], v into v_cache at the same
        rows (one launch on the GPU)."""
        weight, eps = (norm.weight, norm.eps) if norm is not None else (None, 0.0)
        rms_norm_rope_write(x, weight, eps, positions, self.inv_freq(positions.device), cache, rows, v, v_cache)


class SwiGLUMLP(nn.Module):
    """down(silu(gate x) * up x); gate and up are one matmul (rows: gate first, then up)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


def router_rows(rows: int) -> int:
    """A router GEMM's output rows, padded to a multiple of 8 (zero weights; their logits are never read):
    cuBLAS ran Qwen3.5's 257 bf16 logits a token (256 experts and the shared expert's gate), rows not
    16-byte aligned, in a legacy kernel, 16.6 us a layer at batch 10 on the H200."""
    return -(-rows // 8) * 8


class SparseMoeBlock(nn.Module):
    """Softmax router -> top-k experts (weights renormalised when norm_topk_prob), plus a shared expert
    scaled by sigmoid(shared_expert_gate x). Expert weights are stacked: [E, 2I, H] and [E, H, I]; the
    shared expert's gate is the router's row E ([E + 1, H], padded by `router_rows`: one GEMM for both)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, moe_intermediate_size: int,
                 shared_intermediate_size: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.routing, self.num_experts = Routing(top_k, norm_topk_prob), num_experts
        rows = router_rows(num_experts + (1 if shared_intermediate_size else 0))
        self.gate = nn.Linear(hidden_size, rows, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, 2 * moe_intermediate_size, hidden_size))
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden_size, moe_intermediate_size))
        self.shared_expert = SwiGLUMLP(hidden_size, shared_intermediate_size) if shared_intermediate_size else None

    def forward(self, x: torch.Tensor, valid_tokens: Valid = None) -> torch.Tensor:
        """Rows from `valid_tokens` on (a captured step's padding) come out zero."""
        logits = self.gate(x)
        shared = None
        if self.shared_expert is not None:  # added inside the MoE's combine pass (on decode, in its kernels)
            mlp = self.shared_expert
            shared = SharedExpert(mlp.gate_up_proj.weight, mlp.down_proj.weight,
                                  logits[:, self.num_experts:self.num_experts + 1])
        return routed_moe(x, logits[:, :self.num_experts], self.routing, self.experts_gate_up, self.experts_down,
                          shared_expert=shared, valid_tokens=valid_tokens)


class ReluSquaredMLP(nn.Module):
    """down(relu(up x)^2), ungated (Nemotron-H's MLP blocks and shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class SoftmaxRouter(nn.Module):
    """Softmax over the experts, top-k, renormalised (Granite's softmax over the top-k logits)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.routing = Routing(top_k, True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        """The router's logits [N, E] and how they route."""
        return torch.nn.functional.linear(x, self.weight), self.routing


class GroupedSigmoidRouter(nn.Module):
    """DeepSeek-V3-style router (Nemotron 3): float32 weights and score-correction bias, group-limited
    top-k over sigmoid scores, routed_scaling_factor on the weights."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, scaling: float) -> None:
        super().__init__()
        self.router_weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32))
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.scaling = norm_topk_prob, scaling

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        """The router's logits [N, E] (float32) and how they route."""
        logits = torch.nn.functional.linear(x.float(), self.router_weight)
        return logits, Routing(self.top_k, self.norm_topk_prob, self.e_score_correction_bias, self.n_group,
                               self.topk_group, self.scaling)


class RoutedMoeBlock(nn.Module):
    """router (its logits and Routing) -> top-k experts of `activation` ("silu" gated: [E, 2I, H]; "relu2": [E, I, H]), plus
    an ungated shared MLP when given (Nemotron's shared expert, Granite's shared MLP)."""

    def __init__(self, router: nn.Module, hidden_size: int, num_experts: int, intermediate_size: int,
                 activation: str, shared: nn.Module | None) -> None:
        super().__init__()
        rows = 2 * intermediate_size if activation == "silu" else intermediate_size
        self.router, self.activation, self.shared = router, activation, shared
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, rows, hidden_size))
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, valid_tokens: Valid = None) -> torch.Tensor:
        """Rows from `valid_tokens` on (a captured step's padding) go to no expert."""
        logits, routing = self.router(x)
        out = routed_moe(x, logits, routing, self.experts_gate_up, self.experts_down, activation=self.activation,
                         valid_tokens=valid_tokens)
        return out if self.shared is None else out + self.shared(x)


def feed_forward(mlp: nn.Module, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """A layer's MLP on the step's rows; a MoE block skips the padding rows of a captured step."""
    if isinstance(mlp, (SparseMoeBlock, RoutedMoeBlock)):
        return mlp(x, batch.valid_tokens)
    return mlp(x)
