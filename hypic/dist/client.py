"""DistributedEngineClient: the server's EngineClient over a cluster of engine processes.

It admits requests, hands each to the `RequestRunner` (routing and retries) and relays what comes
back; the `Ledger` charges each request's load to its node and keeps the statistics; the `Cluster`
tells it who joined, left or hung, which it passes on to the requests concerned.

    client = start_cluster(EngineConfig(model=...), workers=4, gpus=None, device="auto")
    await client.start()        # spawns the nodes, waits until every one has joined
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

from hypic.config import EngineConfig
from hypic.dist.cluster import Cluster, NodeHandle
from hypic.dist.config import DistConfig
from hypic.dist.launch import LocalNodes, plan_nodes
from hypic.dist.ledger import Ledger
from hypic.dist.messages import (Abort, Arrived, Failed, Flush, Output, Probe, ProbeReply, Progress, Shutdown,
                                 TierMoves)
from hypic.dist.request_record import RequestRecord
from hypic.dist.request_runner import DOWN, RequestRunner
from hypic.dist.router import Router
from hypic.dist.segment_wire import key_of
from hypic.dist.stats import ClusterStats, cluster_stats, merge_engine_stats
from hypic.engine.client import EngineInfo, GenerateRequest
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.errors import EngineDeadError, InvalidRequestError
from hypic.outputs import RequestOutput

if TYPE_CHECKING:
    from hypic.engine.text.tokenizer import Tokenizer

log = logging.getLogger("hypic.dist")
_ABORTS_S = 5.0  # at shutdown, how long aborted requests get to deliver their last output


def start_cluster(config: EngineConfig, workers: int, gpus: list[int] | None, device: str,
                  dist: DistConfig | None = None,
                  configure: Callable[[EngineConfig], EngineConfig] | None = None) -> DistributedEngineClient:
    """A client for `workers` engine processes (one per GPU of `gpus`, round robin when there are
    more workers than GPUs; `device="cpu"`: CPU processes). Nothing starts before `await start()`.
    `configure` runs in each node process before its engine is built (see NodeSpec)."""
    dist = dist or DistConfig()
    plans, transport = plan_nodes(config, workers, gpus, device, dist.transport)
    return DistributedEngineClient(config, LocalNodes(plans, dist, transport, configure), dist)


class DistributedEngineClient:
    def __init__(self, config: EngineConfig, nodes: LocalNodes, dist: DistConfig | None = None) -> None:
        self.config, self.dist = config, dist or DistConfig()
        self.nodes = nodes
        self.router = Router(self.dist)
        self.ledger = Ledger()
        self._requests: dict[str, RequestRecord] = {}
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
        self.runner = RequestRunner(self.dist, self.cluster, self.router, self.ledger)
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
            async for output in self.runner.run(record):
                yield output
        finally:
            await self._finish(record)

    async def abort(self, request_id: str) -> None:
        record = self._requests.get(request_id)
        if record is None or record.done:
            return
        record.aborted = True
        if record.node is not None:
            await record.node.send(Abort(request_id))
        elif record.dispatch_task is not None:
            record.dispatch_task.cancel()

    def stats(self) -> ClusterStats:
        engine = merge_engine_stats([n.stats for n in self.cluster.alive() if n.stats is not None])
        return cluster_stats(engine, self.ledger.dist_stats(self.cluster, self.nodes.restarts))

    def tokenize(self, prompt: str | list[str], *, add_special_tokens: bool = True) -> list[int]:
        built = SegmentedPrompt.build(self.tokenizer, prompt, separator=self.config.segment_separator,
                                      add_special_tokens=add_special_tokens)
        return list(built.token_ids)

    async def flush_cache(self, cache_salt: str | None) -> int:
        """Flushes every live node's segment pool and prefix checkpoints (of one salt); returns the
        number of segment entries dropped across the cluster."""
        self.router.directory.forget_salt(cache_salt)
        replies = await asyncio.gather(*(n.link.call(lambda i: Flush(i, cache_salt), self.dist.rpc_timeout_s)
                                         for n in self.cluster.alive()))
        return sum(reply.flushed for reply in replies)

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
            await node.send(Shutdown(0.0))
        await self.nodes.stop()
        await self.cluster.close()

    async def probe(self, node_id: int) -> ProbeReply:
        """Fresh stats and segment counters of one node."""
        node = self.cluster.nodes[node_id]
        return await node.link.call(Probe, self.dist.rpc_timeout_s)

    # -- ClusterListener --------------------------------------------------------------------------

    def node_message(self, node: NodeHandle, message: Any) -> None:
        if isinstance(message, TierMoves):
            self.router.directory.moved(node.node_id, {key_of(m.key): m.tier for m in message.moves})
            return
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
                record.events.put_nowait((node.node_id, DOWN))

    # -- a request's admission and end ------------------------------------------------------------

    def _admit(self, request: GenerateRequest) -> RequestRecord:
        if not self._accepting:
            raise EngineDeadError("the cluster is not running (not started, or shutting down)")
        if request.request_id in self._requests:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already in use")
        record = self._requests[request.request_id] = RequestRecord(request, time.monotonic())
        return record

    async def _finish(self, record: RequestRecord) -> None:
        request_id = record.request.request_id
        self._requests.pop(request_id, None)
        if record.dispatch_task is not None:
            record.dispatch_task.cancel()
        if record.node is not None and not record.done:
            await record.node.send(Abort(request_id))  # the consumer left early
        self.ledger.uncharge(record)
        if record.done and record.node is not None and not record.aborted:
            self.runner.learn(record, record.node)
        self.ledger.count(record)
        if not self._requests:
            self._drained.set()

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
