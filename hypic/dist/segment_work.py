"""An engine node's side of segment parallelism (paper §4.4, §5).

As a worker it prefills the segments a `Build` names together, in one engine step, and ships each as
soon as the step is done (or a stored tuple on a `Pull`). DESIGN §6 overlaps segment i's transfer with
segment i+1's prefill instead; on the H200 a step per segment made two workers slower than one
(an earlier `scripts/bench_dist.py fig14` run: 1.4-1.8 s to build what one engine batches in 0.8-1.2 s),
while all transfers together took 5-7 ms. As a combine node it allocates the destination of every expected tuple when the
router announces it (`Expect`), before anything is dispatched, and imports each into its segment
store as it lands. Every milestone is reported to the router; `cancel` drops a request's jobs and
buffers here. Transfers already on the wire are never cut (the transport shields them): the
receiver drops what nobody expects any more.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
import torch

from hypic.cache.segment_store import SegmentKey, SegmentTuple
from hypic.dist.messages import Arrived, Build, ErrorInfo, Expect, Job, NodeCounters, Progress, Pull
from hypic.dist.remote_errors import error_info
from hypic.dist.segment_wire import key_of, segment_job, tuple_from, tuple_meta, tuple_specs, tuple_tensors
from hypic.dist.transport import Received, TensorTransport, allocate
from hypic.engine.async_engine import AsyncEngine

log = logging.getLogger("hypic.dist")
Report = Callable[[msgspec.Struct], Awaitable[None]]
_POOL_FULL = ErrorInfo("OutOfMemoryError", "the segment's tuple does not fit this node's segment pool")


class SegmentWork:
    def __init__(self, node_id: int, engine: AsyncEngine, transport: TensorTransport, report: Report) -> None:
        self.node_id, self.engine, self.transport = node_id, engine, transport
        self._report = report
        self._tasks: dict[str, set[asyncio.Task]] = {}  # per request: builds, pulls, imports
        self._sends: set[asyncio.Task] = set()
        self._building: dict[SegmentKey, asyncio.Future] = {}  # builds in progress here; pulls wait on them
        self._built = self._exported = self._failures = 0

    # -- messages ---------------------------------------------------------------------------------

    def build(self, message: Build) -> None:
        self._spawn(message.request_id, self._build(message))

    def pull(self, message: Pull) -> None:
        self._spawn(message.request_id, self._pull(message))

    def expect(self, message: Expect) -> None:
        for job in message.jobs:
            arrival = self.transport.expect(job.transfer_id, message.request_id, self._destination(job))
            self._spawn(message.request_id, self._import(message.request_id, job, arrival))

    def cancel(self, request_id: str) -> None:
        for task in self._tasks.pop(request_id, ()):
            task.cancel()
        self.transport.cancel(request_id)

    def close(self) -> None:
        for request_id in list(self._tasks):
            self.cancel(request_id)
        for task in self._sends:
            task.cancel()

    def counters(self) -> NodeCounters:
        c = self.transport.counters
        pending, pending_bytes = self.transport.pending()
        return NodeCounters(self._built, self._exported, self._failures, c.sent, c.received, c.dropped,
                            c.bytes_sent, c.bytes_received, c.send_seconds, c.receive_seconds, pending,
                            pending_bytes, sum(len(tasks) for tasks in self._tasks.values()))

    # -- worker side ------------------------------------------------------------------------------

    async def _build(self, message: Build) -> None:
        built, seconds = await self._build_batch(message.request_id, message.jobs)
        for job, tup in zip(message.jobs, built):
            if tup is None:
                continue
            await self._report(Progress(message.request_id, job.transfer_id, "built", seconds))
            if message.dest_node == self.node_id:
                await self._report(Arrived(message.request_id, job.transfer_id, True))
            else:
                self._ship(message.request_id, message.dest_address, job, tup)

    async def _build_batch(self, request_id: str, jobs: list[Job]) -> tuple[list[SegmentTuple | None], float]:
        """All of a Build's segments in one engine step: a step each would read every weight (all
        experts of a MoE) once per segment, which cost more than their transfers overlap."""
        keys, start = [key_of(job.segment.key) for job in jobs], time.perf_counter()
        waiting = {key: asyncio.get_running_loop().create_future() for key in keys}
        self._building.update(waiting)
        built: list[SegmentTuple | None] = [None] * len(jobs)
        failure = _POOL_FULL
        try:
            built = await self.engine.build_segments([segment_job(job.segment) for job in jobs])
        except Exception as error:  # noqa: BLE001 - the router re-dispatches; this node keeps serving
            log.exception("building segments for %s failed", request_id)
            failure = error_info(error)
        finally:
            for key, tup in zip(keys, built):  # pulls waiting on a build get its tuple, or None (missing)
                waiting[key].set_result(tup)
                if self._building.get(key) is waiting[key]:
                    del self._building[key]
        for job, tup in zip(jobs, built):
            if tup is None:
                await self._fail(request_id, job, failure)
        self._built += sum(tup is not None for tup in built)
        return built, time.perf_counter() - start

    async def _pull(self, message: Pull) -> None:
        for job in message.jobs:
            key = key_of(job.segment.key)
            building = self._building.get(key)
            tup = await asyncio.shield(building) if building is not None else await self.engine.export_segment(key)
            if tup is None:
                await self._report(Progress(message.request_id, job.transfer_id, "missing"))
                continue
            self._exported += 1
            self._ship(message.request_id, message.dest_address, job, tup)

    def _ship(self, request_id: str, address: str, job: Job, tup: SegmentTuple) -> None:
        task = asyncio.create_task(self._send(request_id, address, job, tup, _ready_marker(tup)))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def _send(self, request_id: str, address: str, job: Job, tup: SegmentTuple, ready: object | None) -> None:
        tensors = tuple_tensors(tup)
        try:
            seconds = await self.transport.send(address, job.transfer_id, request_id, tensors,
                                                meta=tuple_meta(tup), ready=ready)
        except ConnectionError as error:
            await self._fail(request_id, job, error_info(error))
            return
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        await self._report(Progress(request_id, job.transfer_id, "sent", seconds, nbytes))

    async def _fail(self, request_id: str, job: Job, error: ErrorInfo) -> None:
        self._failures += 1
        await self._report(Progress(request_id, job.transfer_id, "failed", error=error))

    # -- combine side -----------------------------------------------------------------------------

    async def _import(self, request_id: str, job: Job, arrival: asyncio.Future) -> None:
        received: Received = await arrival
        try:
            tup = tuple_from(received.tensors, received.meta)
            stored = bool(await self.engine.import_segment(key_of(job.segment.key), tup))
        except Exception:  # noqa: BLE001 - a bad tuple costs a local prefill, never the request
            log.exception("importing a segment of %s failed", request_id)
            stored = False
        await self._report(Arrived(request_id, job.transfer_id, stored, received.seconds, received.nbytes))

    def _destination(self, job: Job) -> list[torch.Tensor] | None:
        """Tensors shaped like the tuple this job will bring, so the payload lands in place."""
        start, end = job.segment.interior
        pin = self.engine.device.type == "cuda" and self.transport.device.type == "cpu"
        layout = self.engine.core.store.layout
        return allocate(tuple_specs(layout, end - start), self.transport.device, pin=pin)

    def _spawn(self, request_id: str, work: Awaitable[None]) -> None:
        task = asyncio.create_task(work)
        tasks = self._tasks.setdefault(request_id, set())
        tasks.add(task)
        task.add_done_callback(lambda done: self._finished(request_id, done))

    def _finished(self, request_id: str, task: asyncio.Task) -> None:
        tasks = self._tasks.get(request_id)
        if tasks is not None:
            tasks.discard(task)
            if not tasks:
                del self._tasks[request_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("segment work of %s failed", request_id, exc_info=task.exception())


def _ready_marker(tup: SegmentTuple) -> object | None:
    """A CUDA event after the kernels that wrote the tuple (recorded before the next segment's
    prefill is queued, so a transfer waiting on it overlaps that prefill)."""
    first = next(iter(tup.T or tup.K), None)
    if first is None or not first.is_cuda:
        return None
    return torch.cuda.current_stream(first.device).record_event()
