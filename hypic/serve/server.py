"""Running the server: start the engine, listen, and shut down gracefully on SIGTERM/SIGINT."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from hypic.config import EngineConfig
from hypic.errors import HypicError
from hypic.serve.app import build_app, runner_for
from hypic.serve.args import add_serve_arguments, engine_config, server_settings
from hypic.engine.client import EngineClient, InProcessEngineClient
from hypic.serve.state import STATE, ServerSettings

log = logging.getLogger(__name__)
DESCRIPTION = "OpenAI-compatible HTTP server for hybrid-attention models (hypic)."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hypic.serve", description=DESCRIPTION)
    add_serve_arguments(parser)
    return run_from_args(parser, parser.parse_args(argv))


def run_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Exit status: 0 after a graceful shutdown, 1 if the server could not start."""
    try:
        config, settings = engine_config(args), server_settings(args)
    except HypicError as error:
        parser.error(str(error))
    return run_logged(config, settings, args)


def run_logged(config: EngineConfig, settings: ServerSettings, args: argparse.Namespace) -> int:
    """`run` at the arguments' address and `--log-level` (debug adds the access log and the engine's step log)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(config, settings, args.host, args.port, access_log=args.log_level == "debug")


def run(config: EngineConfig, settings: ServerSettings, host: str, port: int, *, access_log: bool = False) -> int:
    """Serve until SIGTERM/SIGINT (on uvloop where it exists). 0 after a graceful shutdown, 1 if the
    server could not start; the reason is printed, without a stack trace."""
    try:
        return _on_best_loop(serve(config, settings, host, port, access_log=access_log))
    except (HypicError, OSError) as error:  # model missing or unsupported, out of memory, port taken
        print(f"hypic: cannot serve: {error}", file=sys.stderr)
        return 1


def engine_client(config: EngineConfig, settings: ServerSettings) -> EngineClient:
    """One engine in this process, or a cluster of engine processes behind the same interface."""
    if settings.workers == 1 and not settings.gpus:
        return InProcessEngineClient(config)
    from hypic.dist import DistConfig, start_cluster
    dist = DistConfig(transport=settings.transport, router_address=settings.router_address)
    return start_cluster(config, settings.workers, list(settings.gpus) if settings.gpus else None,
                         config.device, dist)


async def serve(config: EngineConfig, settings: ServerSettings, host: str, port: int, *, access_log: bool) -> int:
    client = engine_client(config, settings)
    await client.start()
    runner = runner_for(build_app(client, settings), access_log=access_log)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except OSError:
        await client.shutdown(0.0)
        await runner.cleanup()
        raise
    print(startup_line(client, settings, _bound_url(runner, host)), flush=True)
    await _signalled()
    await drain(runner, settings.shutdown_grace_s)
    return 0


async def drain(runner: web.AppRunner, grace_s: float) -> None:
    """New requests get 503; in-flight ones have grace_s to finish, then are aborted; then close."""
    state = runner.app[STATE]
    state.draining = True
    log.info("shutting down: %d running, %d waiting; grace %.0f s", *_queue(state.client), grace_s)
    await state.client.shutdown(grace_s)
    await runner.cleanup()
    log.info("shut down")


def startup_line(client: EngineClient, settings: ServerSettings, url: str) -> str:
    stats, info = client.stats(), client.info
    name = settings.served_model_name or info.model_name
    return (
        f"hypic serving {name} at {url} on {info.device}: KV cache {stats.kv_blocks_total * stats.block_size} tokens "
        f"({stats.kv_blocks_total} blocks of {stats.block_size}), {stats.state_slots_total} state slots, "
        f"max_model_len {info.max_model_len}"
    )


def _bound_url(runner: web.AppRunner, host: str) -> str:
    port = runner.addresses[0][1]  # the real port when --port 0
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def _queue(client: EngineClient) -> tuple[int, int]:
    stats = client.stats()
    return stats.running, stats.waiting


async def _signalled() -> None:
    """Returns on the first SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def _on_best_loop(main: Coroutine[Any, Any, int]) -> int:
    """uvloop where it exists (not on Windows)."""
    if sys.platform == "win32":
        return asyncio.run(main)
    import uvloop

    return uvloop.run(main)
