"""The raw-body nesting check against a character-by-character JSON scanner, on generated JSON
(escapes, brackets inside strings, keys, deep values), and the per-request limits' refusals."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypic.serve.http_errors import ApiError
from hypic.serve.limits import RequestLimits, check_json_depth, check_prompt_chars, check_sequences


def reference_depth(text: str, limit: int) -> tuple[int, str | None]:
    """Deepest nesting, and the top-level key under which it first passes `limit`, by walking the characters."""
    depth, deepest, field, in_string, escaped, string, last_string = 0, 0, None, False, False, [], None
    over_field = None
    for char in text:
        if in_string:
            if escaped:  # the keys here escape only '"' and '\\', which stand for themselves
                escaped = False
                string.append(char)
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string, last_string = False, "".join(string)
            else:
                string.append(char)
        elif char == '"':
            in_string, string = True, []
        elif char == ":" and depth == 1:
            field = last_string
        elif char in "[{":
            depth += 1
            if depth > limit and deepest <= limit:
                over_field = field
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest, over_field


_TRICKY = st.text(alphabet='ab[]{}"\\:,', max_size=6)  # what strings may hide: brackets, quotes, escapes
_JSON = st.recursive(
    st.none() | st.integers() | _TRICKY,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TRICKY, inner, max_size=3),
    max_leaves=40,
)


def _deep(value: object, depth: int) -> object:
    for _ in range(depth):
        value = [value] if depth % 2 else {"k": value}
    return value


@settings(max_examples=150, deadline=None)
@given(body=st.dictionaries(_TRICKY, _JSON | st.integers(0, 40).flatmap(lambda d: _JSON.map(lambda v: _deep(v, d))),
                            max_size=4),
       limit=st.integers(1, 30))
def test_depth_check_agrees_with_a_character_scanner(body: dict, limit: int) -> None:
    text = json.dumps(body)
    deepest, field = reference_depth(text, limit)
    if deepest <= limit:
        check_json_depth(text.encode(), limit)
        return
    with pytest.raises(ApiError) as refused:
        check_json_depth(text.encode(), limit)
    assert refused.value.status == 400 and refused.value.param == field


def test_depth_check_refuses_unbalanced_opens() -> None:
    with pytest.raises(ApiError):
        check_json_depth(b'{"tools": ' + b"[" * 100_000, 64)


def test_prompt_and_sequence_limits_name_the_field_and_the_numbers() -> None:
    with pytest.raises(ApiError) as chars:
        check_prompt_chars(1001, 1000, "messages")
    assert (chars.value.param, chars.value.code) == ("messages", "context_length_exceeded")
    assert "1001" in chars.value.message and "1000" in chars.value.message
    check_prompt_chars(1000, 1000, "prompt")
    with pytest.raises(ApiError) as sequences:
        check_sequences(100, 128, RequestLimits(max_sequences=256))
    assert sequences.value.param == "n" and "12800" in sequences.value.message
    check_sequences(2, 128, RequestLimits(max_sequences=256))
