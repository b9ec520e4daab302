"""The per-layer operations of PIC on a linear mixer, for any family (DESIGN §2, §3.5):

- `spliced_conv`: the causal conv1d over a chunk with every composed interior's conv tail spliced
  in right where the interior sits, so the seam tokens after it see its last W-1 pre-conv inputs;
- `assembled_recurrence`: the walk (compose S <- T S + S0 at each cached piece, recur the tokens
  between) over the assembling sequences, then the mixer's ordinary chunked path for the rest;
- `segment_tuple`: cold segments' (T, S0) from their interior rows.

They take the family, the mixer's tensors and index tensors built on the host; a CUDA graph
replays them for other pieces (offsets are tensors, never Python lists of views).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from hypic.kernels.compose import CachedPieces, StateCheckpoints, compose_and_recur
from hypic.kernels.conv1d import causal_conv1d
from hypic.kernels.linear_families import LinearFamily
from hypic.kernels.varlen import Operands, RowSpans, StateSpans

Chunked = Callable[[Operands, torch.Tensor, StateSpans], torch.Tensor]  # (operands, ssm_pool, spans) -> o


def spliced_conv(x: torch.Tensor, tails: torch.Tensor, index: torch.Tensor, keep: torch.Tensor,
                 weight: torch.Tensor, bias: torch.Tensor | None, conv_pool: torch.Tensor, spans: StateSpans,
                 saves: StateCheckpoints, save_rows: torch.Tensor, activation: str) -> torch.Tensor:
    """Conv of x [N, C] with the tails [P*(W-1), C] placed by `index` (rows of cat([x, tails]));
    returns the `keep` rows (the real tokens'). Each walking sequence's window before its
    checkpoint token (`save_rows`) goes to its checkpoint slot (or its own slot, unchanged)."""
    spliced = torch.cat([x, tails])[index]
    out = causal_conv1d(spliced, weight, bias, conv_pool, spans.slots, spans.has_state, spans.cu_seqlens,
                        num_decodes=spans.num_decodes, seq_lens_cpu=spans.seq_lens, activation=activation)
    conv_pool[saves.slots] = spliced[save_rows].transpose(1, 2).to(conv_pool.dtype)
    return out[keep]


def assembled_recurrence(x: Operands, ssm_pool: torch.Tensor, *, family: LinearFamily, scale: float,
                         walk: StateSpans, walk_rows: torch.Tensor, walks_every_row: bool, pieces: CachedPieces,
                         t_src: torch.Tensor, s0_src: torch.Tensor, saves: StateCheckpoints,
                         rest: StateSpans, rest_rows: torch.Tensor, chunked: Chunked) -> torch.Tensor:
    """o [N, HV, V]: the walk rows through `compose_and_recur`, then the rest rows (other sequences,
    and the tokens after each walk, which read the composed state from their slot) through `chunked`.
    A walk over every row takes the operands as they are (no gathers, no scatter)."""
    def walk_over(y: Operands) -> torch.Tensor:
        return compose_and_recur(y.q, y.k, y.v, y.g, y.beta, ssm_pool, walk.slots, walk.has_state, walk.cu_seqlens,
                                 pieces, t_src, s0_src, family=family, scale=scale, checkpoints=saves)
    if walks_every_row:
        return walk_over(x)
    o = torch.empty_like(x.v)
    o[walk_rows] = walk_over(x.rows(walk_rows))
    if rest_rows.numel():
        o[rest_rows] = chunked(x.rows(rest_rows), ssm_pool, rest)
    return o


def segment_tuple(family: LinearFamily, x: Operands, spans: RowSpans, identity_T: tuple[bool, ...],
                  priors: list[tuple[torch.Tensor, torch.Tensor] | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """(T [J, HV, *t_shape], S0 [J, HV, K, V]) of the segments whose interior rows in this step are
    `spans`, each composed after its prior (T, S0) of earlier chunks when given:
    T = T2.T1, S0 = T2.S0_1 + S0_2 (exact). A segment marked in `identity_T` stores T = I (naive)."""
    T, S0 = family.spans_tuple(x, spans)
    for j, prior in enumerate(priors):
        if prior is not None:
            S0[j] = family.compose(T[j], S0[j], prior[1])
            T[j] = family.combine_T(T[j], prior[0])
    for j, identity in enumerate(identity_T):
        if identity:
            T[j] = family.identity_T(T.shape[1], x.k.shape[-1], T.dtype, T.device)
    return T, S0
