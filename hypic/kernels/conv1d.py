"""Depthwise causal conv1d over a flat varlen batch; each sequence's window of the last W-1 inputs
lives in the state slab (conv_pool [S, D, W-1], oldest first) and is updated there in place.

Paths: CPU -> `causal_conv1d_ref` (F.conv1d per sequence); CUDA -> our Triton kernels: a fused
decode kernel (one token per sequence, window shifted in place) and a varlen prefill kernel pair
(outputs, then windows). FLA's conv keeps [N, D, W] states, so it would need a gather and a scatter
per call; reading the slab by slot inside our kernels avoids both. `decode_conv_channels` and
`decode_shifted_window` are the decode kernel's arithmetic, which the fused decode steps of a layer
(gdn_decode, kda_decode, mamba2_decode) call too for the channels of a program and their windows.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F

from hypic.kernels.triton_lazy import next_power_of_2, triton_kernel
from hypic.kernels.varlen_tiles import num_tiles, tile_start

tl: Any  # triton.language, bound by triton_lazy on first GPU use

ACTIVATIONS = (None, "silu")


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_pool: torch.Tensor,
                  slots: torch.Tensor, has_state: torch.Tensor, cu_seqlens: torch.Tensor, *, num_decodes: int,
                  seq_lens_cpu: tuple[int, ...], activation: str | None = "silu") -> torch.Tensor:
    """x: [N, D]; weight: [D, W]; bias: [D] or None. Sequence b's left context is conv_pool[slots[b]]
    if has_state[b] else zeros; afterwards that slot holds the sequence's last W-1 inputs (earlier
    context included). Returns y: [N, D] with the activation applied."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.device.type != "cuda":
        return causal_conv1d_ref(x, weight, bias, conv_pool, slots, has_state, cu_seqlens,
                                 num_decodes=num_decodes, seq_lens_cpu=seq_lens_cpu, activation=activation)
    x, weight = (x if x.stride(1) == 1 else x.contiguous()), weight.contiguous()  # kernels index dense rows
    y = torch.empty_like(x)
    nd = num_decodes
    if nd:
        conv1d_decode_triton(x[:nd], weight, bias, conv_pool, slots[:nd], has_state[:nd], activation, out=y[:nd])
    if len(seq_lens_cpu) > nd:
        conv1d_varlen_triton(x, weight, bias, conv_pool, slots, has_state, cu_seqlens, activation, out=y,
                             first_seq=nd, seq_lens=seq_lens_cpu[nd:])
    return y


# ----------------------------------------------------------------------------- torch reference

def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_pool: torch.Tensor,
                      slots: torch.Tensor, has_state: torch.Tensor, cu_seqlens: torch.Tensor, *, num_decodes: int,
                      seq_lens_cpu: tuple[int, ...], activation: str | None = "silu") -> torch.Tensor:
    """Same contract as `causal_conv1d`, in torch with float32 math."""
    y = torch.empty_like(x)
    nd = num_decodes
    if nd:
        inputs = torch.cat([_windows(conv_pool, slots[:nd], has_state[:nd]), x[:nd, :, None].float()], 2)
        y[:nd] = _activate(_add_bias((inputs * weight.float()).sum(-1), bias), activation)
        conv_pool[slots[:nd]] = inputs[..., 1:].to(conv_pool.dtype)
    starts = list(itertools.accumulate(seq_lens_cpu, initial=0))
    for b in range(nd, len(seq_lens_cpu)):
        s, e = starts[b], starts[b + 1]
        window = _windows(conv_pool, slots[b:b + 1], has_state[b:b + 1])[0]
        inputs = torch.cat([window, x[s:e].T.float()], 1)  # [D, W-1+T]
        out = F.conv1d(inputs[None], weight.float()[:, None], None, groups=x.shape[1])[0].T
        y[s:e] = _activate(_add_bias(out, bias), activation)
        conv_pool[slots[b]] = inputs[:, inputs.shape[1] - window.shape[1]:].to(conv_pool.dtype)
    return y


def _windows(conv_pool: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
    return torch.where(has_state[:, None, None], conv_pool[slots].float(), 0.0)


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias.float()


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(y) if activation == "silu" else y


# ----------------------------------------------------------------------------- GPU: Triton

def conv1d_decode_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_pool: torch.Tensor,
                         slots: torch.Tensor, has_state: torch.Tensor, activation: str | None, *,
                         out: torch.Tensor) -> None:
    """One token per sequence; the window conv_pool[slots[b]] shifts by one in place."""
    batch, dim = x.shape
    width = weight.shape[1]
    block_d = 256
    _conv_decode_kernel[(batch, -(-dim // block_d))](
        x, weight, bias, out, conv_pool, slots, has_state, x.stride(0), out.stride(0),
        D=dim, W=width, BD=block_d, BW=next_power_of_2(width), HAS_BIAS=bias is not None,
        SILU=activation == "silu")


def conv1d_varlen_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_pool: torch.Tensor,
                         slots: torch.Tensor, has_state: torch.Tensor, cu_seqlens: torch.Tensor,
                         activation: str | None, *, out: torch.Tensor, first_seq: int,
                         seq_lens: tuple[int, ...]) -> None:
    """Sequences first_seq.. (any lengths): outputs first, then the windows (which the outputs read)."""
    dim, width = weight.shape
    block_t, block_d = 16, 128  # larger tiles spill registers (pointer tiles are 64-bit)
    tiles = num_tiles(sum(seq_lens), len(seq_lens), block_t)  # axis 0: no 65535 limit
    _conv_varlen_kernel[(tiles, -(-dim // block_d))](
        x, weight, bias, out, conv_pool, slots, has_state, cu_seqlens, first_seq, len(seq_lens),
        x.stride(0), out.stride(0), D=dim, W=width, BT=block_t, BD=block_d,
        HAS_BIAS=bias is not None, SILU=activation == "silu")
    _conv_window_kernel[(len(seq_lens), -(-dim // 64))](
        x, conv_pool, slots, has_state, cu_seqlens, first_seq, x.stride(0),
        D=dim, W=width, BD=64, BW=next_power_of_2(width))


@triton_kernel
def _conv_decode_kernel(x, w, bias, y, pool, slots, has_state, stride_x, stride_y,
                        D: tl.constexpr, W: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    i_b, i_d = tl.program_id(0), tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    keep = tl.load(has_state + i_b) != 0
    p_window = pool + tl.load(slots + i_b).to(tl.int64) * D * (W - 1)
    acc, b_x = decode_conv_channels(x + i_b * stride_x, w, bias, p_window, o_d, m_d, keep, W, BW, HAS_BIAS, SILU)
    tl.store(y + i_b * stride_y + o_d, acc.to(y.dtype.element_ty), mask=m_d)
    p_shift, shifted, m_shift = decode_shifted_window(p_window, o_d, m_d, b_x, keep, W, BW)
    tl.store(p_shift, shifted, mask=m_shift)


def decode_conv_constants(weight: torch.Tensor) -> dict[str, int]:
    """The width constexprs (W, BW) that `decode_conv_channels` and `decode_shifted_window` take, of weight [D, W]."""
    width = weight.shape[1]
    return {"W": width, "BW": next_power_of_2(width)}


@triton_kernel
def decode_conv_channels(x_row, w, bias, p_window, c, m_c, keep, W: tl.constexpr, BW: tl.constexpr,
                         HAS_BIAS: tl.constexpr, SILU: tl.constexpr = True):
    """conv + bias of channels c for one token, silu'd if SILU (float32, not yet rounded), and the token's
    inputs there; p_window is the sequence's [D, W-1] window, read as zeros unless keep."""
    o_w = tl.arange(0, BW)
    b_x = tl.load(x_row + c, mask=m_c, other=0.0).to(tl.float32)
    inputs = tl.load(p_window + c[:, None] * (W - 1) + o_w[None, :], mask=m_c[:, None] & (o_w[None, :] < W - 1),
                     other=0.0)
    inputs = tl.where(keep, inputs.to(tl.float32), 0.0)
    inputs = tl.where(o_w[None, :] == W - 1, b_x[:, None], inputs)
    b_w = tl.load(w + c[:, None] * W + o_w[None, :], mask=m_c[:, None] & (o_w[None, :] < W), other=0.0)
    acc = tl.sum(inputs * b_w.to(tl.float32), axis=1)
    if HAS_BIAS:
        acc += tl.load(bias + c, mask=m_c, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    return acc, b_x


@triton_kernel
def decode_shifted_window(p_window, c, m_c, b_x, keep, W: tl.constexpr, BW: tl.constexpr):
    """The window of channels c after the token: window[:, j + 1], the token's input last (read again:
    registers cannot shift); returns (pointers, values, mask) to store."""
    o_w = tl.arange(0, BW)
    p = p_window + c[:, None] * (W - 1) + o_w[None, :]
    shifted = tl.load(p + 1, mask=m_c[:, None] & (o_w[None, :] < W - 2), other=0.0)
    shifted = tl.where(keep, shifted.to(tl.float32), 0.0)
    shifted = tl.where(o_w[None, :] == W - 2, b_x[:, None], shifted)
    return p, shifted.to(p_window.dtype.element_ty), m_c[:, None] & (o_w[None, :] < W - 1)


@triton_kernel(do_not_specialize=("first_seq", "num_seqs"))
def _conv_varlen_kernel(x, w, bias, y, pool, slots, has_state, cu_seqlens, first_seq, num_seqs,
                        stride_x, stride_y, D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
                        BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    i_d = tl.program_id(1)
    seq, t0 = tile_start(cu_seqlens, first_seq, num_seqs, tl.program_id(0), BT)
    bos, eos = tl.load(cu_seqlens + seq), tl.load(cu_seqlens + seq + 1)
    slot = tl.load(slots + seq).to(tl.int64)
    keep = tl.load(has_state + seq) != 0
    o_t = t0 + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_t, m_d = o_t < eos, o_d < D
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    for i in tl.static_range(W):  # tap i reads the input W-1-i tokens back
        src = o_t - (W - 1 - i)
        in_seq = src >= bos
        m = m_t[:, None] & m_d[None, :]
        b_x = tl.load(x + src.to(tl.int64)[:, None] * stride_x + o_d[None, :], mask=m & in_seq[:, None], other=0.0)
        col = W - 1 + src - bos  # earlier inputs come from the window
        p_old = pool + slot * D * (W - 1) + o_d[None, :] * (W - 1) + col[:, None]
        b_old = tl.load(p_old, mask=m & (~in_seq[:, None]), other=0.0)
        b_old = tl.where(keep, b_old.to(tl.float32), 0.0)
        b_w = tl.load(w + o_d * W + i, mask=m_d, other=0.0).to(tl.float32)
        acc += (b_x.to(tl.float32) + b_old) * b_w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    p_y = y + o_t.to(tl.int64)[:, None] * stride_y + o_d[None, :]
    tl.store(p_y, acc.to(y.dtype.element_ty), mask=m_t[:, None] & m_d[None, :])


@triton_kernel(do_not_specialize=("first_seq",))
def _conv_window_kernel(x, pool, slots, has_state, cu_seqlens, first_seq, stride_x,
                        D: tl.constexpr, W: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr):
    seq = first_seq + tl.program_id(0)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    o_j = tl.arange(0, BW)
    bos, eos = tl.load(cu_seqlens + seq), tl.load(cu_seqlens + seq + 1)
    slot = tl.load(slots + seq).to(tl.int64)
    keep = tl.load(has_state + seq) != 0
    src = eos - (W - 1) + o_j  # new window column j holds this input
    in_seq = src >= bos
    m = (o_d < D)[:, None] & (o_j < W - 1)[None, :]
    b_x = tl.load(x + src.to(tl.int64)[None, :] * stride_x + o_d[:, None], mask=m & in_seq[None, :], other=0.0)
    p_window = pool + slot * D * (W - 1) + o_d[:, None] * (W - 1)
    col = W - 1 + src - bos  # short sequences keep part of the old window
    b_old = tl.load(p_window + col[None, :], mask=m & (~in_seq[None, :]), other=0.0)
    b_old = tl.where(keep, b_old.to(tl.float32), 0.0)
    tl.store(p_window + o_j[None, :], (b_x.to(tl.float32) + b_old).to(pool.dtype.element_ty), mask=m)
