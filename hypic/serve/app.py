"""The aiohttp application: routes, middlewares and shared state; and the runner that serves it."""
from __future__ import annotations

import functools
import logging
import re
from asyncio import Transport

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from hypic.serve import admin_routes, info_routes
from hypic.serve.chat import create_chat_completion
from hypic.serve.chat_reply import agent_settings
from hypic.serve.completions import create_completion
from hypic.engine.client import EngineClient
from hypic.serve.limits import RequestLimits, longest_token_chars
from hypic.serve.memory import freeze_startup_objects
from hypic.serve.metrics import ServerMetrics
from hypic.serve.middleware import MIDDLEWARES
from hypic.serve.state import STATE, ServerSettings, ServerState

_CREDENTIAL_HEADER = re.compile(r"(?i)\b(authorization|proxy-authorization|cookie|x-api-key)\s*:[^\n]*")
_TOO_MANY_CONNECTIONS = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\n"
                         b"Content-Length: 0\r\n\r\n")


def build_app(client: EngineClient, settings: ServerSettings) -> web.Application:
    """An app serving a started engine client."""
    app = web.Application(middlewares=MIDDLEWARES, client_max_size=settings.limits.max_body_bytes)
    settings = agent_settings(client.tokenizer, settings)
    metrics = ServerMetrics(client.stats, client.info.device, settings.served_model_name or client.info.model_name)
    max_chars = client.info.max_model_len * longest_token_chars(client.tokenizer)
    app[STATE] = ServerState(client, settings, metrics, max_chars)
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_get("/v1/models", info_routes.list_models)
    app.router.add_get("/v1/models/{model}", info_routes.get_model)
    app.router.add_post("/tokenize", info_routes.tokenize)
    app.router.add_post("/detokenize", info_routes.detokenize)
    app.router.add_get("/version", info_routes.version)
    app.router.add_get("/health", info_routes.health)
    app.router.add_get("/metrics", info_routes.metrics)
    app.router.add_get("/admin/cache", admin_routes.cache_stats)
    app.router.add_post("/admin/cache/flush", admin_routes.flush_cache)
    app.on_cleanup.append(_close_large_bodies)
    freeze_startup_objects()
    return app


async def _close_large_bodies(app: web.Application) -> None:
    app[STATE].large_bodies.close()


def runner_for(app: web.Application, *, access_log: bool) -> web.AppRunner:
    """handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
    keepalive_timeout: aiohttp closes a connection whose request head has not come within it (a new
    one or one idle between requests), which is the header-read timeout."""
    options = {} if access_log else {"access_log": None}
    limits = app[STATE].settings.limits
    logging.getLogger("aiohttp.server").addFilter(_REDACT_CREDENTIALS)
    return _CappedRunner(app, limits, handler_cancellation=True, shutdown_timeout=5.0,
                         keepalive_timeout=limits.header_timeout_s, **options)


class _CappedRunner(web.AppRunner):
    """An AppRunner whose server answers 503 and closes a connection past `max_connections`."""

    def __init__(self, app: web.Application, limits: RequestLimits, **options: object) -> None:
        super().__init__(app, **options)
        self._max_connections = limits.max_connections

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # aiohttp has no connection cap: its server's per-connection hook refuses past the cap
        server.connection_made = functools.partial(_capped, server, server.connection_made, self._max_connections)
        return server


def _capped(server: web.Server, connection_made, cap: int, handler: object, transport: Transport) -> None:
    connection_made(handler, transport)
    if len(server.connections) > cap:
        transport.write(_TOO_MANY_CONNECTIONS)
        transport.close()


class _RedactCredentials(logging.Filter):
    """aiohttp logs a malformed request with its offending header line (an API key with a NUL in
    it, say): the log gets the error without header values."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], HttpProcessingError):
            error = record.exc_info[1]
            detail = _CREDENTIAL_HEADER.sub(r"\1: <redacted>", str(error.message))
            record.msg, record.args = f"{record.getMessage()}: {error.code} {detail}", ()
            record.exc_info, record.exc_text = None, None
        return True


_REDACT_CREDENTIALS = _RedactCredentials()
