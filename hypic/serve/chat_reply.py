"""A chat completion's text -> the assistant message: reasoning split off first (--reasoning-parser),
then tool calls parsed from the rest (--tool-call-parser), whole or delta by delta, the same way."""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, replace

from hypic.engine.text.tokenizer import Tokenizer
from hypic.errors import InvalidRequestError
from hypic.serve.http_errors import bad_request
from hypic.serve.protocol import AssistantMessage, ChatDelta, ChatRequest, FunctionCall, ToolCall
from hypic.serve.reasoning import END, ReasoningStream, Split, opens_in_reasoning, split_reasoning
from hypic.serve.state import ServerSettings
from hypic.serve.structured import requested_constraint
from hypic.serve.tool_parsers import ToolCallStream, ToolParser
from hypic.serve.tool_segments import template_qualifies
from hypic.serve.tools import call_constraint, parser_for, parses_calls, tool_parser_name
from hypic.structured_outputs import StructuredOutputs


logger = logging.getLogger(__name__)
_PROBE_TURN = [{"role": "user", "content": "?"}]


@dataclass(frozen=True)
class ReplyFormat:
    reasoning: bool  # a reasoning parser is on
    prompt_opened: bool  # the prompt ends inside a reasoning block
    tools: ToolParser | None  # None: tool calls are not parsed
    parallel: bool = True  # False: only the first call counts (parallel_tool_calls: false)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def whole_reply(text: str, finish_reason: str | None, form: ReplyFormat) -> tuple[AssistantMessage, str | None]:
    split = split_reasoning(text, form.prompt_opened) if form.reasoning else Split(None, text)
    content, calls = split.content, []
    if form.tools is not None and content:
        content, parsed = form.tools.parse(content)
        parsed = parsed if form.parallel else parsed[:1]
        calls = [ToolCall(id=new_call_id(), function=FunctionCall(c.name, c.arguments)) for c in parsed]
    message = AssistantMessage(content if form.reasoning or form.tools else text, reasoning_content=split.reasoning,
                               tool_calls=calls)
    return message, _reason(finish_reason, bool(calls))


class ReplyStream:
    """One choice's deltas; `push` returns the ChatDelta to send (None: nothing yet) and the finish reason."""

    def __init__(self, form: ReplyFormat) -> None:
        self._reasoning = ReasoningStream(form.prompt_opened) if form.reasoning else None
        self._tools = ToolCallStream(form.tools, new_call_id, form.parallel) if form.tools is not None else None

    def push(self, text: str, finish_reason: str | None) -> tuple[ChatDelta | None, str | None]:
        final = finish_reason is not None
        if self._reasoning is None and self._tools is None:
            return ChatDelta(content=text), finish_reason
        split = self._reasoning.push(text, final) if self._reasoning else Split(None, text)
        content, calls = split.content, []
        if self._tools is not None:
            content, calls = self._tools.push(split.content or "", final)
        delta = ChatDelta(content=content or None, reasoning_content=split.reasoning, tool_calls=calls or None)
        empty = delta.content is None and delta.reasoning_content is None and delta.tool_calls is None
        return (None if empty and not final else delta), _reason(finish_reason, bool(self._tools and self._tools.called))


def _reason(finish_reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def agent_settings(tokenizer: Tokenizer, settings: ServerSettings) -> ServerSettings:
    """Installs --chat-template and settles the tool-call parser (from the template when not given)."""
    if settings.chat_template is not None:
        tokenizer.use_chat_template(settings.chat_template)
    segments = settings.tool_segments and template_qualifies(
        lambda tools: tokenizer.apply_chat_template(_PROBE_TURN, tools=tools))
    if settings.tool_segments and not segments:
        logger.warning("--tool-segments: the chat template does not render tools one after another; "
                       "tool definitions stay in one segment")
    return replace(settings, tool_call_parser=tool_parser_name(settings.tool_call_parser, tokenizer),
                   tool_segments=segments)


def reply_format(settings: ServerSettings, body: ChatRequest, prompt: str) -> tuple[ReplyFormat, StructuredOutputs | None]:
    """How to read the reply, and the constraint on it: a required tool call, or response_format
    and the like; with a reasoning parser it starts after the reasoning the prompt opened."""
    reasoning = settings.reasoning_parser is not None
    opened = reasoning and opens_in_reasoning(prompt)
    tools = parser_for(settings.tool_call_parser, body) if parses_calls(body) else None
    constraint = requested_constraint(body)
    call = _call_constraint(body, tools)
    if call is not None and constraint is not None:
        raise bad_request("a required tool call and a structured-output field cannot both be set", "tool_choice")
    constraint = call or constraint
    if constraint is not None and opened:
        constraint = replace(constraint, after=END)
    return ReplyFormat(reasoning, opened, tools, body.parallel_tool_calls), constraint


def _call_constraint(body: ChatRequest, tools: ToolParser | None) -> StructuredOutputs | None:
    try:
        return None if tools is None else call_constraint(body, tools)
    except InvalidRequestError as error:
        raise bad_request(str(error), "tool_choice") from None
