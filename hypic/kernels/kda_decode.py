"""One Kimi Delta Attention decode step (one token per sequence) in one kernel: the three short convs over
[q | k | v] with their windows shifted in conv_pool, the q/k l2norm, the per-key forget gate and beta, the
recurrence in ssm_pool and the sigmoid-gated RMSNorm of its output, which are some twenty launches
otherwise (issue 29: a batch-1 decode step is launch bound).

CPU runs the torch reference: the unfused references in turn (conv1d, l2norm, `kda_gates`, recurrence,
gated norm). CUDA runs the Triton kernel, which rounds where the unfused path does (the conv output, q
and k, beta and the recurrence's output to the model dtype; the gate and the norm stay float32), so both
compute the same function. The layout is the fused Gated DeltaNet step's (gdn_decode.py, whose helpers
it shares) with as many value heads as key heads: a program takes one sequence, one head and a block of
its value channels; the head's last program to finish (counted on a shared counter, reset after) shifts
the q/k windows every program of the head read and norms the head's whole output row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hypic.kernels.activation import softplus
from hypic.kernels.conv1d import (causal_conv1d_ref, decode_conv_channels, decode_conv_constants,
                                  decode_shifted_window)
from hypic.kernels.gdn_decode import group_counters, l2_normalized
from hypic.kernels.gdn_inputs import L2NORM_EPS, qk_l2norm
from hypic.kernels.kda_rule import kda_rule_ref
from hypic.kernels.norms import gated_rms_norm_ref
from hypic.kernels.triton_lazy import triton_kernel
from hypic.kernels.varlen import decode_launch, decode_program, one_token_each

tl: Any  # triton.language, bound by triton_lazy on first GPU use


@dataclass(frozen=True)
class KdaDecodeLayer:
    """What a decode step reads of a KDA layer besides its inputs: conv_weight [3*H*K, W] (no bias, silu),
    A_log [H] and dt_bias [H*K] float32, the output norm's weight [K] and eps, the head shape (H heads of
    K channels for q, k and v alike) and q's scale."""

    conv_weight: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    norm_weight: torch.Tensor
    norm_eps: float
    heads: int
    head_dim: int
    scale: float


def kda_gates(f: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """f [N, H*K] (the forget gate's low-rank projection), b [N, H]; A_log [H], dt_bias [H*K] float32.
    Returns the per-key log-decay g = -exp(A_log) softplus(f + dt_bias) [N, H, K] (float32) and
    beta = sigmoid(b) in b's dtype. Torch on every device (the fused step computes them on CUDA)."""
    g = F.softplus(f.float() + dt_bias).unflatten(-1, (A_log.shape[0], -1))
    return g * -A_log.exp()[:, None], torch.sigmoid(b.float()).to(b.dtype)


def kda_decode(qkv: torch.Tensor, b: torch.Tensor, f: torch.Tensor, gate: torch.Tensor, layer: KdaDecodeLayer,
               ssm_pool: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
               has_state: torch.Tensor) -> torch.Tensor:
    """qkv: [B, 3*H*K] the conv input, one token of each sequence; b [B, H]; f [B, H*K]; gate [B, H, K] the
    output gate (rows may be strided views). Sequence b starts from the slot's conv window and state if
    has_state[b], else zeros; both are updated in place (several padding rows may share one slot: what
    it holds afterwards is undefined). Returns the gated RMSNorm of the recurrence's output, [B, H, K]
    in qkv's dtype."""
    if qkv.device.type != "cuda":
        return kda_decode_ref(qkv, b, f, gate, layer, ssm_pool, conv_pool, slots, has_state)
    return kda_decode_triton(qkv, b, f, gate, layer, ssm_pool, conv_pool, slots, has_state)


def kda_decode_ref(qkv: torch.Tensor, b: torch.Tensor, f: torch.Tensor, gate: torch.Tensor, layer: KdaDecodeLayer,
                   ssm_pool: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
                   has_state: torch.Tensor) -> torch.Tensor:
    """Same contract as `kda_decode`: conv1d, l2norm, gates, recurrence and gated norm references in turn."""
    tokens, c = qkv.shape[0], layer
    cu_seqlens, one_each = one_token_each(tokens, qkv.device)
    conv_out = causal_conv1d_ref(qkv, c.conv_weight, None, conv_pool, slots, has_state, cu_seqlens, **one_each)
    q, k = qk_l2norm(conv_out, c.heads, c.head_dim)
    v = conv_out[:, 2 * c.heads * c.head_dim:].reshape(tokens, c.heads, c.head_dim)
    g, beta = kda_gates(f, b, c.A_log, c.dt_bias)
    o = kda_rule_ref(q, k, v, g, beta, ssm_pool, slots, has_state, cu_seqlens, scale=c.scale, **one_each)
    return gated_rms_norm_ref(o, gate, c.norm_weight, c.norm_eps, "sigmoid")


def kda_decode_triton(qkv: torch.Tensor, b: torch.Tensor, f: torch.Tensor, gate: torch.Tensor,
                      layer: KdaDecodeLayer, ssm_pool: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
                      has_state: torch.Tensor) -> torch.Tensor:
    tokens, c = qkv.shape[0], layer
    o = torch.empty((tokens, c.heads, c.head_dim), dtype=qkv.dtype, device=qkv.device)
    y = torch.empty_like(o)
    grid, shape = decode_launch(qkv[:, : c.heads * c.head_dim].unflatten(1, (c.heads, c.head_dim)), o)  # q's
    qkv, b, f, gate = (_dense_rows(t) for t in (qkv, b, f, gate))
    _kda_decode_step_kernel[grid](
        qkv, b, f, gate, c.conv_weight.contiguous(), c.A_log, c.dt_bias, c.norm_weight, o, y, ssm_pool, conv_pool,
        slots, has_state, group_counters(tokens * c.heads, qkv.device), c.scale, L2NORM_EPS, c.norm_eps,
        qkv.stride(0), b.stride(0), f.stride(0), gate.stride(0), **decode_conv_constants(c.conv_weight), **shape)
    return y


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    """t with each row dense; rows may lie apart (the projection's column views)."""
    return t if t[:1].is_contiguous() else t.contiguous()


@triton_kernel
def _kda_decode_step_kernel(x, b, f, gate, w, A_log, dt_bias, norm_w, o, y, pool, conv_pool, slots, has_state,
                            counters, scale, eps, norm_eps, stride_x, stride_b, stride_f, stride_gate,
                            W: tl.constexpr, BW: tl.constexpr, H: tl.constexpr, HV: tl.constexpr,
                            K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    i_b, i_h, _, o_k, o_v, m_k, m_v, slot = decode_program(slots, H, HV, K, V, BK, BV)
    keep = tl.load(has_state + i_b) != 0
    x_row = x + i_b.to(tl.int64) * stride_x
    p_window = conv_pool + slot * (3 * H * K) * (W - 1)
    c_q, c_k, c_v = i_h * K + o_k, (H + i_h) * K + o_k, (2 * H + i_h) * K + o_v
    y_q, x_q = decode_conv_channels(x_row, w, None, p_window, c_q, m_k, keep, W, BW, False)
    y_k, x_k = decode_conv_channels(x_row, w, None, p_window, c_k, m_k, keep, W, BW, False)
    y_v, x_v = decode_conv_channels(x_row, w, None, p_window, c_v, m_v, keep, W, BW, False)
    p_shift, shifted, m_shift = decode_shifted_window(p_window, c_v, m_v, x_v, keep, W, BW)
    tl.store(p_shift, shifted, mask=m_shift)  # value channels: this program's own
    b_g, b_beta = _gates(f + i_b * stride_f, b + i_b * stride_b, A_log, dt_bias, i_h, o_k, m_k, K)
    p_state = pool + ((slot * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    m_state = m_k[:, None] & m_v[None, :]
    state = tl.where(keep, tl.load(p_state, mask=m_state, other=0.0).to(tl.float32), 0.0)
    state = state * tl.exp(b_g)[:, None]  # one gate per key row
    b_k = l2_normalized(y_k, eps, o)
    err = b_beta * (y_v.to(o.dtype.element_ty).to(tl.float32) - tl.sum(state * b_k[:, None], axis=0))
    state = state + b_k[:, None] * err[None, :]
    b_o = tl.sum(state * (l2_normalized(y_q, eps, o) * scale)[:, None], axis=0)
    tl.store(o + (i_b * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    tl.store(p_state, state, mask=m_state)
    tl.debug_barrier()  # every thread's window reads and output stores come before the count below
    # the head's programs have all read its q/k windows and written its output row once the count is theirs
    p_count = counters + i_b * H + i_h
    if tl.atomic_add(p_count, 1) == tl.num_programs(2) - 1:
        p_q, shifted_q, m_q = decode_shifted_window(p_window, c_q, m_k, x_q, keep, W, BW)
        tl.store(p_q, shifted_q, mask=m_q)
        p_k, shifted_k, m_kw = decode_shifted_window(p_window, c_k, m_k, x_k, keep, W, BW)
        tl.store(p_k, shifted_k, mask=m_kw)
        _sigmoid_gated_norm_row(o, gate + i_b * stride_gate + i_h * V, norm_w, y, i_b * H + i_h, norm_eps, V, BK)
        tl.atomic_xchg(p_count, 0)


@triton_kernel
def _gates(f_row, b_row, A_log, dt_bias, i_h, o_k, m_k, K: tl.constexpr):
    """`kda_gates` of one head: the float32 log-decays of its key channels and beta (rounded to b's dtype)."""
    x = tl.load(f_row + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    x = x + tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0)
    g = softplus(x) * -tl.exp(tl.load(A_log + i_h))
    beta = tl.sigmoid(tl.load(b_row + i_h).to(tl.float32)).to(b_row.dtype.element_ty).to(tl.float32)
    return g, beta


@triton_kernel
def _sigmoid_gated_norm_row(o, gate_row, norm_w, y, row, eps, V: tl.constexpr, BVR: tl.constexpr):
    """y = w * (o / rms(o)) * sigmoid(gate) over one head's output row, float32 from the rounded o to the
    end, as Kimi's norm is (norms.py, activation "sigmoid")."""
    o_r = tl.arange(0, BVR)
    m_r = o_r < V
    x = tl.load(o + row * V + o_r, mask=m_r, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / V + eps)
    b_w = tl.load(norm_w + o_r, mask=m_r, other=0.0).to(tl.float32)
    b_z = tl.load(gate_row + o_r, mask=m_r, other=0.0).to(tl.float32)
    tl.store(y + row * V + o_r, (b_w * normed * tl.sigmoid(b_z)).to(y.dtype.element_ty), mask=m_r)
