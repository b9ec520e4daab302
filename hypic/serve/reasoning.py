"""A reasoning model's `<think>` ... `</think>` block -> `reasoning_content`, the rest -> `content`.

`qwen3` (vLLM's name): the reply is reasoning up to `</think>` when it opens with `<think>` or when
the prompt already did (Qwen3.5 and the thinking Qwen3 templates end the prompt with `<think>`);
otherwise (thinking off: the template wrote an empty block into the prompt) it is all content. An
unclosed block (the model ran out of tokens) is all reasoning. Newlines right after the block are
dropped. Streamed and whole replies split the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
PARSERS = ("qwen3",)


@dataclass(frozen=True)
class Split:
    reasoning: str | None
    content: str | None


def opens_in_reasoning(prompt: str) -> bool:
    return prompt.rstrip().endswith(START)


def split_reasoning(text: str, prompt_opened: bool) -> Split:
    """The whole reply split into reasoning and content (None where empty)."""
    if not (prompt_opened or text.lstrip().startswith(START)):
        return Split(None, text or None)
    body = text.lstrip().removeprefix(START) if not prompt_opened else text
    reasoning, closed, content = body.partition(END)
    return Split(reasoning or None, content.lstrip("\n") or None if closed else None)


class ReasoningStream:
    """The same split, delta by delta: text that might still be a tag is held back."""

    def __init__(self, prompt_opened: bool) -> None:
        self._mode = "reasoning" if prompt_opened else "undecided"
        self._held = ""

    def push(self, text: str, final: bool) -> Split:
        self._held += text
        if self._mode == "undecided":
            self._decide(final)
        if self._mode == "reasoning":
            return self._reasoning(final)
        if self._mode == "content_start":
            self._held = self._held.lstrip("\n")
            self._mode = "content" if self._held else "content_start"
        if self._mode == "content":
            return self._flush()
        return Split(None, None)

    def _decide(self, final: bool) -> None:
        stripped = self._held.lstrip()
        if stripped.startswith(START):
            self._held, self._mode = stripped.removeprefix(START), "reasoning"
        elif final or not START.startswith(stripped):
            self._mode = "content"

    def _reasoning(self, final: bool) -> Split:
        before, closed, after = self._held.partition(END)
        if closed:
            self._held, self._mode = after, "content_start"
            tail = self.push("", final)
            return Split(before or None, tail.content)
        keep = 0 if final else partial_tag(before, END)
        reasoning, self._held = before[: len(before) - keep], before[len(before) - keep:]
        return Split(reasoning or None, None)

    def _flush(self) -> Split:
        text, self._held = self._held, ""
        return Split(None, text or None)


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of text that begins tag."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)
