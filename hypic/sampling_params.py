"""Per-request sampling settings, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field

from hypic.fields import Rule, check_fields, conforms
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
    prompt_logprobs: int | None = None  # the same for each prompt token; the prefill then recomputes everything
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: StructuredOutputs | None = None  # constrained decoding (JSON schema, regex, choice, grammar)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _as_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _as_bias(self.logit_bias))
        check_fields(self, _RULES)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _as_tuple(items: object) -> object:
    """One stop string, a list or None as a tuple; anything else as it is, for check_fields to name."""
    if items is None:
        return ()
    if isinstance(items, str):
        return (items,)
    return tuple(items) if isinstance(items, list) else items


def _as_bias(bias: object) -> object:
    """JSON object keys arrive as strings ("50256"): decimal keys become ids, numbers floats; the
    rest stays as it is, for check_fields to name."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        return bias
    return {_as_id(token): float(value) if conforms(value, float) else value for token, value in bias.items()}


def _as_id(token: object) -> object:
    return int(token) if isinstance(token, str) and token.strip().isdecimal() else token


def _number_in(low: float, high: float) -> Rule:
    return Rule(lambda v: low <= v <= high, f"a number in [{low:g}, {high:g}]")


_TOP_K = Rule(lambda v: v is None or 0 <= v <= 20, "an integer in [0, 20] or None (off)")
_RULES = {
    "n": Rule(lambda v: v >= 1, "an integer >= 1"),
    "max_tokens": Rule(lambda v: v is None or v >= 0, "an integer >= 0 or None (until the context is full)"),
    "temperature": Rule(lambda v: v >= 0.0, "a number >= 0 (0: greedy)"),
    "top_p": Rule(lambda v: 0.0 < v <= 1.0, "a number in (0, 1]"),
    "top_k": Rule(lambda v: v >= -1, "an integer: -1 or 0 (off) or positive"),
    "min_p": _number_in(0.0, 1.0),
    "seed": Rule(lambda v: v is None or -(2**63) <= v < 2**64, "an integer that fits in 64 bits, or None"),
    "stop": Rule(lambda v: all(v), "a string or a list of non-empty strings"),
    "stop_token_ids": Rule(lambda v: all(t >= 0 for t in v), "a list of token ids (integers >= 0)"),
    "presence_penalty": _number_in(-2.0, 2.0),
    "frequency_penalty": _number_in(-2.0, 2.0),
    "repetition_penalty": Rule(lambda v: v > 0.0, "a number > 0"),
    "logit_bias": Rule(lambda v: all(t >= 0 and -100.0 <= b <= 100.0 for t, b in v.items()),
                       "a dict of token id (an integer >= 0) -> bias (a number in [-100, 100])"),
    "logprobs": _TOP_K,
    "prompt_logprobs": _TOP_K,
}
