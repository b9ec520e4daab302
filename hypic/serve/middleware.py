"""Request middlewares, outermost first: memory, metrics, errors, draining, authentication."""
from __future__ import annotations

import asyncio
import hmac
import math
import logging
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web

from hypic.serve.http_errors import ApiError, from_http_exception, internal_error
from hypic.serve.memory import LARGE_BODY_BYTES
from hypic.serve.state import STATE

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapers never carry the API key
_CLIENT_GONE = "499"  # nginx's code for a client that closed the connection first


@web.middleware
async def give_back_large_bodies(request: web.Request, handler: Handler) -> web.StreamResponse:
    """After a large body, once its handler is done with it, free memory goes back to the system."""
    try:
        return await handler(request)
    finally:
        if request.content.total_bytes >= LARGE_BODY_BYTES:
            await request.app[STATE].large_bodies.give_back_memory()


@web.middleware
async def count_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """hypic_http_requests_total{endpoint, status, model_name}; unknown paths share one label."""
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "unmatched"
    counter = request.app[STATE].metrics.http_requests
    try:
        response = await handler(request)
    except (asyncio.CancelledError, ConnectionError):
        counter.labels(endpoint, _CLIENT_GONE).inc()
        raise
    counter.labels(endpoint, str(response.status)).inc()
    return response


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes an OpenAI-style JSON error; a stack trace goes to the log, never out."""
    try:
        return await handler(request)
    except ApiError as error:
        return error.response()
    except web.HTTPException as error:
        return from_http_exception(error).response()
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:
        error_id = uuid.uuid4().hex
        log.exception("request %s %s failed (error id %s)", request.method, request.path, error_id)
        return internal_error(error_id).response()


@web.middleware
async def refuse_when_draining(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Retry-After: the grace period, after which a restarted server may be back."""
    state = request.app[STATE]
    if state.draining and request.path != "/metrics":
        retry = str(max(1, math.ceil(state.settings.shutdown_grace_s)))
        raise ApiError(503, "the server is shutting down; retry on another replica", code="shutting_down",
                       headers={"Retry-After": retry})
    return await handler(request)


@web.middleware
async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
    expected = request.app[STATE].settings.api_key
    if expected is None or request.path in _OPEN_PATHS:
        return await handler(request)
    given = request.headers.get("Authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise ApiError(
            401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return await handler(request)


MIDDLEWARES = (give_back_large_bodies, count_requests, json_errors, refuse_when_draining, check_api_key)
