"""A chat request's tools: checked, handed to the chat template, and turned into a grammar when the
client requires a call (`tool_choice` "required" or a named function)."""
from __future__ import annotations

import json
from collections import Counter
from typing import Any

from hypic.engine.text.tokenizer import Tokenizer
from hypic.errors import InvalidRequestError
from hypic.serve.http_errors import bad_request
from hypic.serve.protocol import ChatRequest, FunctionDefinition, NamedToolChoice
from hypic.serve.tool_parsers import PARSERS, ToolParser
from hypic.structured_outputs import StructuredOutputs

_PROBE_CALL = {"id": "call_0", "type": "function", "function": {"name": "probe", "arguments": {"x": 1}}}
_PROBE = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}]


def check_tools(body: ChatRequest) -> list[FunctionDefinition]:
    """The request's functions; 400 for duplicate names, parameters that are not a JSON Schema of
    an object, or a tool_choice that names no given tool."""
    functions = [tool.function for tool in body.tools or ()]
    duplicate = next((name for name, count in Counter(f.name for f in functions).items() if count > 1), None)
    if duplicate is not None:
        raise bad_request(f"two tools are named {duplicate!r}; tool names must be unique", "tools")
    for index, function in enumerate(functions):
        _check_parameters(index, function)
    choice = body.tool_choice
    if choice not in (None, "none", "auto") and not functions:
        raise bad_request("tool_choice requires a call but the request has no tools", "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {f.name for f in functions}:
        raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among the tools", "tool_choice")
    return functions


def parses_calls(body: ChatRequest) -> bool:
    return bool(body.tools) and body.tool_choice != "none"


def call_constraint(body: ChatRequest, parser: ToolParser) -> StructuredOutputs | None:
    """The grammar of a required call in the parser's own format; None when calls are optional."""
    functions = [tool.function for tool in body.tools or ()]
    if isinstance(body.tool_choice, NamedToolChoice):
        functions = [f for f in functions if f.name == body.tool_choice.function.name]
    elif body.tool_choice != "required":
        return None
    parallel = body.parallel_tool_calls and not isinstance(body.tool_choice, NamedToolChoice)
    return StructuredOutputs("lark", parser.grammar(functions, parallel))


def template_tools(body: ChatRequest) -> list[dict[str, Any]] | None:
    """The tools as transformers hands them to a chat template."""
    if not body.tools:
        return None
    return [{"type": "function", "function": _function_dict(tool.function)} for tool in body.tools]


def tool_parser_name(configured: str | None, tokenizer: Tokenizer) -> str:
    """--tool-call-parser, else what the chat template writes for an assistant's call."""
    if configured is not None:
        return configured
    try:
        probe = tokenizer.apply_chat_template(_PROBE, add_generation_prompt=False)
    except InvalidRequestError:
        return "hermes"
    return "qwen3_coder" if "<function=probe>" in probe else "hermes"


def parser_for(name: str, body: ChatRequest) -> ToolParser:
    return PARSERS[name]([tool.function for tool in body.tools or ()])


def _function_dict(function: FunctionDefinition) -> dict[str, Any]:
    entry = {"name": function.name, "description": function.description, "parameters": function.parameters}
    return {key: value for key, value in entry.items() if value is not None}


def _check_parameters(index: int, function: FunctionDefinition) -> None:
    param = f"tools[{index}].function.parameters"
    schema = function.parameters
    if schema is None:
        return
    if schema.get("type", "object") != "object":
        raise bad_request(f"{function.name}: parameters must be a JSON Schema of type object", param)
    try:
        StructuredOutputs("json", json.dumps(schema), lenient=not function.strict)
    except InvalidRequestError as error:
        raise bad_request(f"{function.name}: {error}", param) from None
