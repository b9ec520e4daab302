"""Token stream -> text deltas that never split a character.

A byte-level token may carry part of a UTF-8 character, and some decoders depend on context (a
metaspace tokenizer drops the leading space of whatever it decodes first). So each step decodes
only a short window: ids[prefix:read] was already emitted, ids[read:] is new; the new text is
decode(ids[prefix:]) minus decode(ids[prefix:read]), held back while it ends in U+FFFD (an
incomplete character). The window restarts at every emission, so a step costs a few tokens of
decoding whatever the output length.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from hypic.engine.tokenizer import Tokenizer

_PROMPT_CONTEXT = 5  # prompt tokens decoded before the output, so its first token gets its leading space right
_MAX_PENDING = 8  # a UTF-8 character spans at most 4 tokens: U+FFFD this long after is genuine, emit it
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed output ids with `push`; call `flush` once the sequence ends.

    Concatenated deltas + flush() equal decode(prompt[-5:] + output) minus decode(prompt[-5:]),
    which is decode(output) for byte-level tokenizers. One exception: after more than 8 tokens of
    invalid UTF-8 the held text is let go, and a character that begins just there may then read as
    U+FFFD (the text was garbage already)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._decode = tokenizer.decode
        self._skipped = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._ids = [i for i in prompt_ids[-_PROMPT_CONTEXT:] if i not in self._skipped]
        self._read = len(self._ids)  # invariant: ids[:read] are already emitted (or prompt)
        self._emitted_text = self._decode(self._ids, skip_special_tokens=False)  # decode(ids[:read])

    def push(self, token_ids: Iterable[int]) -> str:
        """The text that became final with these tokens ("" while a character is incomplete)."""
        self._ids.extend(i for i in token_ids if i not in self._skipped)
        pending = len(self._ids) - self._read
        if pending == 0:
            return ""
        text = self._decode(self._ids, skip_special_tokens=False)
        final = len(text) > len(self._emitted_text) and not text.endswith(_REPLACEMENT)
        if not final and pending < _MAX_PENDING:
            return ""  # an incomplete character, or tokens with no text of their own yet
        return self._advance(text)

    def flush(self) -> str:
        """Whatever is still held (an incomplete character reads as U+FFFD); the stream is over."""
        if len(self._ids) == self._read:
            return ""
        return self._advance(self._decode(self._ids, skip_special_tokens=False))

    def _advance(self, text: str) -> str:
        new_text = text[len(self._emitted_text):]
        del self._ids[:self._read]  # the newly emitted ids become the next step's context
        self._read = len(self._ids)
        self._emitted_text = self._decode(self._ids, skip_special_tokens=False)
        return new_text
