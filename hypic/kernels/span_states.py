"""A log-gate family's S0 in closed form: the end state of each span of a varlen batch from zero.

For T_t = exp(g_t) I (scalar) or Diag(exp(g_t)) (diagonal, g per key channel) the recurrence
S_t = T_t S_{t-1} + k_t v_t^T unrolls to

    S0 = sum_t exp(G_end - G_t) k_t v_t^T,   G the inclusive cumulative log gate of the span,

and every weight exp(G_end - G_t) is at most 1 (g <= 0), so no chunking is needed for stability: per
span it is one weighted GEMM per head. A scalar gate weighs v, and the GEMM runs per key head over
the value heads of its group ([K, n] @ [n, G V]: keys are never expanded); a per-key gate weighs the
keys expanded to the value heads ([K, n] @ [n, V] per value head). Same code on CPU and GPU.

Precision and cost: the cumulative gates run in float64 (a long span reaches G ~ -1e4; float32
cumulative sums leave 5e-5 to 2e-4 relative error in the tests' fast-decay S0, float64 ones <= 4e-7).
Float32 inputs stay float32 throughout. Half-precision inputs on a GPU go through the tensor cores:
the weighted operand is rounded back to the input dtype (as the chunk kernels round their decayed
keys) and the GEMM accumulates and returns float32. In float32 on the H200 the GEMMs ran at 4 TFLOP/s,
2.6x slower than the chunk kernel they replace (`scripts/bench_kernels.py --shape nemotron3_nano`).
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import torch

from hypic.kernels.varlen import expand_key_heads

ROW_BLOCK_ELEMENTS = 1 << 26  # elements of the larger weighted operand per block of rows (256 MB in float32)
# Weights below 2^-64 are dropped: far below float32's resolution next to the span's last token (weight 1),
# and as float32 subnormals they would slow CPU GEMMs down some 30x.
NEGLIGIBLE_LOG_DECAY = -64 * math.log(2)


def span_states(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, cu_seqlens: torch.Tensor,
                seq_lens: tuple[int, ...]) -> torch.Tensor:
    """S0 [B, HV, K, V] float32 of every span: k [N, H, K], v [N, HV, V], g [N, HV] or [N, HV, K] (log
    gates); value head hv reads key head hv // (HV // H); `seq_lens` are the spans' lengths on the host
    (cu_seqlens' differences, cu_seqlens[0] = 0)."""
    heads, key_dim, value_dim = v.shape[1], k.shape[-1], v.shape[-1]
    per_key = g.dim() == 3
    lanes, groups = (heads, 1) if per_key else (k.shape[1], heads // k.shape[1])
    out = torch.zeros(len(seq_lens), lanes, key_dim, groups * value_dim, dtype=torch.float32, device=v.device)
    decay = _decay_to_span_end(g, cu_seqlens)
    tensor_cores = v.is_cuda and v.dtype in (torch.bfloat16, torch.float16)
    for rows, pieces in _row_blocks(seq_lens, max(1, ROW_BLOCK_ELEMENTS // (heads * max(key_dim, value_dim)))):
        a, b = _weighted(k[rows], v[rows], decay[rows], lanes, v.dtype if tensor_cores else torch.float32)
        for span, piece in pieces:
            lhs, rhs = a[piece].permute(1, 2, 0), b[piece].transpose(0, 1)
            out[span] += torch.bmm(lhs, rhs, out_dtype=torch.float32) if tensor_cores else lhs @ rhs
    # [B, H, K, G, V] -> [B, H, G, K, V]: value head h G + j is key head h's j-th
    return out.unflatten(-1, (groups, value_dim)).transpose(2, 3).reshape(len(seq_lens), heads, key_dim, value_dim)


def _decay_to_span_end(g: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """exp(G_end - G_t) per row [N, HV(, K)], float32, G summed in float64 over the row's span."""
    # scanned along the innermost dim: CUDA's outer-dim float64 scan took 2.9 ms a layer at 16k rows
    cum = g.double().movedim(0, -1).contiguous().cumsum(-1).movedim(-1, 0)
    lengths = cu_seqlens.long().diff()
    last_row = torch.repeat_interleave(cu_seqlens[1:].long() - 1, lengths, output_size=g.shape[0])  # no sync
    exponent = cum[last_row] - cum
    return exponent.masked_fill_(exponent < NEGLIGIBLE_LOG_DECAY, -math.inf).exp().float()


def _weighted(k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, lanes: int,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMM operands of some rows in `dtype` (weights applied in float32): a [n, lanes, K] and
    b [n, lanes, G V] with S0 per lane = a^T b. A per-key decay [n, HV, K] weighs the keys; a scalar
    one [n, HV] weighs v."""
    if decay.dim() == 3:
        return (expand_key_heads(k.float(), lanes) * decay).to(dtype), v.to(dtype)
    return k.to(dtype), (v.float() * decay[..., None]).to(dtype).reshape(v.shape[0], lanes, -1)


def _row_blocks(seq_lens: tuple[int, ...], block: int) -> Iterator[tuple[slice, list[tuple[int, slice]]]]:
    """Blocks of at most `block` rows of the flat batch, each with the pieces of the spans in it:
    (span index, its rows within the block). Host arithmetic only."""
    starts = list(itertools.accumulate(seq_lens, initial=0))
    for first in range(0, starts[-1], block):
        last = min(first + block, starts[-1])
        yield slice(first, last), [(b, slice(max(s, first) - first, min(e, last) - first))
                                   for b, (s, e) in enumerate(itertools.pairwise(starts)) if s < last and e > first]
