"""What a prefill chunk costs, in tokens at context 0 (the unit of `long_prefill_token_threshold`).

A chunk of n tokens from position p runs the per-token work of the model n times and, in its
full-attention layers, attends to about p + n/2 keys a token, so its time is about
α·n + β·n·(p + n/2). Its cost counts it in tokens at context 0: n·(1 + (p + n/2) / L), with
L = α/β, the context at which a token's attention costs as much as the rest of its forward.
L is measured from the engine's own steps: a least-squares fit of the last steps' times against
their prefill tokens, attention work, decode rows and the context each prefill chunk starts at
(what a chunk pays whatever its size: on CPU the gather of its context's pages), plus a fixed part,
refitted (twice) without the quarter of them that took longest against it (steps that another
process slowed down). Until the first fit (after REFIT_EVERY steps), L is UNMEASURED_CONTEXT.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

UNMEASURED_CONTEXT = 16384.0
CONTEXT_RANGE = (4096.0, float(1 << 24))  # outside it a fit says more about noise than about a hybrid model
REFIT_EVERY = 16  # steps between fits (a fit costs about a millisecond), and before the first
WINDOW = 256  # the steps a fit looks at: a long prefill's chunks over a span of contexts
TRIM = 0.25  # the fraction of them it drops before the final fit


@dataclass(frozen=True)
class StepWork:
    """What one step computed: prefill tokens, their attention work Σ n·(p + n/2), decode rows, and
    Σ p over its prefill chunks."""

    tokens: int
    attention: float
    decodes: int
    contexts: int = 0


def chunk_attention(start: int, num_tokens: int) -> float:
    """Σ over the chunk's tokens of the keys each attends to, to first order: n·(p + n/2)."""
    return num_tokens * (start + num_tokens / 2)


class PrefillCost:
    def __init__(self, attention_context: float = UNMEASURED_CONTEXT) -> None:
        self.attention_context = attention_context
        self.measured = False
        self._seen = 0
        self._steps: deque[tuple[float, ...]] = deque(maxlen=WINDOW)  # (1, tokens, attention, decodes, contexts, s)

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
        self._steps.append((1.0, work.tokens, work.attention, work.decodes, work.contexts, seconds))
        self._seen += 1
        if self._seen % REFIT_EVERY == 0:
            self._refit()

    def _refit(self) -> None:
        """α and β from the window, trimmed; L = α/β within CONTEXT_RANGE."""
        data = torch.tensor(list(self._steps), dtype=torch.float64, device="cpu")  # gelsd runs on the host
        x, y = data[:, :-1], data[:, -1]
        keep = torch.ones_like(y, dtype=torch.bool)
        for _ in range(2):  # a slowed step drags the first fit: its ranking of the steps is rough
            over = y - x @ _least_squares(x[keep], y[keep])  # nothing makes a step faster than the device
            keep = over <= over.quantile(1 - TRIM)
        per_token, per_attention = _least_squares(x[keep], y[keep])[1:3].tolist()
        if per_token <= 0:
            return  # the steps do not tell the per-token part from the rest yet
        context = per_token / per_attention if per_attention > 0 else CONTEXT_RANGE[1]
        self.attention_context = min(max(context, CONTEXT_RANGE[0]), CONTEXT_RANGE[1])
        self.measured = True


def _least_squares(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Coefficients c minimising |x c - y|, columns scaled alike; the least-norm c where the steps
    cannot tell two columns apart (every step with the same decode rows)."""
    scale = x.abs().amax(0).clamp_min(1e-30)
    return torch.linalg.lstsq(x / scale, y.unsqueeze(1), driver="gelsd").solution.squeeze(1) / scale
