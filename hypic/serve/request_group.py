"""The engine requests behind one HTTP request (one per prompt of a batch) as one stream.

`open()` submits them all and waits for each one's first output, so that every engine error
(too long, overloaded, invalid) is known before a response starts. `close()` aborts whatever has not
finished — the path taken when a client disconnects — and is safe to call more than once.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager

from hypic.outputs import RequestOutput
from hypic.engine.client import EngineClient, GenerateRequest
from hypic.serve.metrics import ServerMetrics


class RequestGroup:
    def __init__(self, client: EngineClient, requests: list[GenerateRequest], metrics: ServerMetrics) -> None:
        self._client = client
        self._metrics = metrics
        self._ids = [request.request_id for request in requests]
        self._streams: list[AsyncGenerator[RequestOutput, None]] = [client.stream(r) for r in requests]
        self._unfinished = set(range(len(requests)))
        self._firsts: list[RequestOutput] = []

    async def open(self) -> None:
        try:
            results = await asyncio.gather(*map(_first, self._streams), return_exceptions=True)
        except BaseException:  # cancelled (client gone) while waiting for the first outputs
            await self.close()
            raise
        errors = [result for result in results if isinstance(result, BaseException)]
        self._unfinished -= {index for index, result in enumerate(results) if isinstance(result, BaseException)}
        if errors:
            await self.close()
            raise errors[0]
        self._firsts = results

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) in arrival order, until every request has finished."""
        for index, output in enumerate(self._firsts):
            yield index, self._seen(index, output)
        async with aclosing(_merged(self._streams)) as merged:  # closing it stops its pump tasks
            async for index, output in merged:
                yield index, self._seen(index, output)

    async def close(self) -> None:
        for index in sorted(self._unfinished):
            await self._client.abort(self._ids[index])
        self._unfinished.clear()
        for stream in self._streams:
            await stream.aclose()

    def _seen(self, index: int, output: RequestOutput) -> RequestOutput:
        self._metrics.observe(output)
        if output.finished:
            self._unfinished.discard(index)
        return output


@asynccontextmanager
async def submitted(
    client: EngineClient, requests: list[GenerateRequest], metrics: ServerMetrics
) -> AsyncIterator[AsyncIterator[tuple[int, RequestOutput]]]:
    """Submit the requests (engine errors are raised here) and give their merged outputs; leaving
    the block early, by error, disconnect or cancellation, aborts every unfinished request."""
    group = RequestGroup(client, requests, metrics)
    await group.open()
    try:
        async with aclosing(group.outputs()) as outputs:
            yield outputs
    finally:
        await group.close()


async def _first(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        raise RuntimeError("the engine ended a request without a final output") from None


async def _merged(streams: list[AsyncGenerator[RequestOutput, None]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the streams as their outputs arrive; an error in one is raised here."""
    if len(streams) == 1:  # the common case needs no tasks
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
            queue.put_nowait((index, None))
        except Exception as error:  # handed to the consumer, which raises it
            queue.put_nowait((index, error))

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                running -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # streams are idle again: close() may aclose them
