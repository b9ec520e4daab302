"""Routing and retries: running one request on the cluster until it finishes (DESIGN §6, paper §4.4).

One node plans the request (splits and hashes its segments), the router picks the combine node (the
conversation's node, else the one holding most of its segments, among the least loaded) and places
its segments (`Router.place`); if any must come from another node, `Dispatch` gathers them into the
combine node's store; then the combine node runs the request — now a warm PIC request — and its
outputs are relayed. With one usable node, or nothing to gather, the request goes straight to its
node (the local path).

Faults cost latency, never a request: a segment source that fails is replaced (`Dispatch`); a
combine node that dies or hangs is replaced by another (`max_attempts` in all). Lost mid-stream, the
request resumes there from what it had produced: the prompt and each unfinished completion's ids
are prefilled, its engine rebuilds the output-side state from them (penalties, remaining
max_tokens, stop strings and text, seeded generators), and the stream goes on where it stopped.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import AsyncGenerator

from hypic.dist.cluster import Cluster, NodeHandle
from hypic.dist.config import DistConfig
from hypic.dist.dispatch import CombineLost, Dispatch
from hypic.dist.ledger import Ledger
from hypic.dist.messages import Abort, Failed, Generate, Plan, PlanReply
from hypic.dist.remote_errors import raise_remote
from hypic.dist.request_record import RequestRecord
from hypic.dist.router import Placement, Router
from hypic.dist.segment_wire import key_of, segment_job
from hypic.dist.stats import DistTimings
from hypic.errors import EngineDeadError
from hypic.outputs import RequestOutput

DOWN = object()  # event: the request's node went down


class _Retry(Exception):
    """The request's node went down: run it elsewhere (resumed, if it had produced anything)."""


class RequestRunner:
    def __init__(self, dist: DistConfig, cluster: Cluster, router: Router, ledger: Ledger) -> None:
        self.dist, self.cluster, self.router, self.ledger = dist, cluster, router, ledger
        self._transfer_ids = itertools.count(1)

    async def run(self, record: RequestRecord) -> AsyncGenerator[RequestOutput, None]:
        excluded: set[int] = set()
        for _ in range(self.dist.max_attempts):
            node = await self._route(record, excluded)
            if node is None:  # its combine node went while gathering segments
                continue
            if record.aborted:
                yield self.ledger.abort_output(record)
                return
            try:
                await self._generate_on(record, node)
                async for output in self._relay(record, node):
                    yield output
                return
            except _Retry:
                excluded.add(node.node_id)
                self.ledger.retried(record)
                record.node = None
                await node.send(Abort(record.request.request_id))  # a hung node may wake up
        raise EngineDeadError(f"request {record.request.request_id}: {self.dist.max_attempts} engine nodes "
                              "went down under it")

    def learn(self, record: RequestRecord, node: NodeHandle) -> None:
        """The next turn of this conversation goes to `node`; its segments are in its store now."""
        self.router.affinity.remember(record.prefix_hashes, node.node_id)
        for segment in record.segments:
            self.router.directory.add(segment.key, node.node_id)

    async def _route(self, record: RequestRecord, excluded: set[int]) -> NodeHandle | None:
        """The node to run the request on, its segments gathered there; None if that node went."""
        nodes = self.cluster.responsive([n for n in self.cluster.usable() if n.node_id not in excluded])
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
            self.ledger.retried(record)
            return None
        if timings is not None:
            record.timings = dataclasses.replace(timings, plan_s=plan_s, attempts=len(excluded) + 1)
        return combine

    async def _plan(self, planner: NodeHandle, record: RequestRecord) -> PlanReply | None:
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
            if job.tier is not None:
                self.router.directory.add(key_of(job.key), planner.node_id, job.tier)
        return reply

    async def _gather(self, record: RequestRecord, combine: NodeHandle,
                      placements: list[Placement]) -> DistTimings | None:
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

    async def _generate_on(self, record: RequestRecord, node: NodeHandle) -> None:
        r = record.request
        prompt = r.prompt if isinstance(r.prompt, str) else list(r.prompt)
        record.node, record.generate_sent = node, time.monotonic()
        self.ledger.charge(record, node)
        if not await node.send(Generate(r.request_id, prompt, r.params, r.cache_salt, r.cache_mode,
                                        r.add_special_tokens, record.resume())):
            raise _Retry()

    async def _relay(self, record: RequestRecord, node: NodeHandle) -> AsyncGenerator[RequestOutput, None]:
        while True:
            node_id, item = await record.events.get()
            if node_id != node.node_id:
                continue  # from a node this request left
            if item is DOWN:
                raise _Retry()
            if isinstance(item, Failed):
                raise_remote(item.error, node.name)
            output = self.ledger.rewrite(record, item.output)
            record.took(output)
            record.done = output.finished
            yield output
            if output.finished:
                return
