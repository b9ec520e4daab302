"""One Gated DeltaNet decode step (one token per sequence) in one kernel: the causal conv1d over the
projection's q/k/v channels with its window shifted in conv_pool, the q/k l2norm, the gates, the
recurrence in ssm_pool and the gated RMSNorm of its output, which are five launches otherwise (issue 29:
a batch-1 decode step is launch bound).

CPU runs the torch reference: the five unfused references in turn (conv1d, l2norm, gates, recurrence,
gated norm). CUDA runs the Triton kernel, which rounds where the unfused kernels do (the conv output, q
and k, beta, the recurrence's output and the norm's steps, to the model dtype), so both compute the same
function. A program takes one sequence, one value head and a block of its value channels, as the plain
decode kernel does (many programs at small batches). Two things need a whole group of programs: every
program of a key head reads that head's q/k conv window, and the norm reads a value head's whole output
row; the program of the group that finishes last (it counts them on a counter per group, acquire-release,
and resets it: no host work, CUDA-graph capturable) shifts the window, or norms the row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hypic.kernels.activation import softplus
from hypic.kernels.conv1d import (causal_conv1d_ref, decode_conv_channels, decode_conv_constants,
                                  decode_shifted_window)
from hypic.kernels.gdn import gated_delta_rule_ref
from hypic.kernels.gdn_inputs import L2NORM_EPS, gdn_gates_ref, qk_l2norm
from hypic.kernels.norms import gated_rms_norm_ref
from hypic.kernels.triton_lazy import next_power_of_2, triton_kernel
from hypic.kernels.varlen import decode_launch, decode_program, decode_state, one_token_each

tl: Any  # triton.language, bound by triton_lazy on first GPU use

_COUNTERS: dict[torch.device, torch.Tensor] = {}  # per device: zero between launches (the kernels reset them)


@dataclass(frozen=True)
class GdnDecodeLayer:
    """What a decode step reads of a Gated DeltaNet layer besides its inputs: conv_weight [conv_dim, W]
    (no bias, silu), A_log and dt_bias [HV] float32, the output norm's weight [V] and eps, the head shape
    (q/k heads of head_k channels, value heads of head_v) and q's scale."""

    conv_weight: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    norm_weight: torch.Tensor
    norm_eps: float
    heads: int
    head_k: int
    head_v: int
    scale: float


def gdn_decode(mixed_qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, layer: GdnDecodeLayer,
               ssm_pool: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
               has_state: torch.Tensor) -> torch.Tensor:
    """mixed_qkv: [B, conv_dim] the conv input (q | k | v channels: H*K, H*K, HV*V), one token of each
    sequence; z: [B, HV, V] the output gate; a, b: [B, HV] (strided views are fine). Sequence b starts
    from the slot's conv window and state if has_state[b], else zeros; both are updated in place.
    Returns the gated RMSNorm of the recurrence's output, [B, HV, V] in mixed_qkv's dtype."""
    if mixed_qkv.device.type != "cuda":
        return gdn_decode_ref(mixed_qkv, z, a, b, layer, ssm_pool, conv_pool, slots, has_state)
    return gdn_decode_triton(mixed_qkv, z, a, b, layer, ssm_pool, conv_pool, slots, has_state)


def gdn_decode_ref(mixed_qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   layer: GdnDecodeLayer, ssm_pool: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
                   has_state: torch.Tensor) -> torch.Tensor:
    """Same contract as `gdn_decode`: conv1d, l2norm, gates, recurrence and gated norm references in turn."""
    tokens, c = mixed_qkv.shape[0], layer
    cu_seqlens, one_each = one_token_each(tokens, mixed_qkv.device)
    conv_out = causal_conv1d_ref(mixed_qkv, c.conv_weight, None, conv_pool, slots, has_state, cu_seqlens,
                                 **one_each)
    q, k = qk_l2norm(conv_out, c.heads, c.head_k)
    v = conv_out[:, 2 * c.heads * c.head_k:].reshape(tokens, -1, c.head_v)
    g, beta = gdn_gates_ref(a, b, c.A_log, c.dt_bias)
    o = gated_delta_rule_ref(q, k, v, g, beta, ssm_pool, slots, has_state, cu_seqlens, scale=c.scale, **one_each)
    return gated_rms_norm_ref(o, z, c.norm_weight, c.norm_eps)


def gdn_decode_triton(mixed_qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      layer: GdnDecodeLayer, ssm_pool: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
                      has_state: torch.Tensor) -> torch.Tensor:
    tokens, value_heads = a.shape
    c, like = layer, dict(dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    o, y = torch.empty((tokens, value_heads, c.head_v), **like), torch.empty((tokens, value_heads, c.head_v), **like)
    grid, shape = decode_launch(mixed_qkv[:, : c.heads * c.head_k].unflatten(1, (c.heads, c.head_k)), o)  # q's
    z = z if z.stride(2) == 1 and z.stride(1) == c.head_v else z.contiguous()  # rows may be strided
    _gdn_decode_step_kernel[grid](
        mixed_qkv, z, a, b, c.conv_weight.contiguous(), c.A_log, c.dt_bias, c.norm_weight, o, y, ssm_pool,
        conv_pool, slots, has_state, group_counters(tokens * (c.heads + value_heads), mixed_qkv.device), c.scale,
        L2NORM_EPS, c.norm_eps, mixed_qkv.stride(0), z.stride(0), a.stride(0), b.stride(0),
        BVR=next_power_of_2(c.head_v), **decode_conv_constants(c.conv_weight), **shape)
    return y


def group_counters(count: int, device: torch.device) -> torch.Tensor:
    """At least `count` zero counters on `device` (the fused decode kernels of every family share them);
    the first (largest) decode step allocates them, which DecodeGraphs' warm-up forward runs before any
    capture."""
    if device not in _COUNTERS or _COUNTERS[device].numel() < count:
        _COUNTERS[device] = torch.zeros(count, dtype=torch.int32, device=device)
    return _COUNTERS[device]


@triton_kernel
def l2_normalized(y, eps, o):
    """The conv output y rounded to o's dtype, normalised as qk_l2norm does (float32 sums, rounded)."""
    y = y.to(o.dtype.element_ty).to(tl.float32)
    return (y * tl.rsqrt(tl.sum(y * y, axis=0) + eps)).to(o.dtype.element_ty).to(tl.float32)


@triton_kernel
def _gdn_decode_step_kernel(x, z, a, b, w, A_log, dt_bias, norm_w, o, y, pool, conv_pool, slots, has_state,
                            counters, scale, eps, norm_eps, stride_x, stride_z, stride_a, stride_b, W: tl.constexpr,
                            BW: tl.constexpr, BVR: tl.constexpr, H: tl.constexpr, HV: tl.constexpr,
                            K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    i_b, i_hv, i_h, o_k, o_v, m_k, m_v, slot = decode_program(slots, H, HV, K, V, BK, BV)
    keep = tl.load(has_state + i_b) != 0
    x_row = x + i_b.to(tl.int64) * stride_x
    p_window = conv_pool + slot * (2 * H * K + HV * V) * (W - 1)
    c_q, c_k, c_v = i_h * K + o_k, H * K + i_h * K + o_k, 2 * H * K + i_hv * V + o_v
    y_q, x_q = decode_conv_channels(x_row, w, None, p_window, c_q, m_k, keep, W, BW, False)
    y_k, x_k = decode_conv_channels(x_row, w, None, p_window, c_k, m_k, keep, W, BW, False)
    y_v, x_v = decode_conv_channels(x_row, w, None, p_window, c_v, m_v, keep, W, BW, False)
    p_shift, shifted, m_shift = decode_shifted_window(p_window, c_v, m_v, x_v, keep, W, BW)
    tl.store(p_shift, shifted, mask=m_shift)  # value channels: this program's own
    b_q = l2_normalized(y_q, eps, o) * scale
    b_k = l2_normalized(y_k, eps, o)
    b_v = y_v.to(o.dtype.element_ty).to(tl.float32)
    rate = softplus(tl.load(a + i_b * stride_a + i_hv).to(tl.float32) + tl.load(dt_bias + i_hv).to(tl.float32))
    b_g = -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * rate
    b_beta = tl.sigmoid(tl.load(b + i_b * stride_b + i_hv).to(tl.float32)).to(b.dtype.element_ty).to(tl.float32)
    p_state, m_state, state = decode_state(pool, slot, i_hv, o_k, o_v, m_k, m_v, keep, HV, K, V)
    state = state * tl.exp(b_g)
    err = b_beta * (b_v - tl.sum(state * b_k[:, None], axis=0))
    state = state + b_k[:, None] * err[None, :]
    tl.store(o + (i_b * HV + i_hv) * V + o_v, tl.sum(state * b_q[:, None], axis=0).to(o.dtype.element_ty), mask=m_v)
    tl.store(p_state, state, mask=m_state)
    tl.debug_barrier()  # every thread's window reads and output stores come before the counts below
    # the key head's programs have all read its q/k window once its counter reaches their number
    p_read = counters + i_b * H + i_h
    if tl.atomic_add(p_read, 1) == (HV // H) * tl.num_programs(2) - 1:
        p_q, shifted_q, m_q = decode_shifted_window(p_window, c_q, m_k, x_q, keep, W, BW)
        tl.store(p_q, shifted_q, mask=m_q)
        p_k, shifted_k, m_kw = decode_shifted_window(p_window, c_k, m_k, x_k, keep, W, BW)
        tl.store(p_k, shifted_k, mask=m_kw)
        tl.atomic_xchg(p_read, 0)
    # and the value head's whole output row is written once its counter reaches theirs: the last norms it
    p_done = counters + tl.num_programs(0) * H + i_b * HV + i_hv
    if tl.atomic_add(p_done, 1) == tl.num_programs(2) - 1:
        _gated_norm_row(o, z, norm_w, y, i_b, i_hv, stride_z, norm_eps, HV, V, BVR)
        tl.atomic_xchg(p_done, 0)


@triton_kernel
def _gated_norm_row(o, z, norm_w, y, i_b, i_hv, stride_z, eps, HV: tl.constexpr, V: tl.constexpr,
                    BVR: tl.constexpr):
    """y = round(w * round(o / rms(o))) * silu(z) over one value head's row, rounded where the gated
    norm kernel rounds (norms.py, offset=False with a gate)."""
    o_r = tl.arange(0, BVR)
    m_r = o_r < V
    row = tl.load(o + (i_b * HV + i_hv) * V + o_r, mask=m_r, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(row * row, axis=0) / V + eps)
    normed = (row * rstd).to(y.dtype.element_ty).to(tl.float32)
    b_w = tl.load(norm_w + o_r, mask=m_r, other=0.0).to(tl.float32)
    v = (b_w * normed).to(y.dtype.element_ty).to(tl.float32)
    b_z = tl.load(z + i_b * stride_z + i_hv * V + o_r, mask=m_r, other=0.0).to(tl.float32)
    tl.store(y + (i_b * HV + i_hv) * V + o_r, (v * (b_z * tl.sigmoid(b_z))).to(y.dtype.element_ty), mask=m_r)
