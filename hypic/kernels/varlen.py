"""The flat varlen conventions every linear-mixer kernel shares: spans over state slots, and the
operands of a family's recurrence (see `hypic.kernels.linear_families` for their shapes)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateSpans:
    """Varlen spans of a flat batch, span b over state slot slots[b] (the first num_decodes are one
    token each): what a linear kernel (conv, recurrence) takes besides its tensors."""

    slots: torch.Tensor  # [B] int64, state-slab slot of each span
    has_state: torch.Tensor  # [B] bool, False: the span starts from a zero state
    cu_seqlens: torch.Tensor  # [B+1] int32, row offsets of the spans
    num_decodes: int
    seq_lens: tuple[int, ...]  # [B] span lengths (host copy)


@dataclass(frozen=True)
class Operands:
    """A linear mixer's inputs to its family's recurrence S_t = T_t S_{t-1} + u_t, o_t = S_t^T (scale q_t),
    one row per token: q, k [N, H, K]; v [N, HV, V]; g [N, HV] or [N, HV, K] (log gates); beta [N, HV]
    or None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor | None

    def rows(self, index: torch.Tensor) -> Operands:
        """The operands of some tokens (a gather per tensor)."""
        beta = None if self.beta is None else self.beta[index]
        return Operands(self.q[index], self.k[index], self.v[index], self.g[index], beta)
