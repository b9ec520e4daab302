"""Reading a request body into its Struct, and the checks every generation endpoint shares."""
from __future__ import annotations

import asyncio
from typing import TypeVar

import msgspec
from aiohttp import web

from hypic.errors import PromptTooLongError
from hypic.serve.http_errors import ApiError, bad_request, from_body_error
from hypic.serve.limits import RequestLimits, check_json_depth, check_prompt_chars, check_segments, check_sequences
from hypic.serve.memory import LARGE_BODY_BYTES
from hypic.serve.protocol import ChatMessage
from hypic.serve.state import STATE, ServerState
from hypic.serve.template import message_chars

Body = TypeVar("Body", bound=msgspec.Struct)
_CHUNK = 1 << 16


async def read_body(request: web.Request, body_type: type[Body]) -> Body:
    """Small bodies are decoded inline. Large ones are read and decoded one at a time, on the
    large-body thread, off the event loop: a decoded body may take many times its bytes (a list of
    small objects), and bodies decoded together fragment the heap for good."""
    state = request.app[STATE]
    limits = state.settings.limits
    if (request.content_length or LARGE_BODY_BYTES) < LARGE_BODY_BYTES:
        return _decode(await _read_raw(request, limits), body_type, limits.max_json_depth)
    async with state.large_bodies.turn:
        raw = await _read_raw(request, limits)
        if len(raw) < LARGE_BODY_BYTES:
            return _decode(raw, body_type, limits.max_json_depth)
        return await state.large_bodies.decode(_decode, raw, body_type, limits.max_json_depth)


async def _read_raw(request: web.Request, limits: RequestLimits) -> bytes:
    """The body, at most max_body_bytes of it, within body_timeout_s. Read here rather than by
    request.read(), which keeps its copy on the request until the response is sent."""
    if (request.content_length or 0) > limits.max_body_bytes:
        raise _too_large(limits)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.content.iter_chunked(_CHUNK):
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise _too_large(limits)
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s",
                       code="body_timeout", headers={"Connection": "close"}) from None
    return b"".join(chunks)


def _too_large(limits: RequestLimits) -> ApiError:
    return ApiError(413, f"the request body is larger than {limits.max_body_bytes} bytes (the server's "
                         "--max-body-bytes)", code="body_too_large", headers={"Connection": "close"})


def _decode(raw: bytes, body_type: type[Body], max_depth: int) -> Body:
    if not raw:
        raise bad_request("the request body is empty; send a JSON object")
    check_json_depth(raw, max_depth)
    try:
        return msgspec.json.decode(raw, type=body_type)
    except msgspec.MsgspecError as error:
        raise from_body_error(error) from None


def check_model(state: ServerState, requested: str | None) -> None:
    if requested is not None and requested != state.model_name:
        raise ApiError(
            404, f"model {requested!r} is not served here; this server serves {state.model_name!r}",
            "model", "model_not_found",
        )


def check_prompts(state: ServerState, prompts: list[str | list[str] | list[int]], n: int) -> None:
    """What the engine would refuse after tokenizing, refused before: too many sequences or
    segments, more text than the context holds, more token ids than it holds."""
    limits, max_len = state.settings.limits, state.client.info.max_model_len
    check_sequences(len(prompts), n, limits)
    for prompt in prompts:
        if isinstance(prompt, str):
            check_prompt_chars(len(prompt), state.max_prompt_chars, "prompt")
        elif prompt and isinstance(prompt[0], str):  # segments
            check_segments(len(prompt), limits)
            check_prompt_chars(sum(map(len, prompt)), state.max_prompt_chars, "segments")
        elif len(prompt) >= max_len:
            raise ApiError(400, str(PromptTooLongError(len(prompt), max_len)), "prompt", "context_length_exceeded")


def check_messages(state: ServerState, messages: list[ChatMessage]) -> None:
    check_prompt_chars(message_chars(messages), state.max_prompt_chars, "messages")


def check_stream_options(stream: bool, stream_options: object | None) -> None:
    if stream_options is not None and not stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")


def reject_unsupported(fields: list[str]) -> None:
    if fields:
        raise bad_request(f"{fields[0]} is not supported by hypic yet; remove it from the request", fields[0])
