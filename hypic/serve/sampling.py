"""SamplingParams from an OpenAI request body. SamplingParams and the engine validate the values;
this adds only what JSON can carry but they cannot take (string keys, non-finite floats, huge seeds)."""
from __future__ import annotations

import math

from hypic.sampling_params import SamplingParams
from hypic.serve.http_errors import bad_request
from hypic.serve.protocol import SamplingFields
from hypic.serve.state import ServerSettings
from hypic.structured_outputs import StructuredOutputs

_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_SEED_LIMIT = 1 << 63  # completion i seeds with seed + i: stays inside what torch.Generator takes
_TOKEN_ID_DIGITS = 10  # past any vocabulary (zero padding included); int() fails past 4,300 digits


def sampling_params(body: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                    structured: StructuredOutputs | None = None) -> SamplingParams:
    """Raises ApiError, or InvalidRequestError from SamplingParams."""
    _check_finite(body)
    if body.seed is not None and not -_SEED_LIMIT <= body.seed < _SEED_LIMIT:
        raise bad_request(f"seed must be in [-2**63, 2**63), got {body.seed}", "seed")
    return SamplingParams(
        n=body.n,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        stop=body.stop,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias or {}),
        logprobs=logprobs,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        structured=structured,
    )


def or_default(max_tokens: int | None, settings: ServerSettings) -> int | None:
    """A request without max_tokens (or with null) gets the server's one default."""
    return settings.max_tokens_default if max_tokens is None else max_tokens


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """JSON object keys are strings; OpenAI's are token ids. The engine checks them against the vocabulary."""
    for key in bias:
        digits = key.strip()
        if not digits.isdecimal() or len(digits) > _TOKEN_ID_DIGITS:
            raise bad_request(f"logit_bias keys must be token ids, got {_shown(key)}", "logit_bias")
    return {int(key): value for key, value in bias.items()}


def _shown(key: str) -> str:
    return repr(key) if len(key) <= 40 else f"{key[:20]!r}... ({len(key)} characters)"


def _check_finite(body: SamplingFields) -> None:
    for name in _FLOAT_FIELDS:
        if not math.isfinite(getattr(body, name)):
            raise bad_request(f"{name} must be a finite number", name)
    if not all(math.isfinite(value) for value in (body.logit_bias or {}).values()):
        raise bad_request("logit_bias values must be finite numbers", "logit_bias")
