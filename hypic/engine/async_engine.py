"""AsyncEngine: the engine core runs in its own thread; requests and outputs cross by queues.

The core thread owns every piece of engine state. The event loop only tokenizes, submits commands
and receives outputs (call_soon_threadsafe), so it stays responsive while the model runs.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from hypic.config import EngineConfig
from hypic.engine.llm_engine import EngineStats, LLMEngine
from hypic.engine.segments import SegmentedPrompt
from hypic.engine.tokenizer import Tokenizer
from hypic.errors import EngineDeadError, EngineOverloadedError, HypicError
from hypic.outputs import RequestOutput
from hypic.sampling_params import SamplingParams

logger = logging.getLogger("hypic")


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: SegmentedPrompt
    params: SamplingParams
    cache_salt: str | None
    cache_mode: str | None


@dataclass(frozen=True)
class _Abort:
    request_id: str


class _Stop:
    pass


class AsyncEngine:
    """`async with AsyncEngine(EngineConfig(...)) as engine: async for out in engine.generate(...)`."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self._core: LLMEngine | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._drained = asyncio.Event()
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self.accepting = False

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._core = await asyncio.to_thread(LLMEngine, self.config)
        self._thread = threading.Thread(target=self._run, name="hypic-engine", daemon=True)
        self._thread.start()
        self.accepting = True

    async def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop accepting; give in-flight requests `grace_s` seconds, abort the rest, stop the core."""
        self.accepting = False
        if self._streams and grace_s > 0:
            self._drained.clear()
            try:
                await asyncio.wait_for(self._drained.wait(), grace_s)
            except TimeoutError:
                logger.warning("shutdown: aborting %d requests after %.1f s", len(self._streams), grace_s)
        for request_id in list(self._streams):
            self._inbox.put(_Abort(request_id))
        if self._thread is not None:
            self._inbox.put(_Stop())
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    # -- public API ------------------------------------------------------------------------------

    async def generate(self, prompt: str | list[str] | list[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None, cache_salt: str | None = None,
                       cache_mode: str | None = None,
                       add_special_tokens: bool = True) -> AsyncIterator[RequestOutput]:
        """Yields outputs as tokens arrive; leaving the loop early aborts the request.
        add_special_tokens=False for text that already has them (a rendered chat template)."""
        self._check_accepting()
        request_id = request_id or uuid.uuid4().hex
        segmented = SegmentedPrompt.build(self.tokenizer, prompt, separator=self.config.segment_separator,
                                          add_special_tokens=add_special_tokens)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._inbox.put(_Add(request_id, segmented, params or SamplingParams(), cache_salt, cache_mode))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._inbox.put(_Abort(request_id))
            self._forget(request_id)

    async def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def stats(self) -> EngineStats:
        return self._require_core().stats()

    @property
    def tokenizer(self) -> Tokenizer:
        return self._require_core().tokenizer

    @property
    def model_name(self) -> str:
        return self._require_core().model_dir.name

    @property
    def max_model_len(self) -> int:
        return self._require_core().max_model_len

    @property
    def device(self) -> torch.device:
        return self._require_core().device

    @property
    def core(self) -> LLMEngine:
        """The engine core, for tests and tools that inspect memory; touch it only while idle."""
        return self._require_core()

    # -- event-loop side -------------------------------------------------------------------------

    def _check_accepting(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop died: {self._dead!r}")
        if not self.accepting:
            raise EngineDeadError("the engine is not running (not started, or shutting down)")
        waiting = len(self._require_core().scheduler.waiting) + self._inbox.qsize()
        if waiting >= self.config.max_waiting:
            raise EngineOverloadedError(waiting, self.config.max_waiting)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(item)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if not self._streams:
            self._drained.set()

    def _require_core(self) -> LLMEngine:
        if self._core is None:
            raise EngineDeadError("the engine is not started: use `async with AsyncEngine(...)` or await start()")
        return self._core

    # -- core thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        core = self._require_core()
        try:
            while self._handle(self._inbox.get() if not core.has_work() else None):
                while not self._inbox.empty():
                    if not self._handle(self._inbox.get_nowait()):
                        return
                for output in core.step():
                    self._send(output.request_id, output)
        except BaseException as error:  # noqa: BLE001 - every waiter must learn the engine died
            logger.exception("engine loop died")
            self._dead = error
            for request_id in list(self._streams):
                self._send(request_id, EngineDeadError(f"the engine loop died: {error!r}"))

    def _handle(self, command: object) -> bool:
        """Applies one command in the core thread; False on stop."""
        core = self._require_core()
        if isinstance(command, _Stop):
            return False
        if isinstance(command, _Add):
            try:
                core.add_request(command.prompt, command.params, request_id=command.request_id,
                                 cache_salt=command.cache_salt, cache_mode=command.cache_mode)
            except HypicError as error:
                self._send(command.request_id, error)
        elif isinstance(command, _Abort):
            if (output := core.abort(command.request_id)) is not None:
                self._send(command.request_id, output)
        return True

    def _send(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self._loop.call_soon_threadsafe(self._deliver, request_id, item)
