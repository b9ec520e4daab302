"""The Gated DeltaNet layer's per-token preparation of the recurrence inputs, fused on the GPU.

- `qk_l2norm`: the conv output's q and k channels [N, 2 * H * K] -> l2-normalised q, k [N, H, K]
  (dense), x / sqrt(sum(x^2) + eps) in float32, rounded to the input dtype.
- `gdn_gates`: log-decay g = -exp(A_log) * softplus(a + dt_bias) (float32) and beta = sigmoid(b)
  (in b's dtype), both [N, HV], from the projection's a and b columns (strided views are fine).

CPU runs the torch reference; CUDA one Triton kernel each (in place of five to eight launches).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hypic.kernels.activation import softplus
from hypic.kernels.triton_lazy import next_power_of_2, triton_kernel

tl: Any  # triton.language, bound by triton_lazy on first GPU use

L2NORM_EPS = 1e-6  # as FLA's use_qk_l2norm_in_kernel


def qk_l2norm(qk: torch.Tensor, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qk: [N, >= 2 * heads * dim] whose first columns are q then k (each heads x dim)."""
    if qk.device.type != "cuda":
        q, k = qk[:, : 2 * heads * dim].split(heads * dim, dim=-1)
        return l2_normalize_ref(q.reshape(-1, heads, dim)), l2_normalize_ref(k.reshape(-1, heads, dim))
    return qk_l2norm_triton(qk, heads, dim)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b: [N, HV]; A_log, dt_bias: [HV] float32. Returns (g float32, beta in b's dtype)."""
    if a.device.type != "cuda":
        return gdn_gates_ref(a, b, A_log, dt_bias)
    return gdn_gates_triton(a, b, A_log, dt_bias)


# ----------------------------------------------------------------------------- torch reference

def l2_normalize_ref(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, computed in float32."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


def gdn_gates_ref(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                  dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, torch.sigmoid(b.float()).to(b.dtype)


# ----------------------------------------------------------------------------- GPU: Triton

def qk_l2norm_triton(qk: torch.Tensor, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = qk.shape[0]
    q = torch.empty((tokens, heads, dim), dtype=qk.dtype, device=qk.device)
    k = torch.empty_like(q)
    block_d = next_power_of_2(dim)
    block_rows = max(1, 2048 // block_d)
    rows = tokens * 2 * heads
    _l2norm_kernel[(-(-rows // block_rows),)](qk, q, k, rows, qk.stride(0), L2NORM_EPS, H=heads, D=dim,
                                              BD=block_d, BR=block_rows)
    return q, k


def gdn_gates_triton(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, heads = a.shape
    g = torch.empty((tokens, heads), dtype=torch.float32, device=a.device)
    beta = torch.empty((tokens, heads), dtype=b.dtype, device=a.device)
    block_h = next_power_of_2(heads)
    block_rows = max(1, 1024 // block_h)
    _gates_kernel[(-(-tokens // block_rows),)](a, b, A_log, dt_bias, g, beta, tokens, a.stride(0), b.stride(0),
                                               HV=heads, BH=block_h, BR=block_rows)
    return g, beta


@triton_kernel(do_not_specialize=("rows",))
def _l2norm_kernel(qk, q, k, rows, stride_t, eps, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                   BR: tl.constexpr):
    """Row r = token r // (2H), head j = r % (2H): heads j < H are q's, the others k's."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (r < rows)[:, None] & (o_d < D)[None, :]
    t, j = (r // (2 * H)).to(tl.int64), (r % (2 * H)).to(tl.int64)
    x = tl.load(qk + (t * stride_t + j * D)[:, None] + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    y = (x * tl.rsqrt(tl.sum(x * x, axis=1) + eps)[:, None]).to(q.dtype.element_ty)
    dense = ((t * H + j % H) * D)[:, None] + o_d[None, :]
    is_q = (j < H)[:, None]
    tl.store(q + dense, y, mask=m & is_q)
    tl.store(k + dense, y, mask=m & (~is_q))


@triton_kernel(do_not_specialize=("tokens",))
def _gates_kernel(a, b, A_log, dt_bias, g, beta, tokens, stride_a, stride_b, HV: tl.constexpr,
                  BH: tl.constexpr, BR: tl.constexpr):
    t = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    o_h = tl.arange(0, BH)
    m_h = o_h < HV
    m = (t < tokens)[:, None] & m_h[None, :]
    x = tl.load(a + (t * stride_a)[:, None] + o_h[None, :], mask=m, other=0.0).to(tl.float32)
    rate = softplus(x + tl.load(dt_bias + o_h, mask=m_h, other=0.0).to(tl.float32)[None, :])
    decay = tl.exp(tl.load(A_log + o_h, mask=m_h, other=0.0).to(tl.float32))
    dense = (t * HV)[:, None] + o_h[None, :]
    tl.store(g + dense, -decay[None, :] * rate, mask=m)
    b_b = tl.load(b + (t * stride_b)[:, None] + o_h[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(beta + dense, tl.sigmoid(b_b).to(beta.dtype.element_ty), mask=m)
