"""Gated DeltaNet tuples of spans of a flat batch (cold interiors): T [B, HV, K, K] and S0 [B, HV, K, V].

In the chunked (WY) form of the gated delta rule (`hypic.kernels.gdn.chunk_wy`) a chunk of C = 64
tokens maps its entry state S to A_c S + B_c, with

    A_c = exp(G_C) I - k_to_end^T W   [K, K],   B_c = k_to_end^T U   [K, V],

G the chunk's cumulative log-decay, W = (I + L)^-1 (beta exp(G) k), U = (I + L)^-1 (beta v),
L[t, s] = beta_t (k_t . k_s) exp(G_t - G_s) (s < t) and k_to_end = k exp(G_C - G). A span's tuple is
the ordered product of its chunks' affine maps: [T | S0] = (A_n, B_n) ... (A_1, B_1) applied to [I | 0].
A span's last chunk is padded with zero tokens (k = 0, g = 0, beta = 0), whose map is the identity.

Two steps: every chunk's [A_c | B_c] at once (parallel over chunks and heads), then per span, head
and block of the K + V columns the product in chunk order (sequential over the span's chunks only).
Cost per chunk and value head (C = 64, K = V = 128): the factors 2 C K (K + V) + 2 C^2 (2 K + V)
FLOPs, the product 2 K^2 (K + V): ~14 MFLOP, about a pass of the chunk kernel over the [v | 0]
values that the capture ran before (its state carry 4 C K (K + V) is the product's 2 K^2 (K + V) at
K = 2 C), without that pass's outputs, its per-chunk states h written and read back, and the [v | 0]
gather. The factors are held in float32: 128 KB per chunk and value head.

Paths: CPU -> `gdn_span_tuples_ref` (torch, in the inputs' promoted dtype, at least float32);
CUDA -> two Triton kernels. Their dots run in float32 for float32 inputs and in tf32 for half ones
(bf16 values are exact in tf32; FLA's chunk kernel rounds its states to bf16).
"""
from __future__ import annotations

import functools
import itertools
from typing import Any

import torch

from hypic.kernels.gdn import CHUNK, _rows_contiguous, chunk_wy
from hypic.kernels.host_copy import host_to_device
from hypic.kernels.triton_lazy import next_power_of_2, triton_kernel
from hypic.kernels.varlen import RowSpans, expand_key_heads, to_chunks

tl: Any  # triton.language, bound by triton_lazy on first GPU use

COLUMN_BLOCK = 64  # columns of [T | S0] per program of the ordered product


def gdn_span_tuples(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    spans: RowSpans) -> tuple[torch.Tensor, torch.Tensor]:
    """(T [B, HV, K, K], S0 [B, HV, K, V]) of every span (views of one [B, HV, K, K + V] tensor):
    k [N, H, K]; v [N, HV, V]; g, beta [N, HV] over the flat batch's rows; value head hv reads key
    head hv // (HV // H). float32 (float64 for float64 inputs on the CPU)."""
    if k.device.type != "cuda":
        both = gdn_span_tuples_ref(k, v, g, beta, spans)
    else:
        both = gdn_span_tuples_triton(k, v, g, beta, spans)
    return both[..., :k.shape[-1]], both[..., k.shape[-1]:]


# ----------------------------------------------------------------------------- torch reference

def gdn_span_tuples_ref(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        spans: RowSpans) -> torch.Tensor:
    """[T | S0] [B, HV, K, K + V] of every span, in torch."""
    dtype = torch.promote_types(k.dtype, torch.float32)
    counts = [-(-length // CHUNK) for length in spans.lens]
    factors = chunk_factors_ref(*(_span_chunks(x.to(dtype), spans, v.shape[1]) for x in (k, v, g, beta)))
    return ordered_product_ref(factors, counts)


def _span_chunks(x: torch.Tensor, spans: RowSpans, heads: int) -> torch.Tensor:
    """[N, H or HV, ...] rows -> [HV, chunks, C, ...]: each span's rows (slices) in zero-padded chunks."""
    x = expand_key_heads(x, heads) if x.shape[1] != heads else x
    parts = [to_chunks(x[start:start + length], length, CHUNK)
             for start, length in zip(spans.starts, spans.lens) if length]
    return torch.cat(parts, 1) if parts else x.new_zeros(heads, 0, CHUNK, *x.shape[2:])


def chunk_factors_ref(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """[A_c | B_c] [chunks, HV, K, K + V] of chunks k [HV, n, C, K], v [HV, n, C, V], g, beta [HV, n, C]."""
    cum, _, w, u, k_to_end = chunk_wy(k, v, g, beta)
    eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    transition = cum[..., -1, None, None].exp() * eye - k_to_end.transpose(-1, -2) @ w
    return torch.cat([transition, k_to_end.transpose(-1, -2) @ u], -1).transpose(0, 1)


def ordered_product_ref(factors: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[I | 0] through each span's chunks in order (span b owns the next counts[b] chunks of `factors`):
    [T | S0] <- A_c [T | S0] + [0 | B_c]; step j advances every span with more than j chunks."""
    heads, key_dim, width = factors.shape[1:]
    eye = torch.eye(key_dim, width, dtype=factors.dtype, device=factors.device)
    state = eye.expand(len(counts), heads, key_dim, width).clone()
    firsts = list(itertools.accumulate(counts, initial=0))
    for j in range(max(counts, default=0)):
        live = [b for b, count in enumerate(counts) if count > j]
        chunk = factors[[firsts[b] + j for b in live]]
        advanced = chunk[..., :key_dim] @ state[live]
        advanced[..., key_dim:] += chunk[..., key_dim:]
        state[live] = advanced
    return state


# ----------------------------------------------------------------------------- GPU: Triton

def gdn_span_tuples_triton(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           spans: RowSpans) -> torch.Tensor:
    """[T | S0] [B, HV, K, K + V] float32 by the factor kernel and the ordered-product kernel."""
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    (heads, value_heads), (key_dim, value_dim) = (k.shape[1], v.shape[1]), (k.shape[2], v.shape[2])
    g, beta = g.contiguous(), beta.contiguous()  # no copies for the layer's own [N, HV] gates
    table = chunk_table(spans.starts, spans.lens, k.device)
    num_chunks, width = table.shape[1] - len(spans.lens), key_dim + value_dim
    shape = {"H": heads, "HV": value_heads, "K": key_dim, "V": value_dim, "BK": _block(key_dim),
             "PRECISION": "ieee" if v.dtype == torch.float32 else "tf32"}
    factors = torch.empty(num_chunks, value_heads, key_dim, width, dtype=torch.float32, device=k.device)
    if num_chunks:
        _chunk_factor_kernel[(num_chunks, value_heads)](
            k, v, g, beta, factors, table[0, :num_chunks], table[1, :num_chunks], k.stride(0), v.stride(0),
            g.stride(0), beta.stride(0), C=CHUNK, BV=_block(value_dim), **shape, num_warps=8)
    out = torch.empty(len(spans.lens), value_heads, key_dim, width, dtype=torch.float32, device=k.device)
    if len(spans.lens):
        grid = (-(-width // COLUMN_BLOCK), value_heads, len(spans.lens))  # column blocks of a head side by side
        _ordered_product_kernel[grid](factors, out, table[0, num_chunks:], table[1, num_chunks:], BJ=COLUMN_BLOCK,
                                      **shape, num_warps=8)
    return out


def _block(dim: int) -> int:
    return max(16, next_power_of_2(dim))  # tl.dot needs 16 or more along every dim


@functools.lru_cache(maxsize=16)  # every linear layer of a step asks for the same spans
def chunk_table(starts: tuple[int, ...], lens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[2, chunks + spans] int32: each chunk's first flat row and rows (at most C), then each span's
    first chunk and number of chunks. Built on the host, one copy a step."""
    counts = [-(-length // CHUNK) for length in lens]
    rows = [start + i * CHUNK for start, count in zip(starts, counts) for i in range(count)]
    sizes = [min(CHUNK, length - i * CHUNK) for length, count in zip(lens, counts) for i in range(count)]
    firsts = list(itertools.accumulate(counts, initial=0))[:-1]
    return host_to_device([*rows, *firsts, *sizes, *counts], torch.int32, device).view(2, -1)


@triton_kernel
def _chunk_factor_kernel(k, v, g, beta, factors, chunk_rows, chunk_sizes, stride_k, stride_v, stride_g, stride_b,
                         H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):
    """[A_c | B_c] of chunk i_c, value head i_hv (rows past the chunk's size read as zero tokens)."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    o_t, o_k, o_v = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    m_t, m_k, m_v = o_t < tl.load(chunk_sizes + i_c), o_k < K, o_v < V
    rows = tl.load(chunk_rows + i_c).to(tl.int64) + o_t
    b_k = tl.load(k + rows[:, None] * stride_k + i_h * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                  other=0.0).to(tl.float32)
    b_g = tl.load(g + rows * stride_g + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + rows * stride_b + i_hv, mask=m_t, other=0.0).to(tl.float32)
    cum = tl.cumsum(b_g, axis=0)
    total = tl.sum(b_g, axis=0)
    below = o_t[:, None] > o_t[None, :]
    decay = tl.exp(tl.where(below, cum[:, None] - cum[None, :], 0.0))  # <= 1 where kept
    kk = tl.dot(b_k, tl.trans(b_k), input_precision=PRECISION)
    inverse = _unit_lower_inverse(tl.where(below, kk * decay * b_beta[:, None], 0.0), o_t, C)
    w = tl.dot(inverse, b_k * (b_beta * tl.exp(cum))[:, None], input_precision=PRECISION)
    k_to_end = tl.trans(b_k * tl.exp(total - cum)[:, None])  # [BK, C]
    eye = (o_k[:, None] == o_k[None, :]).to(tl.float32)
    transition = tl.exp(total) * eye - tl.dot(k_to_end, w, input_precision=PRECISION)
    p_row = factors + ((i_c.to(tl.int64) * HV + i_hv) * K + o_k[:, None]) * (K + V)
    tl.store(p_row + o_k[None, :], transition, mask=m_k[:, None] & m_k[None, :])
    b_v = tl.load(v + rows[:, None] * stride_v + i_hv * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                  other=0.0).to(tl.float32)
    u = tl.dot(inverse, b_v * b_beta[:, None], input_precision=PRECISION)
    tl.store(p_row + K + o_v[None, :], tl.dot(k_to_end, u, input_precision=PRECISION),
             mask=m_k[:, None] & m_v[None, :])


@triton_kernel
def _unit_lower_inverse(strict_lower, o_t, C: tl.constexpr):
    """(I + L)^-1 of a strictly lower-triangular [C, C] L by forward substitution, a row at a time:
    row t = e_t - sum_{s < t} L[t, s] row s."""
    inverse = (o_t[:, None] == o_t[None, :]).to(tl.float32)
    for t in range(1, C):
        at_t = o_t[:, None] == t
        l_t = tl.sum(tl.where(at_t, strict_lower, 0.0), axis=0)  # L[t, :]
        inverse = tl.where(at_t, inverse - tl.sum(l_t[:, None] * inverse, axis=0)[None, :], inverse)
    return inverse


@triton_kernel
def _ordered_product_kernel(factors, out, span_firsts, span_counts, H: tl.constexpr, HV: tl.constexpr,
                            K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BJ: tl.constexpr,
                            PRECISION: tl.constexpr):
    """Columns [i_j BJ, (i_j + 1) BJ) of span i_b's [T | S0] (value head i_hv): [I | 0] through its chunks."""
    i_j, i_hv, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_k, cols = tl.arange(0, BK), i_j * BJ + tl.arange(0, BJ)
    m_k, m_cols = o_k < K, cols < K + V
    m_state = m_k[:, None] & (cols >= K)[None, :] & m_cols[None, :]
    first = tl.load(span_firsts + i_b).to(tl.int64)
    acc = ((o_k[:, None] == cols[None, :]) & m_k[:, None]).to(tl.float32)
    for i in range(tl.load(span_counts + i_b)):
        p_row = factors + (((first + i) * HV + i_hv) * K + o_k[:, None]) * (K + V)
        transition = tl.load(p_row + o_k[None, :], mask=m_k[:, None] & m_k[None, :], other=0.0)
        acc = tl.dot(transition, acc, input_precision=PRECISION) + tl.load(p_row + cols[None, :], mask=m_state,
                                                                            other=0.0)
    p_out = out + ((i_b.to(tl.int64) * HV + i_hv) * K + o_k[:, None]) * (K + V) + cols[None, :]
    tl.store(p_out, acc, mask=m_k[:, None] & m_cols[None, :])
