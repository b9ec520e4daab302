"""Tool-call and reasoning parsers on texts as Qwen3 (Hermes calls), Qwen3.5 / Qwen3-Coder (XML calls)
and Qwen3 thinking write them; streamed in arbitrary pieces they must give the whole-text result."""
from __future__ import annotations

import json

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypic.serve.chat_reply import ReplyFormat, ReplyStream, whole_reply
from hypic.serve.protocol import FunctionDefinition
from hypic.serve.reasoning import ReasoningStream, split_reasoning
from hypic.serve.tool_parsers import PARSERS, ToolCallStream

WEATHER = FunctionDefinition(name="get_weather", parameters={
    "type": "object", "required": ["city"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "units": {"enum": ["c", "f"]}}})
SEARCH = FunctionDefinition(name="search", parameters={
    "type": "object", "required": ["query"],
    "properties": {"query": {"type": "string", "maxLength": 30}, "filters": {"type": "array", "items": {"type": "string"}}}})
TOOLS = [WEATHER, SEARCH]

QWEN3_ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
QWEN3_TWO = ('Let me check both.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "search", "arguments": {"query": "ski \\"resorts\\"", "filters": ["cheap"]}}\n</tool_call>')
QWEN3_UNCLOSED = '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n'
QWEN3_MALFORMED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>'
CODER_ONE = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
CODER_TWO = ("Sure.\n<tool_call>\n<function=search>\n<parameter=query>\nbest <b> pizza\n</parameter>\n"
             '<parameter=filters>\n["open now", "cheap"]\n</parameter>\n</function>\n</tool_call>\n'
             "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=units>\nc\n"
             "</parameter>\n</function>\n</tool_call>")
CODER_MALFORMED = "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>"

CASES = [
    ("hermes", QWEN3_ONE, None, [("get_weather", {"city": "Paris", "days": 3})]),
    ("hermes", QWEN3_TWO, "Let me check both.",
     [("get_weather", {"city": "Oslo"}), ("search", {"query": 'ski "resorts"', "filters": ["cheap"]})]),
    ("hermes", QWEN3_UNCLOSED, None, [("search", {"query": "x"})]),
    ("hermes", "No tools needed: 4.", "No tools needed: 4.", []),
    ("qwen3_coder", CODER_ONE, None, [("get_weather", {"city": "San Francisco", "days": 3})]),
    ("qwen3_coder", CODER_TWO, "Sure.",
     [("search", {"query": "best <b> pizza", "filters": ["open now", "cheap"]}),
      ("get_weather", {"city": "42", "units": "c"})]),
]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_recorded_calls_parse(parser, text, content, calls) -> None:
    got_content, got_calls = PARSERS[parser](TOOLS).parse(text)
    assert got_content == content
    assert _calls(got_calls) == calls


@pytest.mark.parametrize(("parser", "text"), [("hermes", QWEN3_MALFORMED), ("qwen3_coder", CODER_MALFORMED)])
def test_a_malformed_call_leaves_the_text_as_content(parser, text) -> None:
    assert PARSERS[parser](TOOLS).parse(text) == (text, [])


def _pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def test_arguments_stream_in_fragments_as_they_become_final() -> None:
    for parser_name, text in (("hermes", QWEN3_ONE), ("qwen3_coder", CODER_ONE)):
        stream = ToolCallStream(PARSERS[parser_name](TOOLS), lambda: "call_x")
        fragments = [d.function.arguments for ch in text for d in stream.push(ch, final=False)[1]
                     if d.function.arguments]
        fragments += [d.function.arguments for d in stream.push("", final=True)[1] if d.function.arguments]
        assert len(fragments) >= 2 and "".join(fragments) == PARSERS[parser_name](TOOLS).parse(text)[1][0].arguments


@settings(max_examples=40, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_streamed_calls_reassemble_to_the_whole_parse(case, cuts) -> None:
    parser_name, text, content, calls = case
    stream = ToolCallStream(PARSERS[parser_name](TOOLS), lambda: "call_x")
    pieces = _pieces(text, cuts)
    contents, deltas = [], []
    for i, piece in enumerate(pieces):
        got_content, got_deltas = stream.push(piece, final=i == len(pieces) - 1)
        contents.append(got_content)
        deltas += got_deltas
    assert "".join(contents) == (content or "")
    names = [d.function.name for d in deltas if d.id is not None]
    arguments = ["".join(d.function.arguments or "" for d in deltas if d.index == i) for i in range(len(names))]
    assert list(zip(names, map(json.loads, arguments))) == calls
    whole = PARSERS[parser_name](TOOLS).parse(text)[1]
    assert [(c.name, c.arguments) for c in whole] == list(zip(names, arguments))  # the very same text
    first_seen = {}
    for d in deltas:
        first_seen.setdefault(d.index, d)
    assert all(d.id is not None and d.function.name for d in first_seen.values())  # id and name come first


THINKING = [
    ("<think>\nThe user wants 2+2.\n</think>\n\n4", False, "\nThe user wants 2+2.\n", "4"),
    ("Short thought.</think>\n\nThe answer", True, "Short thought.", "The answer"),
    ("<think>\nran out of tok", False, "\nran out of tok", None),
    ("still thinking", True, "still thinking", None),
    ("Plain answer, no thinking.", False, None, "Plain answer, no thinking."),
    ("<thin", False, None, "<thin"),
]


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), THINKING)
def test_reasoning_splits_recorded_replies(text, opened, reasoning, content) -> None:
    split = split_reasoning(text, opened)
    assert (split.reasoning, split.content) == (reasoning, content)


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(THINKING), cuts=st.lists(st.integers(0, 10_000), max_size=10))
def test_streamed_reasoning_splits_the_same(case, cuts) -> None:
    text, opened, reasoning, content = case
    stream, pieces = ReasoningStream(opened), _pieces(text, cuts)
    splits = [stream.push(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    assert "".join(s.reasoning or "" for s in splits) == (reasoning or "")
    assert "".join(s.content or "" for s in splits) == (content or "")


@settings(max_examples=30, deadline=None)
@given(cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_reasoning_then_calls_stream_like_the_whole_reply(cuts) -> None:
    text = "I should look it up.</think>\n\n" + QWEN3_TWO
    form = ReplyFormat(reasoning=True, prompt_opened=True, tools=PARSERS["hermes"](TOOLS))
    message, reason = whole_reply(text, "stop", form)
    stream, pieces = ReplyStream(form), _pieces(text, cuts)
    pushed = [stream.push(piece, "stop" if i == len(pieces) - 1 else None) for i, piece in enumerate(pieces)]
    deltas = [d for d, _ in pushed if d is not None]
    assert reason == pushed[-1][1] == "tool_calls"
    assert "".join(d.reasoning_content or "" for d in deltas) == message.reasoning_content == "I should look it up."
    assert "".join(d.content or "" for d in deltas) == message.content == "Let me check both."
    streamed = [c for d in deltas for c in d.tool_calls or () if c.id is not None]
    assert [c.function.name for c in streamed] == [c.function.name for c in message.tool_calls]


def test_without_parallel_calls_only_the_first_counts_whole_and_streamed() -> None:
    form = ReplyFormat(reasoning=False, prompt_opened=False, tools=PARSERS["hermes"](TOOLS), parallel=False)
    message, _ = whole_reply(QWEN3_TWO, "stop", form)
    stream = ReplyStream(form)
    deltas = [stream.push(ch, None)[0] for ch in QWEN3_TWO] + [stream.push("", "stop")[0]]
    streamed = {c.index for d in deltas if d is not None for c in d.tool_calls or ()}
    assert [c.function.name for c in message.tool_calls] == ["get_weather"] and streamed == {0}


@pytest.mark.parametrize(("parser", "text"), [("hermes", QWEN3_TWO.split("\n\n", 1)[1]),
                                              ("qwen3_coder", CODER_ONE + "\n" + CODER_TWO.split("\n", 1)[1].replace("<b> ", ""))])
def test_call_grammar_accepts_what_the_parser_reads(parser, text) -> None:
    """The grammar a required call is decoded with matches the recorded calls of that format."""
    tokenizer = llguidance.LLTokenizer(_byte_tokenizer_json())
    lark = PARSERS[parser](TOOLS).grammar(TOOLS, parallel=True)
    matcher = llguidance.LLMatcher(tokenizer, llguidance.grammar_from("lark", lark))
    tokens = tokenizer.tokenize_str(text)
    assert matcher.try_consume_tokens(tokens) == len(tokens), matcher.get_error()
    assert matcher.is_accepting()


def _byte_tokenizer_json() -> str:
    from hypic.engine.setup import BUNDLED_MODEL
    return (BUNDLED_MODEL / "tokenizer.json").read_text(encoding="utf-8")


def _renderer(template: str):
    from hypic.engine.setup import BUNDLED_MODEL
    from hypic.engine.text.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_dir(BUNDLED_MODEL)
    tokenizer.use_chat_template(template)
    return lambda tools: tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools)


def _tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def test_tools_become_segments_that_join_to_the_whole_prompt() -> None:
    from pathlib import Path

    from hypic.serve.tool_segments import prompt_segments, template_qualifies
    render = _renderer((Path(__file__).parent / "assets" / "hermes_tools.jinja").read_text())
    assert template_qualifies(render)
    tools = [_tool("a"), _tool("bb"), _tool("a_c")]
    segments = prompt_segments(True, render, tools, render(tools))
    assert "".join(segments) == render(tools) and len(segments) == 5
    assert [json.loads(piece)["function"]["name"] for piece in segments[1:-1]] == ["a", "bb", "a_c"]
    reordered = prompt_segments(True, render, tools[::-1], render(tools[::-1]))
    assert reordered[1:-1] == segments[1:-1][::-1] and reordered[0] == segments[0]  # same texts: reusable


def test_a_template_that_does_not_list_tools_one_by_one_falls_back_to_one_segment() -> None:
    from hypic.serve.tool_segments import prompt_segments, template_qualifies
    render = _renderer("{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not template_qualifies(render)
    tools = [_tool("a"), _tool("b")]
    assert prompt_segments(True, render, tools, render(tools)) == render(tools)
