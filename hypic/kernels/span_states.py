"""A log-gate family's tuple in closed form: T and the end state S0 of each span of a flat batch from zero.

For T_t = exp(g_t) I (scalar) or Diag(exp(g_t)) (diagonal, g per key channel) the recurrence
S_t = T_t S_{t-1} + k_t v_t^T unrolls to

    T = sum_t g_t (stored in log form),   S0 = sum_t exp(G_end - G_t) k_t v_t^T,

G the inclusive cumulative log gate of the span. Every weight exp(G_end - G_t) is at most 1 (g <= 0), so
no chunking is needed for stability: per span it is one weighted GEMM per head. A scalar gate weighs v,
and the GEMM runs per key head over the value heads of its group ([K, n] @ [n, G V]: keys are never
expanded); a per-key gate weighs the keys expanded to the value heads ([K, n] @ [n, V] per value head).
Same code on CPU and GPU.

A span's rows are read in place (`RowSpans`: each span's rows are consecutive in the flat batch, so k
and v are sliced, never gathered); only the gates are gathered. Per span: the weighted operand is
written once in the GEMM's input dtype, one GEMM, one copy into S0.

Precision and cost: the cumulative gates run in float64 (a long span reaches G ~ -1e4; float32
cumulative sums leave 5e-5 to 2e-4 relative error in the tests' fast-decay S0, float64 ones <= 4e-7).
Float32 inputs stay float32 throughout. Half-precision inputs on a GPU go through the tensor cores:
the weighted operand is rounded to the input dtype (as the chunk kernels round their decayed keys)
and the GEMM accumulates and returns float32. In float32 on the H200 the GEMMs ran at 4 TFLOP/s,
2.6x slower than the chunk kernel they replace (`scripts/bench_kernels.py --shape nemotron3_nano`).
"""
from __future__ import annotations

import math

import torch

from hypic.kernels.varlen import RowSpans, expand_key_heads

ROW_BLOCK_ELEMENTS = 1 << 26  # elements of the larger weighted operand per piece of a span (256 MB in float32)
# Weights below 2^-64 are dropped: far below float32's resolution next to the span's last token (weight 1),
# and as float32 subnormals they would slow CPU GEMMs down some 30x.
NEGLIGIBLE_LOG_DECAY = -64 * math.log(2)


def span_tuples(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                spans: RowSpans) -> tuple[torch.Tensor, torch.Tensor]:
    """(T [B, HV(, K)], S0 [B, HV, K, V]), float32, of every span: k [N, H, K], v [N, HV, V], g [N, HV] or
    [N, HV, K] (log gates) over the flat batch's rows; value head hv reads key head hv // (HV // H)."""
    heads, key_dim, value_dim = v.shape[1], k.shape[-1], v.shape[-1]
    cum = _cumulative_gates(g, spans)
    T = (cum.index_select(-1, spans.cu_seqlens[1:]) - cum.index_select(-1, spans.cu_seqlens[:-1])).movedim(-1, 0)
    decay = _decay_to_span_end(cum, spans)
    S0 = torch.empty(len(spans.lens), heads, key_dim, value_dim, dtype=torch.float32, device=v.device)
    tensor_cores = v.is_cuda and v.dtype in (torch.bfloat16, torch.float16)
    dtype = v.dtype if tensor_cores else torch.float32
    block = max(1, ROW_BLOCK_ELEMENTS // (heads * max(key_dim, value_dim)))
    weighted = torch.empty(min(block, max(spans.lens, default=0)), heads, key_dim if g.dim() == 3 else value_dim,
                           dtype=dtype, device=v.device)
    at = 0
    for b, (start, length) in enumerate(zip(spans.starts, spans.lens)):
        _store(S0[b], _span_state(k, v, decay, weighted, start, at, length, tensor_cores))
        at += length
    return T.to(torch.float32, memory_format=torch.contiguous_format), S0


def _span_state(k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, weighted: torch.Tensor, start: int,
                at: int, length: int, tensor_cores: bool) -> torch.Tensor | None:
    """One span's state ([lanes, K, G V] float32; None if empty): rows [start, start + length) of k and
    v, rows [at, at + length) of decay, in pieces of at most len(weighted) rows."""
    state = None
    for first in range(0, length, max(1, weighted.shape[0])):
        n = min(weighted.shape[0], length - first)
        rows, weights = slice(start + first, start + first + n), decay[at + first: at + first + n]
        part = _gemm(k[rows], v[rows], weights, weighted[:n], tensor_cores)
        state = part if state is None else state.add_(part)
    return state


def _cumulative_gates(g: torch.Tensor, spans: RowSpans) -> torch.Tensor:
    """[HV(, K), R + 1] float64: 0, then the running sum of the spans' gates (`spans.rows`, in order),
    scanned along the innermost dim (CUDA's outer-dim float64 scan took 2.9 ms a layer at 16k rows)."""
    cum = g.new_zeros(*g.shape[1:], spans.rows.numel() + 1, dtype=torch.float64)
    cum[..., 1:] = g[spans.rows].movedim(0, -1)
    return cum.cumsum_(-1)


def _decay_to_span_end(cum: torch.Tensor, spans: RowSpans) -> torch.Tensor:
    """exp(G_end - G_t) [R, HV(, K)] float32 for each of the spans' rows (a strided view)."""
    exponent = cum.index_select(-1, spans.span_ends) - cum[..., 1:]
    exponent.masked_fill_(exponent < NEGLIGIBLE_LOG_DECAY, -math.inf)
    return torch.exp(exponent, out=torch.empty_like(exponent, dtype=torch.float32)).movedim(-1, 0)


def _gemm(k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, weighted: torch.Tensor,
          tensor_cores: bool) -> torch.Tensor:
    """One piece of a span (n consecutive rows): [lanes, K, G V] float32 with the S0 of each lane.
    A per-key decay [n, HV, K] weighs the keys expanded to the value heads; a scalar one [n, HV]
    weighs v, written straight into `weighted` (rounded to its dtype)."""
    if decay.dim() == 3:
        torch.mul(expand_key_heads(k, decay.shape[1]), decay, out=weighted)
        lhs, rhs = weighted, v.to(weighted.dtype)
    else:
        torch.mul(v, decay[..., None], out=weighted)
        lhs, rhs = k.to(weighted.dtype), weighted.reshape(v.shape[0], k.shape[1], -1)
    lhs, rhs = lhs.permute(1, 2, 0), rhs.transpose(0, 1)
    return torch.bmm(lhs, rhs, out_dtype=torch.float32) if tensor_cores else torch.bmm(lhs, rhs)


def _store(S0: torch.Tensor, state: torch.Tensor | None) -> None:
    """A span's [lanes, K, G V] state into its S0 [HV, K, V] (value head h G + j is lane h's j-th)."""
    if state is None:  # an empty span
        S0.zero_()
        return
    lanes, key_dim = state.shape[:2]
    S0.view(lanes, -1, key_dim, S0.shape[-1]).copy_(state.view(lanes, key_dim, -1, S0.shape[-1]).transpose(1, 2))
