"""The one interface through which callers (the HTTP server, benchmarks) reach an engine.

They never touch engine internals: requests go in through `stream`, come back as RequestOutputs,
are cancelled through `abort`, and everything reported comes from `stats` and `info`. One engine in
this process here (`InProcessEngineClient`); `hypic.dist` puts a cluster of engine processes behind
the same Protocol. It lives beside the engine so that `serve` and `dist` both depend on it and
never on each other.
"""
from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from hypic.config import EngineConfig
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.outputs import RequestOutput
from hypic.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hypic.engine.async_engine import AsyncEngine
    from hypic.engine.llm_engine import EngineStats, LLMEngine
    from hypic.engine.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str | list[str] | list[int] | list[list[int]]  # text (split on the separator), segments, or token ids
    params: SamplingParams
    request_id: str
    cache_salt: str | None = None
    cache_mode: str | None = None  # None: the engine's default
    add_special_tokens: bool = True  # False for text that already has them (a rendered chat template)
    group: str | None = None  # the HTTP request it belongs to: admission takes groups in turn


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    max_model_len: int
    device: str  # "cpu", "cuda:0", ...


class EngineClient(Protocol):
    @property
    def info(self) -> EngineInfo: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def accepting(self) -> bool: ...

    async def start(self) -> None:
        """Load the model and start serving; `info` and `tokenizer` are valid afterwards."""

    def stream(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        """Submit the request and yield its outputs; the last has finished=True. Typed errors
        (hypic.errors) are raised on the first iteration. Closing the iterator early frees it."""

    async def abort(self, request_id: str) -> None:
        """Stop the request now (no-op if it already finished); its stream ends with 'abort'."""

    def stats(self) -> EngineStats: ...

    def tokenize(self, prompt: str | list[str], *, add_special_tokens: bool = True) -> list[int]:
        """The model's input for a prompt, exactly as `stream` would build it (segments split and
        tokenized on their own, separators dropped)."""

    async def flush_cache(self, cache_salt: str | None) -> int:
        """Drop the cached segments and prefix checkpoints (of one salt); returns segments dropped."""

    async def shutdown(self, grace_s: float) -> None:
        """Stop accepting; let in-flight requests finish for up to grace_s, then abort the rest."""


class InProcessEngineClient:
    """An AsyncEngine in this process, on this event loop."""

    def __init__(self, config: EngineConfig) -> None:
        from hypic.engine.async_engine import AsyncEngine  # torch loads only when a server is built

        self._engine: AsyncEngine = AsyncEngine(config)

    @property
    def info(self) -> EngineInfo:
        engine = self._engine
        return EngineInfo(engine.model_name, engine.max_model_len, str(engine.device))

    @property
    def tokenizer(self) -> Tokenizer:
        return self._engine.tokenizer

    @property
    def accepting(self) -> bool:
        return self._engine.accepting

    @property
    def core(self) -> LLMEngine:
        """The engine core, for tools that watch it from another thread (a benchmark's stall watch)."""
        return self._engine.core

    async def start(self) -> None:
        await self._engine.start()

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        outputs = self._engine.generate(
            request.prompt,
            request.params,
            request_id=request.request_id,
            cache_salt=request.cache_salt,
            cache_mode=request.cache_mode,
            add_special_tokens=request.add_special_tokens,
            group=request.group,
        )
        async with aclosing(outputs):  # closing this generator closes the engine's: the request is freed now
            async for output in outputs:
                yield output

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)

    def stats(self) -> EngineStats:
        return self._engine.stats()

    def tokenize(self, prompt: str | list[str], *, add_special_tokens: bool = True) -> list[int]:
        separator = self._engine.config.segment_separator
        built = SegmentedPrompt.build(self.tokenizer, prompt, separator=separator, add_special_tokens=add_special_tokens)
        return list(built.token_ids)

    async def flush_cache(self, cache_salt: str | None) -> int:
        return await self._engine.flush_segments(cache_salt)

    async def shutdown(self, grace_s: float) -> None:
        await self._engine.shutdown(grace_s)
