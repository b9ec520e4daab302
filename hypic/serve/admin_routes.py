"""Operator endpoints (behind the API key when one is set): cache statistics and flushing."""
from __future__ import annotations

import dataclasses

from aiohttp import web
from msgspec import Struct

from hypic.serve.request_body import read_body
from hypic.serve.responses import json_response
from hypic.serve.state import STATE


class FlushRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """Flush everything, or only one tenant's entries when cache_salt is given."""

    cache_salt: str | None = None


async def cache_stats(request: web.Request) -> web.Response:
    stats = request.app[STATE].client.stats()
    tiers = {name: dataclasses.asdict(tier) if tier is not None else None
             for name, tier in (("segment_host", stats.segment_host), ("segment_disk", stats.segment_disk))}
    return json_response({"prefix_cache": dataclasses.asdict(stats.prefix_cache),
                          "segment_pool": dataclasses.asdict(stats.segment_pool), **tiers})


async def flush_cache(request: web.Request) -> web.Response:
    body = await read_body(request, FlushRequest) if request.can_read_body else FlushRequest()
    dropped = await request.app[STATE].client.flush_cache(body.cache_salt)
    return json_response({"flushed_segments": dropped, "cache_salt": body.cache_salt})
