"""POST /v1/completions."""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator

from aiohttp import web
from msgspec.structs import replace

from hypic.outputs import RequestOutput
from hypic.serve.choices import choice_index, collect, worth_sending
from hypic.engine.client import GenerateRequest
from hypic.serve.http_errors import bad_request, engine_errors
from hypic.serve.logprobs import completion_logprobs
from hypic.serve.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from hypic.serve.request_body import check_model, check_prompts, check_stream_options, read_body, reject_unsupported
from hypic.serve.request_group import submitted
from hypic.serve.responses import event, json_response, stream_events
from hypic.serve.sampling import or_default, sampling_params
from hypic.serve.state import STATE
from hypic.serve.structured import requested_constraint

log = logging.getLogger(__name__)
_PARAM_NAMES = {name: name for name in CompletionRequest.__struct_fields__}

Prompt = str | list[str] | list[int] | list[list[int]]


async def create_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_body(request, CompletionRequest)
    check_model(state, body.model)
    _reject_unsupported(body)
    check_stream_options(body.stream, body.stream_options)
    prompts = completion_prompts(body)
    check_prompts(state, prompts, body.n)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    log.debug("%s: %d prompt(s), n=%d, user=%s", request_id, len(prompts), body.n, body.user)
    with engine_errors(_PARAM_NAMES):
        params = sampling_params(body, max_tokens=or_default(body.max_tokens, state.settings), logprobs=body.logprobs,
                                 structured=requested_constraint(body))
        jobs = [
            GenerateRequest(prompt, params, f"{request_id}-{index}", body.cache_salt, body.cache_mode, group=request_id)
            for index, prompt in enumerate(prompts)
        ]
        async with submitted(state.client, jobs, state.metrics) as outputs:
            head = CompletionResponse(request_id, int(time.time()), state.model_name, [])
            if body.stream:
                return await _stream(request, outputs, head, body)
            return await _respond(outputs, head, body, len(prompts))


def completion_prompts(body: CompletionRequest) -> list[Prompt]:
    """One engine prompt per element of a batch; `segments` is one prompt given as segments."""
    if body.segments is not None:
        if body.prompt is not None:
            raise bad_request("send either prompt or segments, not both", "segments")
        return [body.segments]
    prompt = body.prompt
    if prompt is None:
        raise bad_request("prompt is required (or the segments extension field)", "prompt")
    if isinstance(prompt, str) or (prompt and all(isinstance(item, int) for item in prompt)):
        return [prompt]
    if prompt and (all(isinstance(item, str) for item in prompt) or all(isinstance(item, list) for item in prompt)):
        return list(prompt)
    raise bad_request(
        "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists", "prompt"
    )


def _reject_unsupported(body: CompletionRequest) -> None:
    unsupported = ["echo"] if body.echo else []
    unsupported += ["suffix"] if body.suffix else []
    unsupported += ["best_of"] if body.best_of not in (None, body.n) else []
    reject_unsupported(unsupported)


async def _respond(
    outputs: AsyncIterator[tuple[int, RequestOutput]], head: CompletionResponse, body: CompletionRequest, num_prompts: int
) -> web.Response:
    buffers, usage = await collect(outputs, body.n, num_prompts)
    choices = [
        CompletionChoice(
            index,
            buffer.text,
            completion_logprobs(buffer.logprobs, 0) if body.logprobs is not None else None,
            buffer.finish_reason,
        )
        for index, buffer in enumerate(buffers)
    ]
    return json_response(replace(head, choices=choices, usage=usage.usage()))


async def _stream(
    request: web.Request, outputs: AsyncIterator[tuple[int, RequestOutput]], head: CompletionResponse,
    body: CompletionRequest,
) -> web.StreamResponse:
    offsets: dict[int, int] = {}
    return await stream_events(request, outputs, head, lambda index, output: _chunks(head, index, output, body, offsets),
                               stream_options=body.stream_options, param_names=_PARAM_NAMES)


def _chunks(
    head: CompletionResponse, prompt_index: int, output: RequestOutput, body: CompletionRequest,
    offsets: dict[int, int],
) -> bytes:
    chunks = []
    for delta in filter(worth_sending, output.deltas):
        index = choice_index(prompt_index, body.n, delta)
        offset, tokens = offsets.get(index, 0), delta.logprobs or ()
        offsets[index] = offset + sum(len(item.token) for item in tokens)
        logprobs = completion_logprobs(tokens, offset) if body.logprobs is not None else None
        choice = CompletionChoice(index, delta.text, logprobs, delta.finish_reason)
        chunks.append(event(replace(head, choices=[choice])))
    return b"".join(chunks)
