"""The aiohttp application: routes, middlewares and shared state."""
from __future__ import annotations

from aiohttp import web

from hypic.serve import admin_routes, info_routes
from hypic.serve.chat import create_chat_completion
from hypic.serve.chat_reply import agent_settings
from hypic.serve.completions import create_completion
from hypic.engine.client import EngineClient
from hypic.serve.metrics import ServerMetrics
from hypic.serve.middleware import MIDDLEWARES
from hypic.serve.state import STATE, ServerSettings, ServerState


def build_app(client: EngineClient, settings: ServerSettings) -> web.Application:
    """An app serving a started engine client."""
    app = web.Application(middlewares=MIDDLEWARES, client_max_size=settings.max_body_bytes)
    settings = agent_settings(client.tokenizer, settings)
    metrics = ServerMetrics(client.stats, client.info.device, settings.served_model_name or client.info.model_name)
    app[STATE] = ServerState(client, settings, metrics)
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
    return app


def runner_for(app: web.Application, *, access_log: bool) -> web.AppRunner:
    """handler_cancellation: a client that disconnects cancels its handler, which aborts its request."""
    options = {} if access_log else {"access_log": None}
    return web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5.0, **options)
