"""AsyncEngine: the engine core runs in its own thread; requests and outputs cross by queues.

The core thread owns every piece of engine state. The event loop only submits commands and
receives outputs (call_soon_threadsafe), so it stays responsive while the model runs; prompts are
tokenized in worker threads (the tokenizer's batch call releases the GIL).

Admission counts sequences, not requests: a request of n completions counts n against
`max_waiting` until it starts running (its completions fork from its first token), and a
request refused, finished or aborted counts nothing (abort commands in the inbox are not waiting).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch

from hypic.config import EngineConfig
from hypic.cache.segment_store import SegmentKey, SegmentTuple
from hypic.engine.llm_engine import EngineStats, LLMEngine
from hypic.engine.pic.plan import SegmentJob
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.engine.text.tokenizer import Tokenizer
from hypic.errors import EngineDeadError, EngineOverloadedError, HypicError, InvalidRequestError
from hypic.outputs import RequestOutput
from hypic.sampling_params import SamplingParams

logger = logging.getLogger("hypic")
_INLINE_PROMPT_SIZE = 8192  # characters or ids: tokenized on the event loop in well under a millisecond


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: SegmentedPrompt
    params: SamplingParams
    cache_salt: str | None
    cache_mode: str | None
    resume: dict[int, list[int]] | None = None
    group: str | None = None


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    """Runs `fn(core)` in the core thread and resolves `future` with its result."""

    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future


@dataclass
class _SegmentWait:
    """Resolves `future` with the tuples of `keys` once none is being prefilled or read here."""

    keys: tuple[SegmentKey, ...]
    jobs: tuple[SegmentJob, ...]  # to prefill first (those the store lacks)
    future: asyncio.Future


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
        self._segment_waits: list[_SegmentWait] = []  # core thread only
        self._waiting = 0  # sequences waiting in the core, as it last published them
        self._pending = 0  # sequences of requests submitted but not yet taken by the core (event loop)
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
        if self._core is not None:
            await asyncio.to_thread(self._core.close)  # its pinned host memory goes now, not when collected

    # -- public API ------------------------------------------------------------------------------

    async def generate(self, prompt: str | list[str] | list[int] | list[list[int]], params: SamplingParams | None = None, *,
                       request_id: str | None = None, cache_salt: str | None = None,
                       cache_mode: str | None = None, add_special_tokens: bool = True,
                       resume: dict[int, list[int]] | None = None,
                       group: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields outputs as tokens arrive; leaving the loop early aborts the request.
        add_special_tokens=False for text that already has them (a rendered chat template); requests
        of one `group` (a batch's prompts) are admitted in turn with other groups' (see Scheduler).
        resume: completion index -> the ids it generated on a node that died (LLMEngine.add_request)."""
        params = params or SamplingParams()
        self._check_accepting(params.n)
        request_id = request_id or uuid.uuid4().hex
        segmented = await self._tokenized(prompt, add_special_tokens, params.n)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._inbox.put(_Add(request_id, segmented, params, cache_salt, cache_mode, resume, group))
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

    async def _tokenized(self, prompt: str | list[str] | list[int], add_special_tokens: bool, n: int) -> SegmentedPrompt:
        """The prompt tokenized, a long one in a worker thread. Its n sequences count as waiting from
        now until the core takes the request. A short prompt is tokenized here, at once, so that a
        batch's prompts reach the core together."""
        build = functools.partial(SegmentedPrompt.build, self.tokenizer, prompt, separator=self.config.segment_separator,
                                  add_special_tokens=add_special_tokens)
        self._pending += n
        try:
            return build() if _size(prompt) <= _INLINE_PROMPT_SIZE else await asyncio.to_thread(build)
        except BaseException:
            self._pending -= n
            raise

    async def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    # -- segments (PIC), for peers and operators -------------------------------------------------

    def segment_jobs(self, prompt: str | list[str] | list[int] | SegmentedPrompt, *, cache_salt: str | None = None,
                     cache_mode: str | None = None) -> list[SegmentJob]:
        """The PIC segments of a prompt in order, each marked with whether this engine stores it (a
        prompt already tokenized into segments is taken as it is)."""
        if not isinstance(prompt, SegmentedPrompt):
            prompt = SegmentedPrompt.build(self.tokenizer, prompt, separator=self.config.segment_separator)
        return self._require_core().segment_jobs(prompt, cache_salt, cache_mode)

    async def build_segments(self, jobs: list[SegmentJob]) -> list[SegmentTuple | None]:
        """Prefills the segments here (batched with everything else), stores and returns their tuples
        (None for one the pool could not hold)."""
        future = self._loop.create_future()
        self._inbox.put(_SegmentWait(tuple(job.key for job in jobs), tuple(jobs), future))
        return await future

    async def export_segment(self, key: SegmentKey) -> SegmentTuple | None:
        """A copy of a stored tuple for a peer, from whichever tier holds it (a disk read runs off
        the engine thread first); None if no tier does."""
        self._check_alive()
        future = self._loop.create_future()
        self._inbox.put(_SegmentWait((key,), (), future))
        return (await future)[0]

    async def import_segment(self, key: SegmentKey, tup: SegmentTuple) -> bool:
        return await self._call(lambda core: core.import_segment(key, tup))

    async def segment_moves(self) -> dict[SegmentKey, str | None]:
        """Keys whose best tier in this engine's store changed since the last call, with the tier now."""
        return await self._call(lambda core: core.store.take_moves())

    async def flush_segments(self, salt: str | None = None) -> int:
        """Drops the public pool's entries (of one salt) and the matching prefix checkpoints."""
        return await self._call(lambda core: core.flush_segments(salt))

    async def _call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        self._check_alive()
        future = self._loop.create_future()
        self._inbox.put(_Call(fn, future))
        return await future

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

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop died: {self._dead!r}")
        if self._thread is None:
            raise EngineDeadError("the engine is not running (not started, or shut down)")

    def _check_accepting(self, n: int) -> None:
        self._check_alive()
        if not self.accepting:
            raise EngineDeadError("the engine is not running (not started, or shutting down)")
        limit = self.config.max_waiting
        if n > limit:
            raise InvalidRequestError(f"n={n} completions can never wait in a queue of max_waiting={limit}")
        waiting = self._waiting + self._pending
        if waiting + n > limit:
            raise EngineOverloadedError(waiting, limit)

    def _release_pending(self, taken: int) -> None:
        self._pending -= taken

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
            while self._handle(self._next_command(core)):
                while not self._inbox.empty():
                    if not self._handle(self._inbox.get_nowait()):
                        return
                outputs = core.step()
                self._waiting = core.waiting_sequences()  # before any output: a client that saw one counts right
                for output in outputs:
                    self._send(output.request_id, output if output.error is None else output.error)
                self._settle_segment_waits(core)
        except BaseException as error:  # noqa: BLE001 - every waiter must learn the engine died
            logger.exception("engine loop died")
            self._dead = error
            for request_id in list(self._streams):
                self._send(request_id, EngineDeadError(f"the engine loop died: {error!r}"))

    def _next_command(self, core: LLMEngine) -> object:
        """Blocks while idle; while work waits on memory that nothing frees, polls instead of spinning."""
        if not core.has_work():
            return self._inbox.get()
        if core.last_step_ran:
            return None
        try:
            return self._inbox.get(timeout=0.01)
        except queue.Empty:
            return None

    def _handle(self, command: object) -> bool:
        """Applies one command in the core thread; False on stop."""
        core = self._require_core()
        if isinstance(command, _Stop):
            return False
        if isinstance(command, _Add):
            self._take(core, command)
        elif isinstance(command, _Abort):
            if (output := core.abort(command.request_id)) is not None:
                self._send(command.request_id, output)
        elif isinstance(command, _Call):
            self._resolve(command.future, command.fn, core)
        elif isinstance(command, _SegmentWait):
            core.start_segment_jobs(list(command.jobs))
            for key in command.keys:
                core.fetch_segment(key)
            self._segment_waits.append(command)
            self._settle_segment_waits(core)
        return True

    def _take(self, core: LLMEngine, command: _Add) -> None:
        """Adds the request; its sequences move from the loop's pending count to the core's waiting
        one, waiting first, so that the sum never misses them (it may count them twice a moment)."""
        try:
            core.add_request(command.prompt, command.params, request_id=command.request_id,
                             cache_salt=command.cache_salt, cache_mode=command.cache_mode,
                             resume=command.resume, group=command.group)
            self._waiting += command.params.n  # the core thread is its only writer
        except HypicError as error:
            self._send(command.request_id, error)
        self._loop.call_soon_threadsafe(self._release_pending, command.params.n)

    def _settle_segment_waits(self, core: LLMEngine) -> None:
        for wait in [w for w in self._segment_waits if not any(map(core.segment_pending, w.keys))]:
            self._segment_waits.remove(wait)
            self._resolve(wait.future, lambda c: [c.export_segment(key) for key in wait.keys], core)

    def _resolve(self, future: asyncio.Future, fn: Callable[[LLMEngine], Any], core: LLMEngine) -> None:
        try:
            result = fn(core)
        except Exception as error:  # noqa: BLE001 - handed to the awaiting caller
            self._loop.call_soon_threadsafe(_settle, future, None, error)
        else:
            self._loop.call_soon_threadsafe(_settle, future, result, None)

    def _send(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self._loop.call_soon_threadsafe(self._deliver, request_id, item)


def _size(prompt: str | list[str] | list[int]) -> int:
    """Characters of text, or the number of token ids."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(item) if isinstance(item, str) else 1 for item in prompt)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the awaiting caller was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
