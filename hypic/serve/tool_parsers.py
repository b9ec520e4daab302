"""The model's tool-call text -> OpenAI tool calls, and the grammar that makes a model write one.

Both formats wrap each call in `<tool_call>` ... `</tool_call>` (vLLM's parser names):
- `hermes` (Qwen3, Hermes): `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`
- `qwen3_coder` (Qwen3.5, Qwen3-Coder): `<tool_call>\n<function=f>\n<parameter=p>\nvalue\n</parameter>\n
  </function>\n</tool_call>`; a value is raw text where the schema says string, else JSON.
Text before the first call is the message content (trailing blanks dropped); a malformed call makes
the whole text content with no calls, as vLLM does. An unclosed last call (the model stopped) counts.
"""
from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, ClassVar

from hypic.serve.protocol import FunctionDefinition, FunctionDelta, ToolCallDelta
from hypic.serve.reasoning import partial_tag

START, END = "<tool_call>", "</tool_call>"
_HERMES_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_HERMES_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_CLOSED_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
_CODER_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_CODER_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.S)
_SEPARATORS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}  # what tojson writes


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


class ToolParser(ABC):
    name: ClassVar[str]

    def __init__(self, tools: list[FunctionDefinition]) -> None:
        self.tools = {tool.name: tool for tool in tools}

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a whole reply."""
        calls = [self.call(inner) for inner, _ in blocks(text)]
        if not calls or None in calls:
            return text, []
        return text[: text.index(START)].rstrip() or None, calls

    @abstractmethod
    def name_of(self, inner: str) -> str | None:
        """The function's name, as soon as a (partial) block shows all of it."""

    @abstractmethod
    def call(self, inner: str) -> ParsedCall | None:
        """The text between the tags -> the call; None when malformed."""

    @abstractmethod
    def arguments_so_far(self, inner: str) -> str:
        """The part of a partial block's arguments text that will not change (a prefix of the call's
        arguments once the block is complete)."""

    @abstractmethod
    def grammar(self, tools: list[FunctionDefinition], parallel: bool) -> str:
        """Lark (llguidance) for one call of one of `tools`, or several calls when parallel."""


class HermesParser(ToolParser):
    name = "hermes"

    def name_of(self, inner: str) -> str | None:
        match = _HERMES_NAME.search(inner)
        return None if match is None else json.loads(f'"{match.group(1)}"')

    def call(self, inner: str) -> ParsedCall | None:
        try:
            value = json.loads(inner)
        except json.JSONDecodeError:
            return None
        arguments = value.get("arguments", value.get("parameters", {})) if isinstance(value, dict) else None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(arguments, dict):
            return None
        raw = _hermes_raw_arguments(inner)  # the model's own text, as streamed, when it is the arguments
        return ParsedCall(value["name"], raw if _loads(raw) == arguments else json.dumps(arguments, ensure_ascii=False))

    def arguments_so_far(self, inner: str) -> str:
        name, arguments = _HERMES_NAME.search(inner), _HERMES_ARGUMENTS.search(inner)
        if name is None or arguments is None or arguments.start() < name.start():
            return ""  # arguments before the name: sent whole once the call is closed
        return _hermes_raw_arguments(inner)

    def grammar(self, tools: list[FunctionDefinition], parallel: bool) -> str:
        one_of = [_named_call_schema(tool) for tool in tools]
        schema = json.dumps({"anyOf": one_of, "x-guidance": _SEPARATORS})
        repeat = ' ("\\n" call)*' if parallel else ""
        return f'start: call{repeat}\ncall: "{_lark(START)}\\n" %json {schema} "\\n{_lark(END)}"\n'


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"

    def name_of(self, inner: str) -> str | None:
        match = re.search(r"<function=([^>\n]+)>", inner)
        return None if match is None else match.group(1)

    def call(self, inner: str) -> ParsedCall | None:
        match = _CODER_FUNCTION.search(inner)
        if match is None:
            return None
        name, body = match.group(1), match.group(2)
        properties = _properties(self.tools.get(name))
        arguments = {key: _coder_value(_strip_newline(raw), properties.get(key, {}))
                     for key, raw in _CODER_PARAMETER.findall(body)}
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))

    def arguments_so_far(self, inner: str) -> str:
        """'{"p": value' for each closed parameter: the same text json.dumps writes for the whole call."""
        match = _CODER_FUNCTION.search(inner)
        if match is None:
            return ""
        properties = _properties(self.tools.get(match.group(1)))
        closed = {key: _coder_value(_strip_newline(raw), properties.get(key, {}))
                  for key, raw in _CLOSED_PARAMETER.findall(match.group(2))}
        return json.dumps(closed, ensure_ascii=False)[:-1] if closed else ""

    def grammar(self, tools: list[FunctionDefinition], parallel: bool) -> str:
        rules = ["start: call" + (' ("\\n" call)*' if parallel else "")]
        rules.append(f'call: "{_lark(START)}\\n" (' + " | ".join(f"fn_{i}" for i in range(len(tools))) + f') "{_lark(END)}"')
        for i, tool in enumerate(tools):
            rules += _coder_function_rules(i, tool)
        return "\n".join(rules) + "\n"


PARSERS: dict[str, type[ToolParser]] = {parser.name: parser for parser in (HermesParser, Qwen3CoderParser)}


def blocks(text: str) -> list[tuple[str, bool]]:
    """(text between the tags, closed) of each call block, in order."""
    found, position = [], text.find(START)
    while position >= 0:
        body = position + len(START)
        end = text.find(END, body)
        if end < 0:
            return found + [(text[body:], False)]
        found.append((text[body:end], True))
        position = text.find(START, end + len(END))
    return found


def _hermes_raw_arguments(inner: str) -> str:
    """The text after '"arguments":' up to the object's closing brace (dropped, with the blanks around it)."""
    match = _HERMES_ARGUMENTS.search(inner)
    text = inner[match.end():].rstrip() if match else ""
    return text[:-1].rstrip() if text.endswith("}") else text


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _named_call_schema(tool: FunctionDefinition) -> dict[str, Any]:
    # arguments without additionalProperties get none: a weak model would otherwise invent keys forever
    arguments = {"type": "object", "additionalProperties": False, **(tool.parameters or {})}
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": tool.name}, "arguments": arguments}}


def _coder_function_rules(i: int, tool: FunctionDefinition) -> list[str]:
    properties, required = _properties(tool), set((tool.parameters or {}).get("required", ()))
    parts = [f"p_{i}_{j}" + ("" if key in required else "?") for j, key in enumerate(properties)]
    rules = [f'fn_{i}: "<function={_lark(tool.name)}>\\n" {" ".join(parts)} "</function>\\n"']
    for j, (key, schema) in enumerate(properties.items()):
        rules.append(f'p_{i}_{j}: "<parameter={_lark(key)}>\\n" {_coder_value_rule(schema)} "</parameter>\\n"')
    return rules


def _coder_value_rule(schema: dict[str, Any]) -> str:
    """Raw text for strings (no '<', so the closing tag is unambiguous), JSON for anything else."""
    if _is_text(schema) and "enum" in schema:
        return "(" + " | ".join(f'"{_lark(value)}"' for value in schema["enum"]) + ') "\\n"'
    if _is_text(schema) and not ({"const", "pattern", "format"} & set(schema)):
        limit = schema.get("maxLength")
        return "/[^<]{0,%d}/" % limit if isinstance(limit, int) else "/[^<]*/"
    return f'%json {json.dumps({**schema, "x-guidance": _SEPARATORS})} "\\n"'


def _is_text(schema: dict[str, Any]) -> bool:
    """The value is written raw: a string, or one of string choices."""
    enum = schema.get("enum")
    return schema.get("type") == "string" or (bool(enum) and all(isinstance(value, str) for value in enum))


def _coder_value(raw: str, schema: dict[str, Any]) -> Any:
    if _is_text(schema):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _properties(tool: FunctionDefinition | None) -> dict[str, dict[str, Any]]:
    return dict(((tool.parameters or {}).get("properties") or {}) if tool else {})


def _strip_newline(raw: str) -> str:
    return raw.removeprefix("\n").removesuffix("\n")


def _lark(text: str) -> str:
    """text as the inside of a Lark string literal."""
    return json.dumps(text)[1:-1]


class ToolCallStream:
    """The same parse, delta by delta: content until the first call (a possible tag held back),
    then for each call a delta with its id and name as soon as the name is complete, then fragments
    of its arguments as they become final, the last when the call is closed (or the reply ended)."""

    def __init__(self, parser: ToolParser, new_id: Callable[[], str], parallel: bool = True) -> None:
        self.parser, self._new_id, self._most = parser, new_id, None if parallel else 1
        self._text, self._content_sent, self._named, self._argued = "", 0, 0, 0
        self._arguments_sent = ""  # of the call being streamed (index self._argued)

    @property
    def called(self) -> bool:
        return self._named > 0

    def push(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        self._text += text
        start = self._text.find(START)
        end = len(self._text) if final and start < 0 else self._content_end(start)
        content, self._content_sent = self._text[self._content_sent:end], max(end, self._content_sent)
        return content, ([] if start < 0 else self._call_deltas(final))

    def _content_end(self, start: int) -> int:
        if start >= 0:
            return len(self._text[:start].rstrip())
        held = partial_tag(self._text, START)
        return len(self._text[: len(self._text) - held].rstrip())

    def _call_deltas(self, final: bool) -> list[ToolCallDelta]:
        deltas = []
        for index, (inner, closed) in enumerate(blocks(self._text)[: self._most]):
            if index == self._named and (name := self.parser.name_of(inner)) is not None:
                deltas.append(ToolCallDelta(index, FunctionDelta(name, ""), self._new_id(), "function"))
                self._named += 1
            if index == self._argued < self._named:
                deltas += self._arguments(index, inner, closed or final)
        return deltas

    def _arguments(self, index: int, inner: str, done: bool) -> list[ToolCallDelta]:
        if done:
            call = self.parser.call(inner)
            text, self._argued = call.arguments if call else "{}", self._argued + 1
        else:  # what may be the start of the closing tag is not arguments
            text = self.parser.arguments_so_far(inner[: len(inner) - partial_tag(inner, END)])
        if not text.startswith(self._arguments_sent) or text == self._arguments_sent:
            self._arguments_sent = "" if done else self._arguments_sent
            return []
        fragment, self._arguments_sent = text[len(self._arguments_sent):], "" if done else text
        return [ToolCallDelta(index, FunctionDelta(arguments=fragment))]
