"""Token log-probabilities in OpenAI's two formats (legacy completions, chat)."""
from __future__ import annotations

from collections.abc import Sequence

from hypic.outputs import TokenLogprob
from hypic.serve.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob, TopLogprob

_FLOOR = -9999.0  # JSON has no -inf; OpenAI and vLLM report impossible tokens this way


def completion_logprobs(items: Sequence[TokenLogprob], text_offset: int) -> CompletionLogprobs:
    """`text_offset` is where the first of these tokens starts in the completion's text. An echoed
    prompt's first token has no logprob (null, as OpenAI sends it)."""
    offsets = []
    for item in items:
        offsets.append(text_offset)
        text_offset += len(item.token)
    return CompletionLogprobs(
        tokens=[item.token for item in items],
        token_logprobs=[None if item.logprob is None else _finite(item.logprob) for item in items],
        top_logprobs=[None if item.logprob is None else _top_dict(item) for item in items],
        text_offset=offsets,
    )


def vllm_prompt_logprobs(items: Sequence[TokenLogprob], k: int) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's format: for each prompt token (the first has none) itself and k alternatives, by token id."""
    return [None if item.logprob is None else _vllm_entry(item, k) for item in items]


def _vllm_entry(item: TokenLogprob, k: int) -> dict[str, PromptLogprob]:
    entry = {str(item.token_id): PromptLogprob(_finite(item.logprob), item.rank, item.token)}
    for rank, (token_id, text, logprob) in enumerate(item.top[:k], start=1):
        entry.setdefault(str(token_id), PromptLogprob(_finite(logprob), rank, text))
    return entry


def chat_logprobs(items: Sequence[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(content=[_chat_token(item) for item in items])


def _top_dict(item: TokenLogprob) -> dict[str, float]:
    """The alternatives and the chosen token (OpenAI lists up to k + 1 entries)."""
    top = {text: _finite(logprob) for _, text, logprob in item.top}
    top.setdefault(item.token, _finite(item.logprob))
    return top


def _chat_token(item: TokenLogprob) -> ChatTokenLogprob:
    alternatives = [TopLogprob(text, _finite(logprob), list(text.encode())) for _, text, logprob in item.top]
    return ChatTokenLogprob(item.token, _finite(item.logprob), list(item.token.encode()), alternatives)


def _finite(logprob: float) -> float:
    return max(logprob, _FLOOR)
