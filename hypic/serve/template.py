"""Chat messages -> the prompt text, through the model's own chat template."""
from __future__ import annotations

from typing import Any

from hypic.engine.text.tokenizer import Tokenizer
from hypic.errors import InvalidRequestError
from hypic.serve.http_errors import bad_request
from hypic.serve.protocol import ChatMessage

_RESERVED = frozenset({"messages", "add_generation_prompt", "tools"})  # set by hypic, never by the client


def render_chat(tokenizer: Tokenizer, messages: list[ChatMessage], template_kwargs: dict[str, Any] | None) -> str:
    """The conversation ready for the assistant's turn. Messages may contain the segment separator."""
    reserved = sorted(_RESERVED & set(template_kwargs or {}))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {reserved[0]!r}", "chat_template_kwargs")
    turns = [_template_message(index, message) for index, message in enumerate(messages)]
    try:
        return tokenizer.apply_chat_template(turns, add_generation_prompt=True, **(template_kwargs or {}))
    except InvalidRequestError as error:
        raise bad_request(str(error), "messages") from None


def message_chars(messages: list[ChatMessage]) -> int:
    """Characters of the messages' text (what the template wraps, so a lower bound of its output)."""
    return sum(len(_text(message.content)) for message in messages)


def _text(content: str | list | None) -> str:
    return "\n".join(part.text for part in content) if isinstance(content, list) else content or ""


def _template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    for name in ("tool_calls", "tool_call_id"):
        if getattr(message, name) not in (None, []):
            raise bad_request(f"{name} is not supported by hypic yet", f"messages[{index}].{name}")
    turn = {"role": "system" if message.role == "developer" else message.role, "content": _text(message.content)}
    return turn | ({"name": message.name} if message.name is not None else {})
