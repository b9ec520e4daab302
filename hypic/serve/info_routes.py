"""GET /v1/models, /v1/models/{model}, /health, /metrics, /version and POST /tokenize, /detokenize."""
from __future__ import annotations

import asyncio
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from hypic import __version__
from hypic.errors import InvalidRequestError
from hypic.serve.http_errors import ApiError, bad_request
from hypic.serve.protocol import (DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList, TokenizeRequest,
                                  TokenizeResponse, VersionResponse)
from hypic.serve.request_body import check_messages, check_model, check_prompts, read_body
from hypic.serve.responses import json_response
from hypic.serve.state import STATE, ServerState
from hypic.serve.template import render_chat

_STARTED = int(time.time())


async def list_models(request: web.Request) -> web.Response:
    return json_response(ModelList([_card(request.app[STATE])]))


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    check_model(state, request.match_info["model"])
    return json_response(_card(state))


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.draining or not state.client.accepting:
        raise ApiError(503, "the server is shutting down or its engine has stopped", code="unavailable")
    return json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request, TokenizeRequest)
    check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send exactly one of prompt and messages", "prompt")
    try:
        tokens = await _tokens(state, body)
    except InvalidRequestError as error:
        raise bad_request(str(error), "prompt" if body.prompt is not None else "messages") from None
    return json_response(TokenizeResponse(tokens, len(tokens), state.client.info.max_model_len))


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request, DetokenizeRequest)
    check_model(state, body.model)
    vocab = state.client.tokenizer.vocab_size
    bad = [token for token in body.tokens if not 0 <= token < vocab]
    if bad:
        raise bad_request(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
    return json_response(DetokenizeResponse(state.client.tokenizer.decode(body.tokens, skip_special_tokens=False)))


async def version(request: web.Request) -> web.Response:
    return json_response(VersionResponse(__version__))


async def _tokens(state: ServerState, body: TokenizeRequest) -> list[int]:
    """Refused at once if the text cannot fit the context; tokenized in a worker thread."""
    if body.prompt is not None:
        check_prompts(state, [body.prompt], 1)
        return await asyncio.to_thread(state.client.tokenize, body.prompt)
    check_messages(state, body.messages)
    text = render_chat(state.client.tokenizer, body.messages, None)
    return await asyncio.to_thread(state.client.tokenize, text, add_special_tokens=False)


def _card(state: ServerState) -> ModelCard:
    return ModelCard(id=state.model_name, created=_STARTED, max_model_len=state.client.info.max_model_len)
