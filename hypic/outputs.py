"""What AsyncEngine.generate yields."""
from __future__ import annotations

from dataclasses import dataclass, field

from hypic.errors import HypicError


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float | None  # None only for the first prompt token of prompt_logprobs: nothing predicts it
    top: tuple[tuple[int, str, float], ...] = ()  # (token_id, text, logprob) alternatives, best first
    rank: int | None = None  # prompt logprobs: 1 + how many tokens were likelier


@dataclass(frozen=True)
class CompletionDelta:
    """New output of one of the request's n completions since the last yield."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float  # time.monotonic() at submit
    queue_time: float | None = None  # seconds from arrival to first scheduled
    ttft: float | None = None  # seconds from arrival to first output token
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from any cache (DESIGN §7)
    cached_tokens_by_kind: dict[str, int] = field(default_factory=dict)  # "prefix", "pic" (GPU pool), "pic_host", "pic_disk"
    generated_tokens: int = 0
    token_steps: int = 0  # engine steps that gave the request tokens (its n completions advance together)
    inter_token_latency: float | None = None  # seconds since the previous token step; None: no token or the first
    decode_time: float | None = None  # seconds from the first token to the latest


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    deltas: tuple[CompletionDelta, ...]  # completions that advanced in this step
    finished: bool  # every completion finished
    metrics: RequestMetrics
    # Once, on the first output after the whole prompt is scored (params.prompt_logprobs set): one
    # entry per prompt token
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    # The request failed (finished=True, no deltas): AsyncEngine.generate raises it
    error: HypicError | None = None
