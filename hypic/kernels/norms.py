"""Row norms of the hybrid layers, each one fused kernel on the GPU (one pass instead of six to ten
elementwise launches: what the decode step's launch count and prefill's memory traffic need).

- `rms_norm`: zero-centred RMSNorm, y = x / rms(x) * (1 + w), optionally after adding a residual
  (`add_rms_norm` returns the rounded sum too); x may be [N, D] or a strided [N, heads, D] view.
- `rms_norm_rope`: the same norm per head, then NeoX RoPE on the first rotary_dim channels (the query
  path); with norm=False the rotation alone (the key path, after the PIC capture of un-rotated keys).
  `rms_norm_rope_write` writes the result into KV cache rows instead (a decode step's key path), and
  V into its cache at the same rows in the same launch.
- `gated_rms_norm`: y = w * (x / rms(x)) * silu(gate), the weight not an offset (Gated DeltaNet output).
- `grouped_gated_rms_norm`: Mamba2's: gate first, y = w * norm_per_group(x * silu(gate)).
`rms_norm` / `add_rms_norm` with offset=False are the plain RMSNorm y = w * round(x / rms(x))
(Nemotron-H, Granite, Bamba).

Every function dispatches on the device: CPU runs the torch reference (the model's original
arithmetic, intermediate roundings included), CUDA the Triton kernel, which rounds at the same
points so that both paths compute the same function.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hypic.kernels.triton_lazy import next_power_of_2, triton_kernel

tl: Any  # triton.language, bound by triton_lazy on first GPU use

MAX_TILE = 4096  # elements of one program's [rows, D] tile: big rows get one program each


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = True) -> torch.Tensor:
    """Zero-centred (or plain, offset=False) RMSNorm over the last dim of x ([N, D] or [N, heads, D]);
    returns a dense tensor."""
    if x.device.type != "cuda":
        return rms_norm_ref(x, weight, eps) if offset else plain_rms_norm_ref(x, weight, eps)
    return norm_triton(x, weight, eps, offset=offset)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, offset: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for [N, D] tensors; the sum is rounded to x's dtype."""
    if x.device.type != "cuda":
        total = x + residual
        return rms_norm(total, weight, eps, offset), total
    total = torch.empty_like(x)
    return norm_triton(x, weight, eps, offset=offset, residual=residual, total=total), total


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   activation: str = "silu") -> torch.Tensor:
    """x, gate: [N, heads, D] (gate may be a strided view); weight [D] multiplies, not an offset.
    activation "sigmoid" (KDA's output gate) runs in torch on every device."""
    if x.device.type != "cuda" or activation != "silu":
        return gated_rms_norm_ref(x, gate, weight, eps, activation)
    return norm_triton(x, weight, eps, offset=False, gate=gate)


def grouped_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group: int,
                           eps: float) -> torch.Tensor:
    """x, gate: [N, D]; weight [D]. Torch on every device (a few elementwise passes of one layer)."""
    gated = x.float() * F.silu(gate.float())
    grouped = gated.unflatten(-1, (-1, group))
    normed = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return (weight * normed.to(x.dtype)).to(x.dtype)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
                  inv_freq: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D] (a strided view is fine). Zero-centred RMSNorm per head (skipped when weight
    is None), then NeoX RoPE at positions [N] on the first 2 * len(inv_freq) channels."""
    if x.device.type != "cuda":
        normed = x if weight is None else rms_norm_ref(x, weight, eps)
        return rope_ref(normed, positions, inv_freq)
    return norm_triton(x, weight, eps, offset=True, positions=positions, inv_freq=inv_freq)


def rms_norm_rope_write(x: torch.Tensor, weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
                        inv_freq: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor,
                        v: torch.Tensor, v_cache: torch.Tensor) -> None:
    """`rms_norm_rope(x, ...)` written into a KV cache [blocks, block_size, heads, D] at flat rows [N]
    (block * block_size + offset) instead of returned, and v (x's shape, strided is fine) into v_cache
    at the same rows as it is: a decode step's K and V writes in one launch."""
    flat, v_flat = cache.view(-1, *cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    if x.device.type != "cuda":
        flat.index_copy_(0, rows, rms_norm_rope(x, weight, eps, positions, inv_freq).to(cache.dtype))
        v_flat.index_copy_(0, rows, v.to(v_cache.dtype))
        return
    norm_triton(x, weight, eps, offset=True, positions=positions, inv_freq=inv_freq, out=flat, out_rows=rows,
                copy=(v, v_flat))


# ----------------------------------------------------------------------------- torch reference

def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def plain_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed).to(x.dtype)


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                       activation: str = "silu") -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if activation == "sigmoid":  # Kimi's norm stays float32 to the end (FLA's fused_rms_norm_gated)
        return (weight.float() * normed * torch.sigmoid(gate.float())).to(x.dtype)
    return (weight * normed.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


def rope_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of the first 2 * len(inv_freq) channels of x [N, heads, D], in float32."""
    half = inv_freq.numel()
    freqs = positions.float()[:, None] * inv_freq.to(x.device)
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:2 * half].float()
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return torch.cat((rotated, x[..., 2 * half:]), dim=-1)


# ----------------------------------------------------------------------------- GPU: Triton

def norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, offset: bool,
                residual: torch.Tensor | None = None, total: torch.Tensor | None = None,
                gate: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                inv_freq: torch.Tensor | None = None, out: torch.Tensor | None = None,
                out_rows: torch.Tensor | None = None,
                copy: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Every norm above in one kernel; one program per `block_rows` rows of the [rows, D] view of x
    (rows = N * heads). `total` receives x + residual when a residual is given. With `out_rows` [N],
    token n's heads go to row out_rows[n] of `out` (dense [*, heads, D], a KV cache) instead of a new y,
    and `copy`'s source (x's shape, [N, heads, D] strided) to the same rows of its dense destination."""
    dim = x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    rows = x.shape[0] * heads
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out_rows is None else out
    block_d = next_power_of_2(dim)
    block_rows = max(1, min(16, MAX_TILE // block_d // (2 if inv_freq is not None else 1)))  # RoPE: 2 tiles
    head_stride = x.stride(1) if x.dim() == 3 else 0
    gate_strides = (gate.stride(0), gate.stride(1)) if gate is not None else (0, 0)
    half = inv_freq.numel() if inv_freq is not None else 0
    src, dst = copy if copy is not None else (None, None)
    copy_strides = (src.stride(0), src.stride(1)) if copy is not None else (0, 0)
    _norm_kernel[(-(-rows // block_rows),)](
        x, residual, total, gate, weight, positions, inv_freq, y, out_rows, src, dst, rows, heads, x.stride(0),
        head_stride, *gate_strides, *copy_strides, eps, D=dim, BD=block_d, BR=block_rows, HALF=half,
        NORM=weight is not None, OFFSET=offset, HAS_RESIDUAL=residual is not None, HAS_GATE=gate is not None,
        OUT_ROWS=out_rows is not None, HAS_COPY=copy is not None, num_warps=8 if block_rows * block_d >= 2048 else 4)
    return y


@triton_kernel(do_not_specialize=("rows",))
def _norm_kernel(x, residual, total, gate, w, positions, inv_freq, y, out_rows, copy_src, copy_dst, rows, heads,
                 stride_xn, stride_xh, stride_gn, stride_gh, stride_cn, stride_ch, eps, D: tl.constexpr,
                 BD: tl.constexpr, BR: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr, OFFSET: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr, OUT_ROWS: tl.constexpr,
                 HAS_COPY: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m_r, m_d = r < rows, o_d < D
    m = m_r[:, None] & m_d[None, :]
    n, h = (r // heads).to(tl.int64), (r % heads).to(tl.int64)
    p_x = x + (n * stride_xn + h * stride_xh)[:, None]
    v = tl.load(p_x + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    dense = r.to(tl.int64)[:, None] * D + o_d[None, :]  # y, residual and total are dense [rows, D]
    if HAS_RESIDUAL:  # the sum is rounded to the model dtype, as torch's add, before the norm reads it
        v = v + tl.load(residual + dense, mask=m, other=0.0).to(tl.float32)
        v = v.to(total.dtype.element_ty)
        tl.store(total + dense, v, mask=m)
        v = v.to(tl.float32)
    rstd = tl.zeros((BR,), dtype=tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
        b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
        v = _normalize(v, rstd, b_w, OFFSET, x)
    if HAS_GATE:
        b_g = tl.load(gate + (n * stride_gn + h * stride_gh)[:, None] + o_d[None, :], mask=m, other=0.0)
        b_g = b_g.to(tl.float32)
        v = v * (b_g * tl.sigmoid(b_g))
    if HALF > 0:
        v = _rotate(v, p_x, rstd, w, positions, inv_freq, n, o_d, m, OFFSET, NORM, HALF, x)
    if OUT_ROWS:  # rounded to x's dtype first, as the unfused write's conversion of the result
        row = tl.load(out_rows + n, mask=m_r, other=0).to(tl.int64) * heads + h
        tl.store(y + row[:, None] * D + o_d[None, :], v.to(x.dtype.element_ty).to(y.dtype.element_ty), mask=m)
        if HAS_COPY:  # V beside K: the same rows of its own cache, as they are
            b_c = tl.load(copy_src + (n * stride_cn + h * stride_ch)[:, None] + o_d[None, :], mask=m, other=0.0)
            tl.store(copy_dst + row[:, None] * D + o_d[None, :], b_c.to(copy_dst.dtype.element_ty), mask=m)
    else:
        tl.store(y + dense, v.to(y.dtype.element_ty), mask=m)


@triton_kernel
def _normalize(v, rstd, b_w, OFFSET: tl.constexpr, x):
    """Zero-centred: round(v * rstd * (1 + w)); plain (gated norm): round(w * round(v * rstd)); rounded
    to x's dtype."""
    if OFFSET:
        return (v * rstd[:, None] * (1.0 + b_w[None, :])).to(x.dtype.element_ty).to(tl.float32)
    normed = (v * rstd[:, None]).to(x.dtype.element_ty).to(tl.float32)
    return (b_w[None, :] * normed).to(x.dtype.element_ty).to(tl.float32)


@triton_kernel
def _rotate(v, p_x, rstd, w, positions, inv_freq, n, o_d, m, OFFSET: tl.constexpr, NORM: tl.constexpr,
            HALF: tl.constexpr, x):
    """NeoX RoPE of the (normed) row tile v: channel i < HALF pairs with i + HALF; later channels pass.
    The partner channel is read again and normed with the same rstd (registers cannot be permuted)."""
    rotary = o_d < 2 * HALF
    first = o_d < HALF
    partner = tl.where(first, o_d + HALF, o_d - HALF)
    m_p = m & rotary[None, :]
    u = tl.load(p_x + partner[None, :], mask=m_p, other=0.0).to(tl.float32)
    if NORM:
        u = _normalize(u, rstd, tl.load(w + partner, mask=rotary, other=0.0).to(tl.float32), OFFSET, x)
    freq = tl.load(inv_freq + (o_d % HALF), mask=rotary, other=0.0)
    angle = tl.load(positions + n).to(tl.float32)[:, None] * freq[None, :]
    cos, sin = tl.cos(angle), tl.sin(angle)
    turned = tl.where(first[None, :], v * cos - u * sin, v * cos + u * sin)
    return tl.where(rotary[None, :], turned, v)
