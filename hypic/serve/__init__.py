"""OpenAI-compatible HTTP server (aiohttp + uvloop + msgspec) in front of an engine client."""
from __future__ import annotations
