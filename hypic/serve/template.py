"""Chat messages -> the prompt text, through the model's own chat template."""
from __future__ import annotations

import json
from typing import Any

from hypic.engine.text.tokenizer import Tokenizer
from hypic.errors import InvalidRequestError
from hypic.serve.http_errors import bad_request
from hypic.serve.protocol import ChatMessage, ToolCall

_RESERVED = frozenset({"messages", "add_generation_prompt", "tools"})  # set by hypic, never by the client


def render_chat(tokenizer: Tokenizer, messages: list[ChatMessage], template_kwargs: dict[str, Any] | None,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The conversation ready for the assistant's turn. Messages may contain the segment separator."""
    reserved = sorted(_RESERVED & set(template_kwargs or {}))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {reserved[0]!r}", "chat_template_kwargs")
    turns = [_template_message(index, message) for index, message in enumerate(messages)]
    try:
        return tokenizer.apply_chat_template(turns, add_generation_prompt=True, tools=tools, **(template_kwargs or {}))
    except InvalidRequestError as error:
        raise bad_request(str(error), "messages") from None


def message_chars(messages: list[ChatMessage]) -> int:
    """Characters of the messages' text (what the template wraps, so a lower bound of its output)."""
    return sum(len(_text(message.content)) for message in messages)


def _text(content: str | list | None) -> str:
    return "\n".join(part.text for part in content) if isinstance(content, list) else content or ""


def _template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    turn = {"role": "system" if message.role == "developer" else message.role, "content": _text(message.content)}
    extra = {"name": message.name, "tool_call_id": message.tool_call_id, "reasoning_content": message.reasoning_content}
    if message.tool_calls:
        extra["tool_calls"] = [_template_call(index, call) for call in message.tool_calls]
    return turn | {key: value for key, value in extra.items() if value is not None}


def _template_call(index: int, call: ToolCall) -> dict[str, Any]:
    """Arguments as an object, as transformers' templates expect them (OpenAI sends JSON text)."""
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        raise bad_request(f"tool call {call.id!r}: arguments are not JSON", f"messages[{index}].tool_calls") from None
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}
