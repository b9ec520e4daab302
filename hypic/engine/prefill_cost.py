"""What a prefill chunk costs, in tokens at context 0 (the unit of `long_prefill_token_threshold`).

A chunk of n tokens from position p runs the per-token work of the model n times and, in its
full-attention layers, attends to about p + n/2 keys a token, so its time is about
α·n + β·n·(p + n/2). Its cost counts it in tokens at context 0: n·(1 + (p + n/2) / L), with
L = α/β, the context at which a token's attention costs as much as the rest of its forward.
L is measured from the engine's own steps: a least-squares fit of each step's time against its
prefill tokens, their attention work and its decode rows (plus a fixed part), newest steps
weighted most. Until the fit has seen enough steps spread over contexts, L is UNMEASURED_CONTEXT.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

UNMEASURED_CONTEXT = 16384.0
CONTEXT_RANGE = (256.0, float(1 << 24))  # a fit outside it says more about noise than about the model
MIN_STEPS = 8  # steps the fit needs before it replaces the unmeasured L
_SMOOTHING = 0.05  # weight of the newest step in the fit's moments (about the last 20 steps)
_RIDGE = 1e-6  # relative: keeps the normal equations solvable when the steps barely differ


@dataclass(frozen=True)
class StepWork:
    """What one step computed: prefill tokens, their attention work Σ n·(p + n/2), decode rows."""

    tokens: int
    attention: float
    decodes: int


def chunk_attention(start: int, num_tokens: int) -> float:
    """Σ over the chunk's tokens of the keys each attends to, to first order: n·(p + n/2)."""
    return num_tokens * (start + num_tokens / 2)


class PrefillCost:
    def __init__(self, attention_context: float = UNMEASURED_CONTEXT) -> None:
        self.attention_context = attention_context
        self.measured = False
        self._steps = 0
        # exponentially weighted sums of z zᵀ, z = (1, tokens, attention, decodes, seconds)
        self._moments = torch.zeros(5, 5, dtype=torch.float64)

    def cost(self, start: int, num_tokens: int) -> float:
        return num_tokens + chunk_attention(start, num_tokens) / self.attention_context

    def tokens_within(self, start: int, cost: float) -> int:
        """The most tokens from `start` whose cost is at most `cost`: the positive root of
        n²/(2L) + n·(1 + p/L) = cost."""
        if cost <= 0:
            return 0
        b = 1 + start / self.attention_context
        a = 1 / (2 * self.attention_context)
        n = math.floor(2 * cost / (b + math.sqrt(b * b + 4 * a * cost)))  # the stable form of the root
        return n + (self.cost(start, n + 1) <= cost)  # the root's rounding, either way

    def observe(self, work: StepWork, seconds: float) -> None:
        if work.tokens <= 0 or seconds <= 0:
            return
        z = torch.tensor([1.0, work.tokens, work.attention, work.decodes, seconds], dtype=torch.float64)
        self._moments.mul_(1 - _SMOOTHING).add_(torch.outer(z, z), alpha=_SMOOTHING)
        self._steps += 1
        if self._steps >= MIN_STEPS:
            self._refit()

    def _refit(self) -> None:
        """α and β from the normal equations (scaled, with a small ridge); L = α/β within CONTEXT_RANGE."""
        gram, target = self._moments[:4, :4], self._moments[:4, 4]
        scale = gram.diagonal().clamp_min(1e-30).sqrt()
        scaled = gram / torch.outer(scale, scale) + _RIDGE * torch.eye(4, dtype=torch.float64)
        per_token, per_attention = (torch.linalg.solve(scaled, target / scale) / scale)[1:3].tolist()
        if per_token <= 0:
            return  # the steps do not tell the per-token part from the rest yet
        context = per_token / per_attention if per_attention > 0 else CONTEXT_RANGE[1]
        self.attention_context = min(max(context, CONTEXT_RANGE[0]), CONTEXT_RANGE[1])
        self.measured = True
