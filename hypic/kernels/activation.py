"""Gated activations, each one Triton pass on CUDA that rounds where torch does (the activation's
output, then the product), so that both compute the same function; CPU runs torch (two launches and an
intermediate).

- `silu_and_mul`: SwiGLU's silu(gate) * up over the two halves of a fused gate/up projection.
- `sigmoid_gate`: x * sigmoid(gate), the output gate of Qwen's full attention.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hypic.kernels.triton_lazy import next_power_of_2, triton_kernel

tl: Any  # triton.language, bound by triton_lazy on first GPU use


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """h: [M, 2I] (gate columns, then up columns) -> [M, I]."""
    inter = h.shape[-1] // 2
    if h.device.type != "cuda":
        return F.silu(h[:, :inter]) * h[:, inter:]
    return silu_and_mul_triton(h)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x, gate: [M, C] (gate may be a row-strided view) -> x * sigmoid(gate)."""
    if x.device.type != "cuda":
        return x * torch.sigmoid(gate)
    return sigmoid_gate_triton(x, gate)


def sigmoid_gate_triton(x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`out` (dense [M, C]; x itself gates in place) receives the result when given."""
    rows, cols = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    gate = gate if gate.stride(1) == 1 else gate.contiguous()
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device) if out is None else out
    block_c = min(1024, next_power_of_2(cols))
    block_rows = max(1, 2048 // block_c)
    grid = (-(-rows // block_rows), -(-cols // block_c))
    _sigmoid_gate_kernel[grid](x, gate, out, rows, x.stride(0), gate.stride(0), C=cols, BC=block_c, BR=block_rows)
    return out


def silu_and_mul_triton(h: torch.Tensor) -> torch.Tensor:
    inter, rows = h.shape[-1] // 2, h.shape[0]
    out = torch.empty((rows, inter), dtype=h.dtype, device=h.device)
    block_i = min(1024, next_power_of_2(inter))
    block_rows = max(1, 2048 // block_i)
    grid = (-(-rows // block_rows), -(-inter // block_i))
    _silu_mul_kernel[grid](h, out, rows, h.stride(0), I=inter, BI=block_i, BR=block_rows)
    return out


@triton_kernel(do_not_specialize=("rows",))
def _silu_mul_kernel(h, out, rows, stride_h, I: tl.constexpr, BI: tl.constexpr, BR: tl.constexpr):
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    o_i = tl.program_id(1) * BI + tl.arange(0, BI)
    m = (r < rows)[:, None] & (o_i < I)[None, :]
    p_h = h + (r * stride_h)[:, None] + o_i[None, :]
    gate = tl.load(p_h, mask=m, other=0.0).to(tl.float32)
    up = tl.load(p_h + I, mask=m, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + (r * I)[:, None] + o_i[None, :], (act * up).to(out.dtype.element_ty), mask=m)


@triton_kernel(do_not_specialize=("rows",))
def _sigmoid_gate_kernel(x, gate, out, rows, stride_x, stride_g, C: tl.constexpr, BC: tl.constexpr,
                         BR: tl.constexpr):
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m = (r < rows)[:, None] & (o_c < C)[None, :]
    b_g = tl.load(gate + (r * stride_g)[:, None] + o_c[None, :], mask=m, other=0.0).to(tl.float32)
    b_x = tl.load(x + (r * stride_x)[:, None] + o_c[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(out + (r * C)[:, None] + o_c[None, :], sigmoid_gated(b_x, b_g, out), mask=m)


@triton_kernel
def softplus(x):
    """softplus of a float32 tile as torch computes it (x itself above torch's threshold of 20): every kernel
    that gates a decay."""
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))


@triton_kernel
def sigmoid_gated(b_x, b_g, out):
    """x * sigmoid(gate) of float32 tiles, rounded as `sigmoid_gate` rounds (the sigmoid, then the
    product) to out's dtype: every kernel that applies the output gate."""
    act = tl.sigmoid(b_g).to(out.dtype.element_ty).to(tl.float32)
    return (b_x * act).to(out.dtype.element_ty)
