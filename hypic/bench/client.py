"""One streamed request to an OpenAI-compatible server, timed on the client.

A hypic server gets a prompt as `segments` (token-id lists, or texts with --prompt-form text) and a
per-request `cache_mode`; any other server gets one `prompt` (the concatenated ids, or the joined
texts). A trace's chat messages go to /v1/chat/completions as text.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Literal

import aiohttp

from hypic.bench.workloads import BenchRequest

Backend = Literal["hypic", "openai"]
PromptForm = Literal["ids", "text"]


@dataclass(frozen=True)
class Outcome:
    """A request as the client saw it; times in seconds from just before it was sent."""

    error: str | None
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: tuple[float, ...] = ()  # gaps between consecutive chunks that carried text
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class Target:
    """Where and how requests go."""

    url: str
    model: str
    backend: Backend = "hypic"
    prompt_form: PromptForm = "ids"
    cache_mode: str | None = None  # hypic only: the request's cache mode; None = the server's default
    ignore_eos: bool = True  # exactly max_tokens tokens per answer (vLLM and SGLang accept it too)


def request_body(target: Target, request: BenchRequest) -> tuple[str, dict]:
    """The endpoint path and JSON body of one request."""
    body: dict = {"model": target.model, "max_tokens": request.max_tokens, "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.backend == "hypic" and target.cache_mode is not None:
        body["cache_mode"] = target.cache_mode
    if request.messages is not None:
        return "/v1/chat/completions", {**body, "messages": list(request.messages)}
    return "/v1/completions", {**body, **_prompt_fields(target, request)}


def _prompt_fields(target: Target, request: BenchRequest) -> dict:
    as_text = target.prompt_form == "text" and request.texts is not None
    if target.backend == "hypic":
        return {"segments": list(request.texts) if as_text else [list(s) for s in request.segments]}
    return {"prompt": "".join(request.texts) if as_text else list(request.token_ids)}


async def send(session: aiohttp.ClientSession, target: Target, request: BenchRequest) -> Outcome:
    """Stream one request; failures of any kind come back as an Outcome with `error` set."""
    path, body = request_body(target, request)
    start = time.perf_counter()
    try:
        async with session.post(target.url + path, json=body) as response:
            if response.status != 200:
                return Outcome(f"HTTP {response.status}: {(await response.text())[:300]}", e2e_s=time.perf_counter() - start)
            return await _read_stream(response, start)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
        return Outcome(f"{type(error).__name__}: {error}", e2e_s=time.perf_counter() - start)


async def _read_stream(response: aiohttp.ClientResponse, start: float) -> Outcome:
    arrivals: list[float] = []
    usage: dict = {}
    async for line in response.content:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            return Outcome(f"stream error: {chunk['error']}", e2e_s=time.perf_counter() - start)
        if any(_chunk_text(choice) for choice in chunk.get("choices") or ()):
            arrivals.append(time.perf_counter())
        usage = chunk.get("usage") or usage
    end = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return Outcome(None, arrivals[0] - start if arrivals else None, end - start,
                   tuple(b - a for a, b in zip(arrivals, arrivals[1:])), usage.get("prompt_tokens", 0),
                   usage.get("completion_tokens", 0), details.get("cached_tokens") or 0)


def _chunk_text(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""
