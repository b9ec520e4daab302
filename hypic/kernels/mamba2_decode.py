"""One Mamba2 decode step (one token per sequence) in two kernels: the causal conv1d over xBC with its
window shifted in conv_pool, dt's softplus and clamp, the SSD recurrence in ssm_pool, the D skip, and
the gated RMSNorm over groups, which are ~20 launches otherwise (issue 29: a batch-1 decode step of
Nemotron 3 is launch bound).

CPU runs the torch reference: the unfused steps in turn (conv1d, `ssd_gates`, the scalar-gated
recurrence, `d_skip`, the grouped gated norm), which the mixer's ordinary path runs too. CUDA runs the
Triton kernels, which round where the unfused path does (the conv output, dt x, the recurrence's
output, y + D x and the norm's steps, to the model dtype), so both compute the same function.

The step kernel takes one sequence, one head and a block of its channels, as the plain decode kernel
does (many programs at small batches); it convolves its own x channels and its group's B and C (every
head of the group recomputes them: a few hundred products). The norm kernel takes one sequence and one
group, whose channels are exactly the group's heads' outputs; it also shifts the group's B and C
windows, which every head's program of the step kernel reads and so cannot move before it ends.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hypic.kernels.activation import softplus
from hypic.kernels.conv1d import (causal_conv1d_ref, decode_conv_channels, decode_conv_constants,
                                  decode_shifted_window)
from hypic.kernels.norms import grouped_gated_rms_norm
from hypic.kernels.scalar_gated import scalar_gated_rule_ref
from hypic.kernels.triton_lazy import next_power_of_2, triton_kernel
from hypic.kernels.varlen import decode_launch, decode_program, decode_state, one_token_each

tl: Any  # triton.language, bound by triton_lazy on first GPU use


@dataclass(frozen=True)
class Mamba2DecodeLayer:
    """What a decode step reads of a Mamba2 layer besides its inputs: conv_weight [conv_dim, W] and
    conv_bias [conv_dim] or None over [x | B | C]; A_log, dt_bias, D [heads] float32; the gated norm's
    weight [heads * head_dim] and eps; the head shape and dt's clamp (lo, hi)."""

    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    D: torch.Tensor
    norm_weight: torch.Tensor
    norm_eps: float
    heads: int
    head_dim: int
    groups: int
    state_size: int
    time_step_limit: tuple[float, float]

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim


def split_xbc(conv_out: torch.Tensor, heads: int, groups: int,
              state_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Post-conv channels [N, conv_dim] -> x [N, heads, head_dim], B and C [N, groups, state_size]."""
    b_c = groups * state_size
    x, b, c = conv_out.split((conv_out.shape[1] - 2 * b_c, b_c, b_c), dim=-1)
    return x.unflatten(1, (heads, -1)), b.unflatten(1, (groups, -1)), c.unflatten(1, (groups, -1))


def ssd_gates(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor,
              time_step_limit: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """v = dt x [N, H, P] rounded to x's dtype (the recurrence takes q, k, v in one dtype) and the
    log-decay g = dt A [N, H] (float32), dt = clamp(softplus(dt + dt_bias)), A = -exp(A_log)."""
    dt = F.softplus(dt.float() + dt_bias).clamp(*time_step_limit)
    return (x.float() * dt[..., None]).to(x.dtype), dt * -torch.exp(A_log)


def d_skip(o: torch.Tensor, x: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """y = o + D x per head ([N, H, P]), rounded to x's dtype."""
    return (o.float() + D[:, None] * x.float()).to(x.dtype)


def mamba2_decode(xbc: torch.Tensor, z: torch.Tensor, dt: torch.Tensor, layer: Mamba2DecodeLayer,
                  ssm_pool: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
                  has_state: torch.Tensor) -> torch.Tensor:
    """xbc: [B, conv_dim] the conv input, one token of each sequence; z: [B, H*P] the gate; dt: [B, H]
    before softplus (strided views are fine). Sequence b starts from the slot's conv window and state if
    has_state[b], else zeros; both are updated in place. Returns the gated norm's output [B, H*P] in
    xbc's dtype (the out projection's input)."""
    if xbc.device.type != "cuda":
        return mamba2_decode_ref(xbc, z, dt, layer, ssm_pool, conv_pool, slots, has_state)
    return mamba2_decode_triton(xbc, z, dt, layer, ssm_pool, conv_pool, slots, has_state)


def mamba2_decode_ref(xbc: torch.Tensor, z: torch.Tensor, dt: torch.Tensor, layer: Mamba2DecodeLayer,
                      ssm_pool: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
                      has_state: torch.Tensor) -> torch.Tensor:
    """Same contract as `mamba2_decode`: the unfused references in turn."""
    tokens, m = xbc.shape[0], layer
    cu_seqlens, one_each = one_token_each(tokens, xbc.device)
    conv_out = causal_conv1d_ref(xbc, m.conv_weight, m.conv_bias, conv_pool, slots, has_state, cu_seqlens,
                                 **one_each)
    x, b, c = split_xbc(conv_out, m.heads, m.groups, m.state_size)
    v, g = ssd_gates(x, dt, m.dt_bias, m.A_log, m.time_step_limit)
    o = scalar_gated_rule_ref(c, b, v, g, ssm_pool, slots, has_state, cu_seqlens, scale=1.0, **one_each)
    y = d_skip(o, x, m.D).flatten(1)
    return grouped_gated_rms_norm(y, z, m.norm_weight, m.inner // m.groups, m.norm_eps)


def mamba2_decode_triton(xbc: torch.Tensor, z: torch.Tensor, dt: torch.Tensor, layer: Mamba2DecodeLayer,
                         ssm_pool: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
                         has_state: torch.Tensor) -> torch.Tensor:
    tokens, c = xbc.shape[0], layer
    y = torch.empty((tokens, c.heads, c.head_dim), dtype=xbc.dtype, device=xbc.device)
    out = torch.empty((tokens, c.inner), dtype=xbc.dtype, device=xbc.device)
    xbc, z, dt = (t if t.stride(1) == 1 else t.contiguous() for t in (xbc, z, dt))  # rows may be strided
    grid, step = step_launch(c, xbc, y)
    _ssd_step_kernel[grid](
        xbc, dt, c.conv_weight.contiguous(), c.conv_bias, c.A_log, c.dt_bias, c.D, y, ssm_pool, conv_pool, slots,
        has_state, *c.time_step_limit, xbc.stride(0), dt.stride(0), **step)
    norm, warps = norm_launch(c)
    _group_norm_kernel[(tokens, c.groups)](
        xbc, z, y, c.norm_weight, out, conv_pool, slots, has_state, c.norm_eps, xbc.stride(0), z.stride(0), **norm,
        num_warps=warps)
    return out


def step_launch(layer: Mamba2DecodeLayer, xbc: torch.Tensor,
                y: torch.Tensor) -> tuple[tuple[int, int, int], dict[str, Any]]:
    """Grid and constants of the step kernel: `decode_launch`'s over C [B, G, d_state] (groups as key
    heads) and y [B, H, P], and the conv's."""
    c = layer
    c_view = xbc[:, c.inner + c.groups * c.state_size:].unflatten(1, (c.groups, c.state_size))
    grid, shape = decode_launch(c_view, y)
    return grid, {**shape, **decode_conv_constants(c.conv_weight), "HAS_BIAS": c.conv_bias is not None}


def norm_launch(layer: Mamba2DecodeLayer) -> tuple[dict[str, Any], int]:
    """Constants and warps of the norm kernel (a program per sequence and group)."""
    c, group = layer, layer.inner // layer.groups
    constants = dict(H=c.heads, G=c.groups, N=c.state_size, P=c.head_dim, R=group, BR=next_power_of_2(group),
                     BN=next_power_of_2(c.state_size), **decode_conv_constants(c.conv_weight))
    return constants, 8 if group >= 2048 else 4


@triton_kernel
def _ssd_step_kernel(xbc, dt, w, bias, A_log, dt_bias, D, y, pool, conv_pool, slots, has_state, dt_min, dt_max,
                     stride_xbc, stride_dt, W: tl.constexpr, BW: tl.constexpr, HAS_BIAS: tl.constexpr,
                     H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr):
    """decode_program's names: H groups, HV heads, K d_state, V head_dim; y [B, HV, V] gets o + D x."""
    i_b, i_hv, i_h, o_k, o_v, m_k, m_v, slot = decode_program(slots, H, HV, K, V, BK, BV)
    keep = tl.load(has_state + i_b) != 0
    row = xbc + i_b.to(tl.int64) * stride_xbc
    p_window = conv_pool + slot * (HV * V + 2 * H * K) * (W - 1)
    c_x, c_b = i_hv * V + o_v, HV * V + i_h * K + o_k
    b_x, x_in = decode_conv_channels(row, w, bias, p_window, c_x, m_v, keep, W, BW, HAS_BIAS)
    b_b, _ = decode_conv_channels(row, w, bias, p_window, c_b, m_k, keep, W, BW, HAS_BIAS)
    b_c, _ = decode_conv_channels(row, w, bias, p_window, c_b + H * K, m_k, keep, W, BW, HAS_BIAS)
    p_shift, shifted, m_shift = decode_shifted_window(p_window, c_x, m_v, x_in, keep, W, BW)
    b_x, b_b, b_c = (b_x.to(y.dtype.element_ty).to(tl.float32), b_b.to(y.dtype.element_ty).to(tl.float32),
                     b_c.to(y.dtype.element_ty).to(tl.float32))
    s = tl.load(dt + i_b * stride_dt + i_hv).to(tl.float32) + tl.load(dt_bias + i_hv)
    b_dt = tl.minimum(tl.maximum(softplus(s), dt_min), dt_max)
    b_v = (b_x * b_dt).to(y.dtype.element_ty).to(tl.float32)
    p_state, m_state, state = decode_state(pool, slot, i_hv, o_k, o_v, m_k, m_v, keep, HV, K, V)
    state = state * tl.exp(-tl.exp(tl.load(A_log + i_hv)) * b_dt) + b_b[:, None] * b_v[None, :]
    b_o = tl.sum(state * b_c[:, None], axis=0).to(y.dtype.element_ty).to(tl.float32)
    tl.store(y + (i_b * HV + i_hv) * V + o_v, (b_o + tl.load(D + i_hv) * b_x).to(y.dtype.element_ty), mask=m_v)
    tl.store(p_state, state, mask=m_state)
    tl.debug_barrier()  # every thread's window reads come before its x channels move
    tl.store(p_shift, shifted, mask=m_shift)


@triton_kernel
def _group_norm_kernel(xbc, z, y, norm_w, out, conv_pool, slots, has_state, eps, stride_xbc, stride_z,
                       H: tl.constexpr, G: tl.constexpr, N: tl.constexpr, P: tl.constexpr, R: tl.constexpr,
                       BR: tl.constexpr, BN: tl.constexpr, W: tl.constexpr, BW: tl.constexpr):
    """out = round(w * round(g / rms(g))), g = y * silu(z), over group i_g's R channels (rounded where
    `grouped_gated_rms_norm` rounds); then the group's B and C windows shift."""
    i_b, i_g = tl.program_id(0), tl.program_id(1)
    o_r = tl.arange(0, BR)
    m_r = o_r < R
    c = i_g * R + o_r
    b_z = tl.load(z + i_b * stride_z + c, mask=m_r, other=0.0).to(tl.float32)
    gated = tl.load(y + i_b * (H * P) + c, mask=m_r, other=0.0).to(tl.float32) * (b_z * tl.sigmoid(b_z))
    normed = (gated * tl.rsqrt(tl.sum(gated * gated, axis=0) / R + eps)).to(out.dtype.element_ty).to(tl.float32)
    b_w = tl.load(norm_w + c, mask=m_r, other=0.0).to(tl.float32)
    tl.store(out + i_b * (H * P) + c, (b_w * normed).to(out.dtype.element_ty), mask=m_r)
    keep = tl.load(has_state + i_b) != 0
    row = xbc + i_b.to(tl.int64) * stride_xbc
    p_window = conv_pool + tl.load(slots + i_b).to(tl.int64) * (H * P + 2 * G * N) * (W - 1)
    o_n = tl.arange(0, BN)
    m_n = o_n < N
    c_b = H * P + i_g * N + o_n
    c_c = c_b + G * N
    x_b = tl.load(row + c_b, mask=m_n, other=0.0).to(tl.float32)
    x_c = tl.load(row + c_c, mask=m_n, other=0.0).to(tl.float32)
    p_b, shifted_b, m_b = decode_shifted_window(p_window, c_b, m_n, x_b, keep, W, BW)
    p_c, shifted_c, m_c = decode_shifted_window(p_window, c_c, m_n, x_c, keep, W, BW)
    tl.debug_barrier()  # every thread's window reads come before the windows move
    tl.store(p_b, shifted_b, mask=m_b)
    tl.store(p_c, shifted_c, mask=m_c)
