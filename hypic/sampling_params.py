"""Per-request sampling settings, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field

from hypic.errors import InvalidRequestError
from hypic.structured_outputs import StructuredOutputs


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Defaults: sample at temperature 1 for up to 16 tokens."""

    n: int = 1
    max_tokens: int | None = 16  # None: until the context is full; 0: prefill only (fills caches)
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict, hash=False)
    logprobs: int | None = None  # None: off; k >= 0: the chosen token's logprob and k alternatives
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: StructuredOutputs | None = None  # constrained decoding (JSON schema, regex, choice, grammar)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _as_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _as_bias(self.logit_bias))
        for problem in _problems(self):
            raise InvalidRequestError(problem)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _as_tuple(stop: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _as_bias(bias: dict[int | str, float] | None) -> dict[int, float]:
    """JSON object keys arrive as strings ("50256"): token ids as ints, biases as floats."""
    try:
        return {int(token): float(value) for token, value in (bias or {}).items()}
    except (TypeError, ValueError) as error:
        raise InvalidRequestError(f"logit_bias must map token ids to numbers: {error}") from error


def _problems(p: SamplingParams) -> list[str]:
    checks = [
        (p.n >= 1, f"n must be at least 1, got {p.n}"),
        (p.max_tokens is None or p.max_tokens >= 0, f"max_tokens must be >= 0, got {p.max_tokens}"),
        (p.temperature >= 0.0, f"temperature must be >= 0, got {p.temperature}"),
        (0.0 < p.top_p <= 1.0, f"top_p must be in (0, 1], got {p.top_p}"),
        (p.top_k >= -1, f"top_k must be -1, 0 (off) or positive, got {p.top_k}"),
        (0.0 <= p.min_p <= 1.0, f"min_p must be in [0, 1], got {p.min_p}"),
        (-2.0 <= p.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {p.presence_penalty}"),
        (-2.0 <= p.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}"),
        (p.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {p.repetition_penalty}"),
        (p.logprobs is None or 0 <= p.logprobs <= 20, f"logprobs must be in [0, 20], got {p.logprobs}"),
        (all(s for s in p.stop), "stop strings must not be empty"),
        (all(t >= 0 for t in p.stop_token_ids), "stop_token_ids must be >= 0"),
        (p.seed is None or -(2**63) <= p.seed < 2**64, f"seed must fit in 64 bits, got {p.seed}"),
        (all(-100.0 <= b <= 100.0 for b in p.logit_bias.values()), "logit_bias values must be in [-100, 100]"),
    ]
    return [message for ok, message in checks if not ok]
