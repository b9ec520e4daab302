"""Writing responses: JSON bodies, and server-sent events in OpenAI's framing (`data: <json>` per
chunk, then `data: [DONE]`)."""
from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from aiohttp import web
from msgspec.structs import replace

from hypic.errors import HypicError
from hypic.outputs import RequestOutput
from hypic.serve.choices import UsageCounter
from hypic.serve.http_errors import ApiError, from_engine_error, internal_error
from hypic.serve.protocol import ChatChunk, CompletionResponse, StreamOptions, encoder

log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"


def json_response(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=encoder.encode(payload), status=status, content_type="application/json")


async def start_events(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await response.prepare(request)
    return response


def event(payload: object) -> bytes:
    return b"data: " + encoder.encode(payload) + b"\n\n"


@asynccontextmanager
async def stream_errors(response: web.StreamResponse, param_names: dict[str, str]) -> AsyncIterator[None]:
    """Once a stream has started, an error can only be reported as one more event; `[DONE]` follows."""
    try:
        yield
    except ConnectionError:  # the client is gone: nothing left to tell it
        raise
    except HypicError as error:
        await response.write(from_engine_error(error, param_names).sse_event())
    except ApiError as error:
        await response.write(error.sse_event())
    except Exception:
        error_id = uuid.uuid4().hex
        log.exception("stream %s failed", error_id)
        await response.write(internal_error(error_id).sse_event())


async def stream_events(
    request: web.Request, outputs: AsyncIterator[tuple[int, RequestOutput]], head: ChatChunk | CompletionResponse,
    chunks: Callable[[int, RequestOutput], bytes], *, stream_options: StreamOptions | None,
    param_names: dict[str, str], opening: bytes = b"",
) -> web.StreamResponse:
    """The SSE tail of chat and completions: `opening`, each output's chunks, the usage chunk (a
    copy of `head` with no choices) when asked, then `[DONE]`; an error mid-stream is one more event."""
    response = await start_events(request)
    usage = UsageCounter()
    try:
        await response.write(opening)
        async with stream_errors(response, param_names):
            async for prompt_index, output in outputs:
                usage.add(output)
                await response.write(chunks(prompt_index, output))
            if stream_options and stream_options.include_usage:
                await response.write(event(replace(head, choices=[], usage=usage.usage())))
        await response.write(DONE)
    except ConnectionError:  # the client left; leaving submitted() aborts what is unfinished
        log.debug("%s: client disconnected mid-stream", head.id)
    return response
