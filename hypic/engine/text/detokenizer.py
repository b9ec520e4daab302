"""Token stream -> text deltas that never split a character.

A byte-level token may carry part of a UTF-8 character, and some decoders depend on context (a
metaspace tokenizer drops the leading space of whatever it decodes first). So each step decodes a
short window of ids that starts with the last completed ones (the context): the new text is what
the window decodes to beyond the context's own text, up to any trailing U+FFFD (a character still
incomplete), which waits for the next tokens. Once the window's text ends on a complete
character, its ids become the next context. A step thus decodes a few tokens whatever the
output length.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from hypic.engine.text.tokenizer import Tokenizer

_PROMPT_CONTEXT = 5  # prompt tokens decoded before the output, so its first token gets its leading space right
_MAX_WINDOW = 32  # ids past the context; a character spans at most 4 tokens, so beyond this it is garbage
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed output ids with `push`; call `flush` once the sequence ends.

    The deltas and flush() concatenate to decode(context + output) minus decode(context), context
    being the prompt's last 5 ids; for byte-level tokenizers that is decode(output). Invalid UTF-8
    (garbage only a broken model emits) may read differently: past 32 tokens without a complete
    character the window restarts, and a byte-fallback decoder turns a whole run of byte tokens
    into U+FFFD once it turns invalid, after its valid start was emitted."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._decode = tokenizer.decode
        self._skipped = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._ids = [i for i in prompt_ids[-_PROMPT_CONTEXT:] if i not in self._skipped]
        self._start_window()

    def push(self, token_ids: Iterable[int]) -> str:
        """The text that became final with these tokens ("" while a character is incomplete)."""
        self._ids.extend(i for i in token_ids if i not in self._skipped)
        if len(self._ids) == self._context:
            return ""
        text = self._decode(self._ids, skip_special_tokens=False)
        complete = not text.endswith(_REPLACEMENT) and len(text) > self._context_chars
        if complete or len(self._ids) - self._context > _MAX_WINDOW:
            return self._take(text, restart=True)
        return self._take(text.rstrip(_REPLACEMENT), restart=False)

    def flush(self) -> str:
        """Whatever is still held (an incomplete character reads as U+FFFD); the stream is over."""
        if len(self._ids) == self._context:
            return ""
        return self._take(self._decode(self._ids, skip_special_tokens=False), restart=True)

    def _take(self, text: str, *, restart: bool) -> str:
        new_text = text[self._emitted_chars:]
        self._emitted_chars = max(self._emitted_chars, len(text))
        if restart:  # the ids past the context become the next context
            del self._ids[:self._context]
            self._start_window()
        return new_text

    def _start_window(self) -> None:
        self._context = len(self._ids)  # invariant: ids[:context] were emitted before (or are prompt)
        self._context_chars = len(self._decode(self._ids, skip_special_tokens=False))
        self._emitted_chars = self._context_chars  # chars of the window's text emitted so far
