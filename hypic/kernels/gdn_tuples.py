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

Cost per chunk and value head (C = 64, K = V = 128). The factors: L, W, U 2 C^2 (2 K + V), A_c and B_c
2 C K (K + V): 7.3 MFLOP; the product 2 K^2 (K + V): 8.4 MFLOP; 128 KB of float32 factors written and
read back. The [v | 0] pass of FLA's chunk kernel the capture ran before: ~20 MFLOP (its state carry
4 C K (K + V), outputs for all K + V columns) and ~290 KB moved (the gathered [v | 0], per-chunk states
h and corrected values written and read back, outputs written). Per token and head the state work of
either is 4 K^2 = 2 K^3 / C at K = 2 C, so neither wins by length: at L = 1k..16k both grow as L, the
product's chain is L / 64 steps deep, and what the product saves is the pass's outputs and its traffic.

Paths: CUDA with half inputs -> two Triton kernels (dots in tf32: bf16 values are exact in it, and
FLA's chunk kernel rounds its states to bf16); otherwise `gdn_span_tuples_ref` (torch, in the inputs'
promoted dtype, at least float32: float32 means float32, as for the layer's own recurrence).
"""
from __future__ import annotations

import itertools
from typing import Any

import torch

from hypic.kernels.gdn import CHUNK, _rows_contiguous, chunk_wy
from hypic.kernels.host_copy import host_to_device
from hypic.kernels.triton_lazy import next_power_of_2, triton_kernel
from hypic.kernels.varlen import RowSpans, expand_key_heads, step_cache, to_chunks

tl: Any  # triton.language, bound by triton_lazy on first GPU use

COLUMN_BLOCK = 64  # columns of [A_c | B_c] a step of the factor kernel, of [T | S0] a product program
NUM_WARPS = 8  # of both kernels (scripts/kernel_resources.py --tuple-kernels: registers and spills on sm90)
# of the product's loop: each stage buffers a [K, K] transition and a [K, BJ] block of B_c in shared memory
# (96 KB at K = 128), and Triton's default three (256 KB) exceed the 227 KB an H100 / H200 block may have
PRODUCT_STAGES = 2


def gdn_span_tuples(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    spans: RowSpans) -> tuple[torch.Tensor, torch.Tensor]:
    """(T [B, HV, K, K], S0 [B, HV, K, V]) of every span (views of one [B, HV, K, K + V] tensor):
    k [N, H, K]; v [N, HV, V]; g, beta [N, HV] over the flat batch's rows; value head hv reads key
    head hv // (HV // H). float32 (float64 for float64 inputs on the CPU)."""
    if k.device.type == "cuda" and v.dtype in (torch.bfloat16, torch.float16):
        both = gdn_span_tuples_triton(k, v, g, beta, spans)
    else:
        both = gdn_span_tuples_ref(k, v, g, beta, spans)
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
    [T | S0] <- A_c [T | S0] + [0 | B_c]. Step j advances every span by its chunk j, or by the identity map
    (appended as chunk n) once past its last: one index copy for all steps, no host sync on a GPU."""
    heads, key_dim, width = factors.shape[1:]
    identity = torch.eye(key_dim, width, dtype=factors.dtype, device=factors.device).expand(1, heads, -1, -1)
    if not counts:
        return factors.new_empty(0, heads, key_dim, width)
    factors = torch.cat([factors, identity])
    firsts = list(itertools.accumulate(counts, initial=0))
    steps = [firsts[b] + j if j < count else firsts[-1] for j in range(max(counts, default=0))
             for b, count in enumerate(counts)]
    index = host_to_device(steps, torch.long, factors.device).view(-1, len(counts))
    state = identity.expand(len(counts), -1, -1, -1).clone()
    for chunk in (factors.index_select(0, step) for step in index):
        state = chunk[..., :key_dim] @ state
        state[..., key_dim:] += chunk[..., key_dim:]
    return state


# ----------------------------------------------------------------------------- GPU: Triton

def gdn_span_tuples_triton(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           spans: RowSpans) -> torch.Tensor:
    """[T | S0] [B, HV, K, K + V] float32 by the factor kernel and the ordered-product kernel (half inputs)."""
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    (heads, value_heads), (key_dim, value_dim) = (k.shape[1], v.shape[1]), (k.shape[2], v.shape[2])
    g, beta = g.contiguous(), beta.contiguous()  # no copies for the layer's own [N, HV] gates
    table = chunk_table(spans.starts, spans.lens, k.device)
    num_chunks, width = table.shape[1] - len(spans.lens), key_dim + value_dim
    shape = {"H": heads, "HV": value_heads, "K": key_dim, "V": value_dim, "BK": block_dim(key_dim)}
    factors = torch.empty(num_chunks, value_heads, key_dim, width, dtype=torch.float32, device=k.device)
    if num_chunks:
        _chunk_factor_kernel[(num_chunks, value_heads)](
            k, v, g, beta, factors, table[0, :num_chunks], table[1, :num_chunks], k.stride(0), v.stride(0),
            g.stride(0), beta.stride(0), C=CHUNK, BN=COLUMN_BLOCK, **shape, num_warps=NUM_WARPS)
    out = torch.empty(len(spans.lens), value_heads, key_dim, width, dtype=torch.float32, device=k.device)
    if len(spans.lens):
        grid = (-(-width // COLUMN_BLOCK), value_heads, len(spans.lens))  # column blocks of a head side by side
        _ordered_product_kernel[grid](factors, out, table[0, num_chunks:], table[1, num_chunks:], BJ=COLUMN_BLOCK,
                                      **shape, num_warps=NUM_WARPS, num_stages=PRODUCT_STAGES)
    return out


def block_dim(dim: int) -> int:
    return max(16, next_power_of_2(dim))  # tl.dot needs 16 or more along every dim


@step_cache  # every linear layer of a step asks for the same spans
def chunk_table(starts: tuple[int, ...], lens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[2, chunks + spans] int32: each chunk's first flat row and rows (at most C), then each span's
    first chunk and number of chunks. Built on the host, one copy a step."""
    counts = [-(-length // CHUNK) for length in lens]
    rows = [start + i * CHUNK for start, count in zip(starts, counts) for i in range(count)]
    sizes = [min(CHUNK, length - i * CHUNK) for length, count in zip(lens, counts) for i in range(count)]
    firsts = list(itertools.accumulate(counts, initial=0))[:-1]
    return host_to_device([*rows, *firsts, *sizes, *counts], torch.int32, device).view(2, -1)


# the chunk table's rows are views at offsets that change with the step's chunk count
@triton_kernel(do_not_specialize_on_alignment=("chunk_sizes",))
def _chunk_factor_kernel(k, v, g, beta, factors, chunk_rows, chunk_sizes, stride_k, stride_v, stride_g, stride_b,
                         H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                         BK: tl.constexpr, BN: tl.constexpr):
    """[A_c | B_c] of chunk i_c, value head i_hv (rows past the chunk's size read as zero tokens), in four
    blocks of 16 rows: (I + L)^-1 [beta exp(G) k | beta v] by block forward substitution over the
    inverted diagonal blocks, BN columns at a time (so the tiles stay in registers)."""
    tl.static_assert(C == 4 * 16)
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    o_b, o_k = tl.arange(0, 16), tl.arange(0, BK)
    row0, size = tl.load(chunk_rows + i_c).to(tl.int64), tl.load(chunk_sizes + i_c)
    p_k, m_k = k + i_h * K + o_k[None, :], (o_k < K)[None, :]
    k0, g0, b0 = _rows(p_k, m_k, g + i_hv, beta + i_hv, row0, o_b, size, stride_k, stride_g, stride_b)
    k1, g1, b1 = _rows(p_k, m_k, g + i_hv, beta + i_hv, row0, o_b + 16, size, stride_k, stride_g, stride_b)
    k2, g2, b2 = _rows(p_k, m_k, g + i_hv, beta + i_hv, row0, o_b + 32, size, stride_k, stride_g, stride_b)
    k3, g3, b3 = _rows(p_k, m_k, g + i_hv, beta + i_hv, row0, o_b + 48, size, stride_k, stride_g, stride_b)
    c0 = tl.cumsum(g0, axis=0)  # the chunk's cumulative log-decay, block by block
    c1 = tl.cumsum(g1, axis=0) + tl.sum(g0, axis=0)
    c2 = tl.cumsum(g2, axis=0) + tl.sum(g1, axis=0) + tl.sum(g0, axis=0)
    c3 = tl.cumsum(g3, axis=0) + tl.sum(g2, axis=0) + tl.sum(g1, axis=0) + tl.sum(g0, axis=0)
    total = tl.sum(g3, axis=0) + tl.sum(g2, axis=0) + tl.sum(g1, axis=0) + tl.sum(g0, axis=0)
    below = o_b[:, None] > o_b[None, :]
    x0, x1, x2, x3 = _diagonal_inverses(tl.where(below, _coupling(k0, k0, c0, c0, b0), 0.0),
                                        tl.where(below, _coupling(k1, k1, c1, c1, b1), 0.0),
                                        tl.where(below, _coupling(k2, k2, c2, c2, b2), 0.0),
                                        tl.where(below, _coupling(k3, k3, c3, c3, b3), 0.0), o_b)
    l10, l20, l21 = _coupling(k1, k0, c1, c0, b1), _coupling(k2, k0, c2, c0, b2), _coupling(k2, k1, c2, c1, b2)
    l30, l31, l32 = _coupling(k3, k0, c3, c0, b3), _coupling(k3, k1, c3, c1, b3), _coupling(k3, k2, c3, c2, b3)
    d0, d1, d2, d3 = tl.exp(total - c0), tl.exp(total - c1), tl.exp(total - c2), tl.exp(total - c3)  # to the end
    p_out = factors + ((i_c.to(tl.int64) * HV + i_hv) * K + o_k[:, None]) * (K + V)
    for first in range(0, K + V, BN):  # L and the inverses serve every column block
        cols = first + tl.arange(0, BN)
        p_v = v + i_hv * V + (cols - K)[None, :]
        p_kc, m_kc, m_vc = k + i_h * K + cols[None, :], (cols < K)[None, :], ((cols >= K) & (cols < K + V))[None, :]
        y0, y1, y2, y3 = _solve(x0, x1, x2, x3, l10, l20, l21, l30, l31, l32,
                                _rhs(p_kc, m_kc, p_v, m_vc, row0, o_b, size, c0, b0, stride_k, stride_v),
                                _rhs(p_kc, m_kc, p_v, m_vc, row0, o_b + 16, size, c1, b1, stride_k, stride_v),
                                _rhs(p_kc, m_kc, p_v, m_vc, row0, o_b + 32, size, c2, b2, stride_k, stride_v),
                                _rhs(p_kc, m_kc, p_v, m_vc, row0, o_b + 48, size, c3, b3, stride_k, stride_v))
        to_end = _to_end(p_k, m_k, row0, o_b, size, stride_k, d0, d1, d2, d3, y0, y1, y2, y3)
        decay = tl.where(o_k[:, None] == cols[None, :], tl.exp(total), 0.0)  # exp(G_C) I in A_c's columns
        block = tl.where(m_kc, decay - to_end, to_end)  # A_c = exp(G_C) I - k_to_end^T W, B_c = k_to_end^T U
        tl.store(p_out + cols[None, :], block, mask=(o_k < K)[:, None] & (cols < K + V)[None, :])


@triton_kernel
def _rows(p_k, m_k, g, beta, row0, o_t, size, stride_k, stride_g, stride_b):
    """Rows o_t of a chunk: keys [16, BK] in k's dtype (products of half keys are exact in the float32 sums
    of their dot: converted, held through the kernel, they would spill), log gates and betas [16] in
    float32; zeros past its size."""
    m_t = o_t < size
    rows = row0 + o_t
    b_k = tl.load(p_k + rows[:, None] * stride_k, mask=m_t[:, None] & m_k, other=0.0)  # in k's dtype
    b_g = tl.load(g + rows * stride_g, mask=m_t, other=0.0).to(tl.float32)
    return b_k, b_g, tl.load(beta + rows * stride_b, mask=m_t, other=0.0).to(tl.float32)


@triton_kernel
def _rhs(p_k, m_k, p_v, m_v, row0, o_t, size, cum, b_beta, stride_k, stride_v):
    """Rows o_t of the right-hand side [beta exp(G) k | beta v] in this program's columns: [16, BN]."""
    rows, m_t = (row0 + o_t)[:, None], (o_t < size)[:, None]
    from_k = tl.load(p_k + rows * stride_k, mask=m_t & m_k, other=0.0).to(tl.float32)
    from_v = tl.load(p_v + rows * stride_v, mask=m_t & m_v, other=0.0).to(tl.float32)
    return (from_k * tl.exp(cum)[:, None] + from_v) * b_beta[:, None]


@triton_kernel
def _coupling(k_i, k_j, c_i, c_j, beta_i):
    """L's block (rows of block i, columns of block j): beta_t (k_t . k_s) exp(G_t - G_s); the exponent is
    clamped at 0, where a diagonal block is masked anyway."""
    decay = tl.exp(tl.minimum(c_i[:, None] - c_j[None, :], 0.0))
    return tl.dot(k_i, tl.trans(k_j), out_dtype=tl.float32) * decay * beta_i[:, None]


@triton_kernel
def _diagonal_inverses(l0, l1, l2, l3, o_t):
    """(I + L)^-1 of four strictly lower-triangular [16, 16] L by forward substitution, a row at a time
    (row t = e_t - sum_{s < t} L[t, s] row s), the four side by side: one chain of 15 steps."""
    x0 = (o_t[:, None] == o_t[None, :]).to(tl.float32)
    x1, x2, x3 = x0, x0, x0
    for t in range(1, 16):
        at_t = o_t[:, None] == t
        x0 = _substitute(x0, l0, at_t)
        x1 = _substitute(x1, l1, at_t)
        x2 = _substitute(x2, l2, at_t)
        x3 = _substitute(x3, l3, at_t)
    return x0, x1, x2, x3


@triton_kernel
def _substitute(inverse, strict_lower, at_t):
    """Row t of the inverse from the rows above it."""
    l_t = tl.sum(tl.where(at_t, strict_lower, 0.0), axis=0)  # L[t, :]
    return tl.where(at_t, inverse - tl.sum(l_t[:, None] * inverse, axis=0)[None, :], inverse)


@triton_kernel
def _solve(x0, x1, x2, x3, l10, l20, l21, l30, l31, l32, r0, r1, r2, r3):
    """(I + L)^-1 R by blocks of 16 rows: y_i = x_i (r_i - sum_{j < i} L_ij y_j), x_i = (I + L_ii)^-1."""
    y0 = tl.dot(x0, r0, input_precision="tf32")
    y1 = tl.dot(x1, r1 - tl.dot(l10, y0, input_precision="tf32"), input_precision="tf32")
    r2 = r2 - tl.dot(l20, y0, input_precision="tf32") - tl.dot(l21, y1, input_precision="tf32")
    y2 = tl.dot(x2, r2, input_precision="tf32")
    r3 = r3 - tl.dot(l30, y0, input_precision="tf32") - tl.dot(l31, y1, input_precision="tf32")
    y3 = tl.dot(x3, r3 - tl.dot(l32, y2, input_precision="tf32"), input_precision="tf32")
    return y0, y1, y2, y3


@triton_kernel
def _to_end(p_k, m_k, row0, o_b, size, stride_k, d0, d1, d2, d3, y0, y1, y2, y3):
    """sum_i (k_i exp(G_C - G))^T y_i over the chunk's four row blocks, the decay d put on y's rows:
    [BK, BN]. The keys are read again (from cache): held since L, they would spill."""
    acc = tl.dot(tl.trans(_keys(p_k, m_k, row0, o_b, size, stride_k)), y0 * d0[:, None], input_precision="tf32")
    acc = tl.dot(tl.trans(_keys(p_k, m_k, row0, o_b + 16, size, stride_k)), y1 * d1[:, None], acc,
                 input_precision="tf32")
    acc = tl.dot(tl.trans(_keys(p_k, m_k, row0, o_b + 32, size, stride_k)), y2 * d2[:, None], acc,
                 input_precision="tf32")
    return tl.dot(tl.trans(_keys(p_k, m_k, row0, o_b + 48, size, stride_k)), y3 * d3[:, None], acc,
                  input_precision="tf32")


@triton_kernel
def _keys(p_k, m_k, row0, o_t, size, stride_k):
    """Rows o_t of a chunk's keys, [16, BK] float32 (zeros past its size)."""
    mask = (o_t < size)[:, None] & m_k
    return tl.load(p_k + (row0 + o_t)[:, None] * stride_k, mask=mask, other=0.0).to(tl.float32)


@triton_kernel(do_not_specialize_on_alignment=("span_firsts", "span_counts"))
def _ordered_product_kernel(factors, out, span_firsts, span_counts, H: tl.constexpr, HV: tl.constexpr,
                            K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BJ: tl.constexpr):
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
        acc = tl.dot(transition, acc, input_precision="tf32") + tl.load(p_row + cols[None, :], mask=m_state,
                                                                            other=0.0)
    p_out = out + ((i_b.to(tl.int64) * HV + i_hv) * K + o_k[:, None]) * (K + V) + cols[None, :]
    tl.store(p_out, acc, mask=m_k[:, None] & m_cols[None, :])
