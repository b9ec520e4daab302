"""What one request may cost the server, and the checks that refuse the rest before any work.

The nesting check reads the raw body before it is decoded, so every field (typed or `Any`, today's
and those typed later) inherits it. Prompt checks run before tokenization: text longer than the
context can hold in characters, more segments than the engine takes, or more sequences than a
request may queue are refused at once, without tokenizing anything.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

from hypic.config import EngineConfig
from hypic.engine.text.tokenizer import Tokenizer
from hypic.serve.http_errors import ApiError, bad_request

_SPECIAL = re.compile(rb'["\[\]{}]')  # a character class: sre scans for it without per-position overhead
_KEY_END = re.compile(rb"\s*:")
_OPENERS = frozenset(b"[{")
_QUOTE = ord('"')
_AS_SQUARE = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds (docs/limits.md): each refusal is a 4xx naming the field and the limit."""

    max_body_bytes: int = 16 << 20
    max_json_depth: int = 64  # JSON schemas of tools nest ~10-20 deep; msgspec recurses past ~1000
    max_sequences: int = 256  # prompts x n of one request
    max_segments: int = EngineConfig.max_segments  # the engine's --max-segments, checked before tokenizing
    header_timeout_s: float = 10.0  # a connection's request head (or its idle keep-alive) must come within
    body_timeout_s: float = 60.0  # the body, once the head has come
    max_connections: int = 1024


def check_json_depth(raw: bytes, limit: int) -> None:
    """A 400 naming the top-level field when `raw` nests arrays/objects more than `limit` deep."""
    if raw.count(b"[") + raw.count(b"{") <= limit:  # the common case: too few brackets to be that deep
        return
    blanked = raw.replace(b"\\\\", b"__").replace(b'\\"', b"__")  # escapes gone, same length
    if _too_deep(_brackets(blanked), limit):
        field = _deep_field(raw, blanked, limit)
        raise bad_request(f"{field or 'the body'} nests more than {limit} levels deep", field)


def _brackets(blanked: bytes) -> bytes:
    """The brackets outside strings, all as '[' and ']' (C speed: split, join, translate)."""
    outside = b"".join(blanked.split(b'"')[0::2])
    return outside.translate(_AS_SQUARE, _NOT_BRACKETS)


def _too_deep(brackets: bytes, limit: int) -> bool:
    """Each round removes every innermost pair, so a nesting of depth d is gone after d rounds."""
    for _ in range(limit):
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) == len(brackets):
            break
        brackets = shorter
    return b"[]" in brackets or brackets.count(b"[") > limit  # unbalanced opens count as nesting too


def _deep_field(raw: bytes, blanked: bytes, limit: int) -> str | None:
    """The top-level key under which the nesting first passes `limit` (a slower scan, run only then)."""
    depth, field, match = 0, None, _SPECIAL.search(blanked)
    while match is not None:
        position, char = match.start(), blanked[match.start()]
        if char == _QUOTE:
            end = blanked.find(b'"', position + 1)
            if end < 0:
                return field
            if depth == 1 and _KEY_END.match(blanked, end + 1):  # a key of the body itself
                field = _key(raw[position:end + 1])
            position = end
        else:
            depth += 1 if char in _OPENERS else -1
            if depth > limit:
                return field
        match = _SPECIAL.search(blanked, position + 1)
    return field


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """Characters of the longest vocabulary entry: no token covers more of a prompt's text (a
    byte-level entry spells each byte as one character, so it is never shorter than its text)."""
    return max(len(tokenizer.id_to_token(i) or "") for i in range(tokenizer.vocab_size))


def _key(quoted: bytes) -> str:
    try:
        return msgspec.json.decode(quoted, type=str)
    except msgspec.DecodeError:  # a malformed escape: the decoder will refuse the body anyway
        return quoted[1:-1].decode(errors="replace")


def check_prompt_chars(chars: int, max_chars: int, param: str) -> None:
    """Text that the context cannot hold even at the tokenizer's longest token is refused untokenized."""
    if chars > max_chars:
        raise ApiError(400, f"the prompt has {chars} characters, more than the model's context can hold "
                            f"({max_chars}: max_model_len x the longest token); shorten it",
                       param, "context_length_exceeded")


def check_sequences(prompts: int, n: int, limits: RequestLimits) -> None:
    if prompts * n > limits.max_sequences:
        raise bad_request(f"{prompts} prompt(s) x n={n} makes {prompts * n} sequences, more than the "
                          f"{limits.max_sequences} one request may queue; split the batch or lower n", "n")


def check_segments(count: int, limits: RequestLimits) -> None:
    if count > limits.max_segments:
        raise bad_request(f"the prompt has {count} segments, more than max_segments={limits.max_segments}",
                          "segments")
