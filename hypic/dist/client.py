"""DistributedEngineClient: the server's EngineClient over a cluster of engine processes.

Life of a request (DESIGN §6, paper §4.4): one node plans it (splits and hashes its segments), the
router picks the combine node (the conversation's node, else the one holding most of its segments,
among the least loaded) and places its segments (`Router.place`); if any must come from another
node, `Dispatch` gathers them into the combine node's store; then the combine node runs the request
— now a warm PIC request — and its outputs are relayed. With one usable node, or nothing to gather,
the request goes straight to its node (the local path).

Faults cost latency, never a request: a segment source that fails is replaced (`Dispatch`); a
combine node lost before the first token is replaced by another (`max_attempts`); only a node lost
mid-stream fails its requests (EngineDeadError).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hypic.config import EngineConfig
from hypic.dist.cluster import Cluster, NodeHandle
from hypic.dist.config import DistConfig
from hypic.dist.dispatch import CombineLost, Dispatch
from hypic.dist.messages import (Abort, Arrived, Failed, Flush, Generate, Output, Plan, PlanReply, Probe, ProbeReply,
                                 Progress, Shutdown)
from hypic.dist.remote_errors import raise_remote
from hypic.dist.router import Placement, Router
from hypic.dist.segment_wire import key_of, segment_job
from hypic.dist.stats import (ClusterStats, DistRequestMetrics, DistStats, DistTimings, cluster_stats,
                              merge_engine_stats, sum_counters)
from hypic.engine.pic.plan import SegmentJob
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.errors import EngineDeadError, InvalidRequestError
from hypic.outputs import CompletionDelta, RequestOutput
from hypic.serve.engine_client import EngineInfo, GenerateRequest

if TYPE_CHECKING:
    from hypic.dist.launch import LocalNodes
    from hypic.engine.text.tokenizer import Tokenizer

log = logging.getLogger("hypic.dist")
_DOWN = object()  # event: the request's node went down
_ABORTS_S = 5.0  # at shutdown, how long aborted requests get to deliver their last output


class _Retry(Exception):
    """The request's node went down before its first output: run it elsewhere."""


@dataclass(eq=False)
class _Request:
    request: GenerateRequest
    arrival: float
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    node: NodeHandle | None = None  # the node generating it
    dispatch_task: asyncio.Task | None = None
    dispatch: Dispatch | None = None
    timings: DistTimings | None = None
    segments: list[SegmentJob] = field(default_factory=list)
    prefix_hashes: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    generate_sent: float = 0.0
    first_token: float | None = None
    outputs: int = 0
    done: bool = False
    aborted: bool = False
    charged: NodeHandle | None = None  # node whose load counts this request
    charged_tokens: int = 0  # of its pending_tokens, this request's prompt (until the first token)


@dataclass
class _Totals:
    requests_local: int = 0
    requests_distributed: int = 0
    combine_retries: int = 0
    sums: dict[str, float] = field(default_factory=dict)  # DistTimings fields summed over requests


class DistributedEngineClient:
    def __init__(self, config: EngineConfig, nodes: LocalNodes, dist: DistConfig | None = None) -> None:
        self.config, self.dist = config, dist or DistConfig()
        self.nodes = nodes
        self.router = Router(self.dist)
        self._requests: dict[str, _Request] = {}
        self._totals = _Totals()
        self._transfer_ids = itertools.count(1)
        self._info: EngineInfo | None = None
        self._tokenizer: Tokenizer | None = None
        self._accepting = False
        self._drained = asyncio.Event()

    # -- EngineClient -----------------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineDeadError("the cluster is not started: await start() first")
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise EngineDeadError("the cluster is not started: await start() first")
        return self._tokenizer

    @property
    def accepting(self) -> bool:
        return self._accepting

    async def start(self) -> None:
        from hypic.engine.setup import resolve_model_dir
        from hypic.engine.text.tokenizer import Tokenizer

        self.cluster = Cluster(self.dist, self)
        address = await self.cluster.start()
        self._tokenizer = await asyncio.to_thread(Tokenizer.from_dir, resolve_model_dir(self.config.model))
        await self.nodes.start(address, self.cluster)
        await self._wait_for_nodes()
        first = self.cluster.nodes[min(self.cluster.nodes)].hello
        self._info = EngineInfo(first.model_name, first.max_model_len, first.device)
        self._accepting = True

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        record = self._admit(request)
        try:
            async for output in self._run(record):
                yield output
        finally:
            await self._finish(record)

    async def abort(self, request_id: str) -> None:
        record = self._requests.get(request_id)
        if record is None or record.done:
            return
        record.aborted = True
        if record.node is not None:
            await self._send(record.node, Abort(request_id))
        elif record.dispatch_task is not None:
            record.dispatch_task.cancel()

    def stats(self) -> ClusterStats:
        alive = self.cluster.alive()
        engine = merge_engine_stats([n.stats for n in alive if n.stats is not None])
        return cluster_stats(engine, self._dist_stats(alive))

    def tokenize(self, prompt: str | list[str], *, add_special_tokens: bool = True) -> list[int]:
        built = SegmentedPrompt.build(self.tokenizer, prompt, separator=self.config.segment_separator,
                                      add_special_tokens=add_special_tokens)
        return list(built.token_ids)

    async def shutdown(self, grace_s: float) -> None:
        self._accepting = False
        if not await self._drain(grace_s):
            log.warning("shutdown: aborting %d requests after %.1f s", len(self._requests), grace_s)
        for request_id in list(self._requests):
            await self.abort(request_id)
        await self._drain(_ABORTS_S)  # their streams end with the nodes' abort outputs
        self.cluster.closing = True
        self.nodes.expect_exit()
        for node in self.cluster.alive():
            await self._send(node, Shutdown(0.0))
        await self.nodes.stop()
        await self.cluster.close()

    # -- tools (tests, benchmarks) ----------------------------------------------------------------

    def node_of(self, request_id: str) -> int | None:
        """The node generating a request now (its combine node), or None."""
        record = self._requests.get(request_id)
        if record is None:
            return None
        node = record.node or (record.dispatch.combine if record.dispatch is not None else None)
        return node.node_id if node is not None else None

    async def probe(self, node_id: int) -> ProbeReply:
        """Fresh stats and segment counters of one node."""
        node = self.cluster.nodes[node_id]
        return await node.link.call(Probe, self.dist.rpc_timeout_s)

    async def flush_cache(self, cache_salt: str | None) -> int:
        """Flushes every live node's segment pool and prefix checkpoints (of one salt); returns the
        number of segment entries dropped across the cluster."""
        self.router.directory.forget_salt(cache_salt)
        replies = await asyncio.gather(*(n.link.call(lambda i: Flush(i, cache_salt), self.dist.rpc_timeout_s)
                                         for n in self.cluster.alive()))
        return sum(reply.flushed for reply in replies)

    # -- ClusterListener --------------------------------------------------------------------------

    def node_message(self, node: NodeHandle, message: Any) -> None:
        record = self._requests.get(getattr(message, "request_id", ""))
        if record is None:
            return
        if isinstance(message, (Output, Failed)):
            record.events.put_nowait((node.node_id, message))
        elif isinstance(message, (Progress, Arrived)) and record.dispatch is not None:
            record.dispatch.on_message(node, message)

    def node_up(self, node: NodeHandle) -> None:
        self.router.directory.forget_node(node.node_id)  # a (re)joining node's stores start empty
        self.router.affinity.forget_node(node.node_id)
        self.nodes.joined(node.node_id)

    def node_down(self, node: NodeHandle, reason: str) -> None:
        if reason == "died":
            self.router.directory.forget_node(node.node_id)
            self.router.affinity.forget_node(node.node_id)
        for record in self._requests.values():
            if record.dispatch is not None:
                record.dispatch.on_node_down(node)
            if record.node is node:
                record.events.put_nowait((node.node_id, _DOWN))

    # -- a request --------------------------------------------------------------------------------

    def _admit(self, request: GenerateRequest) -> _Request:
        if not self._accepting:
            raise EngineDeadError("the cluster is not running (not started, or shutting down)")
        if request.request_id in self._requests:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already in use")
        record = self._requests[request.request_id] = _Request(request, time.monotonic())
        return record

    async def _run(self, record: _Request) -> AsyncGenerator[RequestOutput, None]:
        excluded: set[int] = set()
        for _ in range(self.dist.max_attempts):
            node = await self._route(record, excluded)
            if node is None:  # its combine node went while gathering segments
                continue
            if record.aborted:
                yield self._abort_output(record)
                return
            try:
                await self._generate_on(record, node)
                async for output in self._relay(record, node):
                    yield output
                return
            except _Retry:
                excluded.add(node.node_id)
                self._totals.combine_retries += 1
                record.node = None
                await self._send(node, Abort(record.request.request_id))  # a hung node may wake up
        raise EngineDeadError(f"request {record.request.request_id}: {self.dist.max_attempts} engine nodes "
                              "went down under it")

    async def _route(self, record: _Request, excluded: set[int]) -> NodeHandle | None:
        """The node to run the request on, its segments gathered there; None if that node went."""
        nodes = [n for n in self.cluster.usable() if n.node_id not in excluded]
        if not nodes:
            raise EngineDeadError("no engine node is up to serve the request")
        if len(nodes) == 1:
            return nodes[0]
        planner = self.cluster.nodes[self.router.least_loaded([n.load() for n in nodes])]
        plan_start = time.monotonic()
        reply = await self._plan(planner, record)
        if reply is None or record.aborted:
            return planner  # unplanned (the planner did not answer): the least loaded node runs it
        plan_s = time.monotonic() - plan_start
        combine = self.cluster.nodes[self.router.choose_combine([n.load() for n in nodes], record.segments,
                                                                record.prefix_hashes)]
        placements = self.router.place(record.segments, combine.node_id, [n.load() for n in nodes])
        if all(p.kind == "local" or p.source == combine.node_id for p in placements):
            return combine  # nothing to gather: the combine node's engine prefills what it lacks
        try:
            timings = await self._gather(record, combine, placements)
        except CombineLost:
            excluded.add(combine.node_id)
            self._totals.combine_retries += 1
            return None
        if timings is not None:
            record.timings = dataclasses.replace(timings, plan_s=plan_s, attempts=len(excluded) + 1)
        return combine

    async def _plan(self, planner: NodeHandle, record: _Request) -> PlanReply | None:
        r = record.request
        try:
            reply = await planner.link.call(
                lambda call_id: Plan(call_id, r.prompt, r.cache_salt, r.cache_mode, r.add_special_tokens,
                                     r.params.max_tokens or 0),
                self.dist.rpc_timeout_s)
        except (ConnectionError, TimeoutError):
            return None
        if reply.error is not None:
            raise_remote(reply.error, planner.name)
        record.segments = [segment_job(job) for job in reply.jobs]
        record.prefix_hashes, record.prompt_tokens = reply.prefix_hashes, reply.prompt_tokens
        for job in reply.jobs:
            if job.cached:
                self.router.directory.add(key_of(job.key), planner.node_id)
        return reply

    async def _gather(self, record: _Request, combine: NodeHandle, placements: list[Placement]) -> DistTimings | None:
        """Dispatch as a task, so that abort() can cancel it; None when aborted."""
        record.dispatch = Dispatch(record.request.request_id, combine, self.router, self.cluster,
                                   self._transfer_ids, self.dist.segment_timeout_s)
        record.dispatch_task = asyncio.create_task(record.dispatch.run(placements))
        try:
            await asyncio.wait([record.dispatch_task])
            return None if record.dispatch_task.cancelled() else record.dispatch_task.result()
        finally:
            record.dispatch_task.cancel()
            record.dispatch = record.dispatch_task = None

    async def _generate_on(self, record: _Request, node: NodeHandle) -> None:
        r = record.request
        prompt = r.prompt if isinstance(r.prompt, str) else list(r.prompt)
        record.node, record.generate_sent = node, time.monotonic()
        self._charge(record, node)
        if not await self._send(node, Generate(r.request_id, prompt, r.params, r.cache_salt, r.cache_mode,
                                               r.add_special_tokens)):
            raise _Retry()

    async def _relay(self, record: _Request, node: NodeHandle) -> AsyncGenerator[RequestOutput, None]:
        while True:
            node_id, item = await record.events.get()
            if node_id != node.node_id:
                continue  # from a node this request left
            if item is _DOWN:
                if record.outputs == 0:
                    raise _Retry()
                if not node.alive:
                    raise EngineDeadError(f"{node.name} died while generating request {record.request.request_id}")
                continue  # hung mid-stream: wait for it (the stream cannot move elsewhere)
            if isinstance(item, Failed):
                raise_remote(item.error, node.name)
            output = self._rewrite(record, item.output)
            record.outputs += 1
            record.done = output.finished
            yield output
            if output.finished:
                return

    # -- bookkeeping ------------------------------------------------------------------------------

    def _rewrite(self, record: _Request, output: RequestOutput) -> RequestOutput:
        """Times on the router's clock (arrival here, first token as seen here) + the breakdown."""
        now = time.monotonic()
        if record.first_token is None and any(d.token_ids for d in output.deltas):
            record.first_token = now
            self._uncharge_prompt(record)
            if record.timings is not None:
                record.timings = dataclasses.replace(record.timings, combine_s=now - record.generate_sent)
        m = output.metrics
        values = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}
        values.update(arrival_time=record.arrival,
                      queue_time=None if m.queue_time is None else m.queue_time + record.generate_sent - record.arrival,
                      ttft=None if record.first_token is None else record.first_token - record.arrival,
                      dist=record.timings)
        return RequestOutput(output.request_id, output.deltas, output.finished, DistRequestMetrics(**values))

    def _abort_output(self, record: _Request) -> RequestOutput:
        deltas = tuple(CompletionDelta(i, "", (), None, "abort") for i in range(record.request.params.n))
        record.done = True
        metrics = DistRequestMetrics(record.arrival, prompt_tokens=record.prompt_tokens, dist=record.timings)
        return RequestOutput(record.request.request_id, deltas, True, metrics)

    def _charge(self, record: _Request, node: NodeHandle) -> None:
        self._uncharge(record)
        node.running += 1
        node.pending_tokens += record.prompt_tokens
        record.charged, record.charged_tokens = node, record.prompt_tokens

    def _uncharge_prompt(self, record: _Request) -> None:
        """At the first token: the prompt's prefill no longer loads the node."""
        if record.charged is not None:
            record.charged.pending_tokens -= record.charged_tokens
            record.charged_tokens = 0

    def _uncharge(self, record: _Request) -> None:
        if record.charged is not None:
            self._uncharge_prompt(record)
            record.charged.running -= 1
            record.charged = None

    async def _finish(self, record: _Request) -> None:
        request_id = record.request.request_id
        self._requests.pop(request_id, None)
        if record.dispatch_task is not None:
            record.dispatch_task.cancel()
        if record.node is not None and not record.done:
            await self._send(record.node, Abort(request_id))  # the consumer left early
        self._uncharge(record)
        if record.done and record.node is not None and not record.aborted:
            self._learn(record, record.node)
        self._count(record)
        if not self._requests:
            self._drained.set()

    def _learn(self, record: _Request, node: NodeHandle) -> None:
        """The next turn of this conversation goes to `node`; its segments are in its store now."""
        self.router.affinity.remember(record.prefix_hashes, node.node_id)
        for segment in record.segments:
            self.router.directory.add(segment.key, node.node_id)

    def _count(self, record: _Request) -> None:
        if record.timings is None:
            self._totals.requests_local += record.node is not None
            return
        self._totals.requests_distributed += 1
        for f in dataclasses.fields(DistTimings):
            value = getattr(record.timings, f.name)
            if f.name != "combine_node" and isinstance(value, (int, float)):
                self._totals.sums[f.name] = self._totals.sums.get(f.name, 0) + value

    def _dist_stats(self, alive: list[NodeHandle]) -> DistStats:
        s, t = self._totals.sums, self._totals
        return DistStats(
            nodes_live=len(self.cluster.usable()), nodes_known=len(self.cluster.nodes),
            requests_local=t.requests_local, requests_distributed=t.requests_distributed,
            segments_local=int(s.get("segments_local", 0)), segments_pulled=int(s.get("segments_pulled", 0)),
            segments_built=int(s.get("segments_built", 0)), segments_remote=int(s.get("segments_remote", 0)),
            segments_redispatched=int(s.get("segments_redispatched", 0)), node_deaths=self.cluster.deaths,
            node_hangs=self.cluster.hangs, node_restarts=self.nodes.restarts,
            segment_errors=int(s.get("segment_errors", 0)), segment_timeouts=int(s.get("segment_timeouts", 0)),
            combine_retries=t.combine_retries, transfer_bytes=int(s.get("transfer_bytes", 0)),
            plan_seconds=s.get("plan_s", 0.0), dispatch_seconds=s.get("dispatch_s", 0.0),
            comm_seconds=s.get("comm_s", 0.0), combine_seconds=s.get("combine_s", 0.0),
            nodes=sum_counters([n.counters for n in alive]))

    async def _drain(self, timeout: float) -> bool:
        """Whether every request finished within `timeout` seconds."""
        if not self._requests:
            return True
        self._drained.clear()
        try:
            await asyncio.wait_for(self._drained.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def _send(self, node: NodeHandle, message: Any) -> bool:
        try:
            await node.link.send(message)
            return True
        except ConnectionError:
            return False

    async def _wait_for_nodes(self) -> None:
        expected = self.nodes.count
        try:
            await self.cluster.wait_until(lambda c: len(c.usable()) >= expected or self.nodes.failed is not None,
                                          self.dist.start_timeout_s)
        except TimeoutError:
            await self.shutdown(0.0)
            raise EngineDeadError(f"only {len(self.cluster.usable())} of {expected} engine nodes joined within "
                                  f"{self.dist.start_timeout_s:.0f} s") from None
        if self.nodes.failed is not None:
            await self.shutdown(0.0)
            raise EngineDeadError(self.nodes.failed)
