"""Accumulating engine deltas into OpenAI choices and usage."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from hypic.outputs import CompletionDelta, RequestOutput, TokenLogprob
from hypic.serve.protocol import PromptTokensDetails, Usage


@dataclass
class ChoiceBuffer:
    """One choice of a non-streamed response."""

    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, delta: CompletionDelta) -> None:
        self.texts.append(delta.text)
        self.logprobs.extend(delta.logprobs or ())
        self.finish_reason = delta.finish_reason or self.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.texts)


@dataclass
class UsageCounter:
    """Usage of all the engine requests of one HTTP request (DESIGN §7 accounting)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, output: RequestOutput) -> None:
        if output.finished:  # the final output carries the request's totals
            self.prompt_tokens += output.metrics.prompt_tokens
            self.completion_tokens += output.metrics.generated_tokens
            self.cached_tokens += output.metrics.cached_tokens

    def usage(self) -> Usage:
        total = self.prompt_tokens + self.completion_tokens
        details = PromptTokensDetails(cached_tokens=self.cached_tokens)
        return Usage(self.prompt_tokens, self.completion_tokens, total, details)


def choice_index(prompt_index: int, n: int, delta: CompletionDelta) -> int:
    """Choices are numbered prompt by prompt, n per prompt (OpenAI's order for batched prompts)."""
    return prompt_index * n + delta.index


def worth_sending(delta: CompletionDelta) -> bool:
    """A delta may carry no text yet (held back for a stop string or an incomplete character)."""
    return bool(delta.text or delta.finish_reason or delta.logprobs)


async def collect(
    outputs: AsyncIterator[tuple[int, RequestOutput]], n: int, num_prompts: int
) -> tuple[list[ChoiceBuffer], UsageCounter]:
    """Drain the merged outputs of a non-streamed request."""
    choices = [ChoiceBuffer() for _ in range(n * num_prompts)]
    usage = UsageCounter()
    async for prompt_index, output in outputs:
        usage.add(output)
        for delta in output.deltas:
            choices[choice_index(prompt_index, n, delta)].add(delta)
    return choices, usage
