"""SwiGLU's activation: silu(gate) * up over the two halves of a fused gate/up projection.

CPU runs torch (two launches and an intermediate); CUDA one Triton pass that rounds where torch
does (silu's output, then the product), so both compute the same function.
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


def silu_and_mul_triton(h: torch.Tensor) -> torch.Tensor:
    inter, rows = h.shape[-1] // 2, h.shape[0]
    out = torch.empty((rows, inter), dtype=h.dtype, device=h.device)
    block_i = min(1024, next_power_of_2(inter))
    block_rows = max(1, 2048 // block_i)
    grid = (-(-rows // block_rows), -(-inter // block_i))
    _silu_mul_kernel[grid](h, out, rows, h.stride(0), I=inter, BI=block_i, BR=block_rows)
    return out


@triton_kernel
def _silu_mul_kernel(h, out, rows, stride_h, I: tl.constexpr, BI: tl.constexpr, BR: tl.constexpr):
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    o_i = tl.program_id(1) * BI + tl.arange(0, BI)
    m = (r < rows)[:, None] & (o_i < I)[None, :]
    p_h = h + (r * stride_h)[:, None] + o_i[None, :]
    gate = tl.load(p_h, mask=m, other=0.0).to(tl.float32)
    up = tl.load(p_h + I, mask=m, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + (r * I)[:, None] + o_i[None, :], (act * up).to(out.dtype.element_ty), mask=m)
