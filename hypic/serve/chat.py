"""POST /v1/chat/completions: messages rendered by the model's chat template, then generated."""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial

from aiohttp import web
from msgspec.structs import replace

from hypic.outputs import RequestOutput
from hypic.serve.chat_reply import ReplyFormat, ReplyStream, reply_format, whole_reply
from hypic.serve.choices import collect, worth_sending
from hypic.engine.client import GenerateRequest
from hypic.serve.http_errors import bad_request, engine_errors
from hypic.serve.logprobs import chat_logprobs
from hypic.serve.protocol import (
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatDelta,
    ChatRequest,
    ChatResponse,
    unsupported_fields,
)
from hypic.serve.request_body import check_messages, check_model, check_stream_options, read_body, reject_unsupported
from hypic.serve.request_group import submitted
from hypic.serve.responses import event, json_response, stream_events
from hypic.serve.sampling import or_default, sampling_params
from hypic.serve.state import STATE
from hypic.serve.template import render_chat
from hypic.serve.tool_segments import prompt_segments
from hypic.serve.tools import check_tools, template_tools

log = logging.getLogger(__name__)
UNSUPPORTED = ("functions", "function_call")  # OpenAI's deprecated form of tools
_PARAM_NAMES = {name: name for name in ChatRequest.__struct_fields__} | {"logprobs": "top_logprobs", "prompt": "messages"}


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_body(request, ChatRequest)
    check_model(state, body.model)
    reject_unsupported(unsupported_fields(body, UNSUPPORTED))
    check_stream_options(body.stream, body.stream_options)
    check_messages(state, body.messages)
    check_tools(body)
    tools = template_tools(body)
    prompt = render_chat(state.client.tokenizer, body.messages, body.chat_template_kwargs, tools)
    form, constraint = reply_format(state.settings, body, prompt)
    wanted = state.settings.tool_segments if body.tool_segments is None else body.tool_segments
    render = partial(render_chat, state.client.tokenizer, body.messages, body.chat_template_kwargs)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    log.debug("%s: %d message(s), n=%d, user=%s", request_id, len(body.messages), body.n, body.user)
    with engine_errors(_PARAM_NAMES):
        params = sampling_params(body, max_tokens=or_default(_max_tokens(body), state.settings),
                                 logprobs=_logprobs(body), structured=constraint)
        # the template wrote every special token the model expects: the engine adds none
        job = GenerateRequest(prompt_segments(wanted, render, tools, prompt), params, request_id, body.cache_salt, body.cache_mode, add_special_tokens=False)
        async with submitted(state.client, [job], state.metrics) as outputs:
            if body.stream:
                head = ChatChunk(request_id, int(time.time()), state.model_name, [])
                return await _stream(request, outputs, head, body, form)
            return await _respond(outputs, request_id, state.model_name, body, form)


def _max_tokens(body: ChatRequest) -> int | None:
    return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens


def _logprobs(body: ChatRequest) -> int | None:
    if not body.logprobs:
        if body.top_logprobs is not None:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return body.top_logprobs or 0


async def _respond(
    outputs: AsyncIterator[tuple[int, RequestOutput]], request_id: str, model: str, body: ChatRequest,
    form: ReplyFormat,
) -> web.Response:
    buffers, usage = await collect(outputs, body.n, 1)
    replies = [whole_reply(buffer.text, buffer.finish_reason, form) for buffer in buffers]
    choices = [
        ChatChoice(index, message, chat_logprobs(buffer.logprobs) if body.logprobs else None, reason)
        for index, (buffer, (message, reason)) in enumerate(zip(buffers, replies))
    ]
    return json_response(ChatResponse(request_id, int(time.time()), model, choices, usage.usage()))


async def _stream(
    request: web.Request, outputs: AsyncIterator[tuple[int, RequestOutput]], head: ChatChunk, body: ChatRequest,
    form: ReplyFormat,
) -> web.StreamResponse:
    replies = [ReplyStream(form) for _ in range(body.n)]
    roles = [ChatChunkChoice(index, ChatDelta(role="assistant", content=""), None, None) for index in range(body.n)]
    opening = b"".join(event(replace(head, choices=[role])) for role in roles)
    return await stream_events(request, outputs, head, lambda _, output: _chunks(head, output, body, replies),
                               stream_options=body.stream_options, param_names=_PARAM_NAMES, opening=opening)


def _chunks(head: ChatChunk, output: RequestOutput, body: ChatRequest, replies: list[ReplyStream]) -> bytes:
    chunks = []
    for delta in filter(worth_sending, output.deltas):
        logprobs = chat_logprobs(delta.logprobs or ()) if body.logprobs else None
        message, reason = replies[delta.index].push(delta.text, delta.finish_reason)
        if message is None and logprobs is None:
            continue  # held back: it may be the start of a tag
        choice = ChatChunkChoice(delta.index, message or ChatDelta(), logprobs, reason)
        chunks.append(event(replace(head, choices=[choice])))
    return b"".join(chunks)
