"""Getting a request's PIC segments into its combine node's store before it runs there (paper §4.4).

The router places each segment (already there / pull from a holder / prefill somewhere, LPT); the
combine node is told what to expect (it allocates every destination now), then each source gets its
list. The dispatch then waits for the combine node to report each tuple stored. A source that fails,
reports the tuple missing, dies, hangs, or misses the segment deadline costs only latency: its
segments are placed again without it. A segment nobody can provide any more is left to the combine
node, whose engine prefills what its store lacks. If the combine node itself goes, `CombineLost`.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from hypic.cache.segment_store import SegmentKey
from hypic.dist.cluster import Cluster, NodeHandle
from hypic.dist.messages import Arrived, Build, Cancel, Expect, Job, Progress, Pull
from hypic.dist.router import NodeLoad, Placement, Router
from hypic.dist.segment_wire import planned_job
from hypic.dist.stats import DistTimings

log = logging.getLogger("hypic.dist")


class CombineLost(ConnectionError):
    """The combine node died or hung while segments were being gathered for it."""


@dataclass
class _Pending:
    placement: Placement
    transfer_id: int
    deadline: float
    tried: set[int] = field(default_factory=set)  # sources that already failed this segment

    @property
    def source(self) -> int:
        return self.placement.source


@dataclass
class _Tally:
    built: int = 0
    remote: int = 0
    pulled: int = 0
    redispatched: int = 0
    errors: int = 0
    timeouts: int = 0
    transfer_bytes: int = 0
    last_built: float | None = None
    last_arrived: float | None = None
    sources: set[int] = field(default_factory=set)


class Dispatch:
    def __init__(self, request_id: str, combine: NodeHandle, router: Router, cluster: Cluster,
                 transfer_ids: Iterator[int], segment_timeout_s: float) -> None:
        self.request_id, self.combine = request_id, combine
        self._router, self._cluster, self._transfer_ids = router, cluster, transfer_ids
        self._timeout_s = segment_timeout_s
        self._events: asyncio.Queue = asyncio.Queue()
        self._pending: dict[SegmentKey, _Pending] = {}
        self._keys: dict[int, SegmentKey] = {}  # transfer id -> segment
        self._charged: dict[int, tuple[NodeHandle, int]] = {}  # transfer id -> prefill tokens on a node
        self._involved: set[int] = {combine.node_id}
        self._tally = _Tally()

    # -- what the client feeds in -----------------------------------------------------------------

    def on_message(self, node: NodeHandle, message: Progress | Arrived) -> None:
        self._events.put_nowait((node.node_id, message))

    def on_node_down(self, node: NodeHandle) -> None:
        self._events.put_nowait((node.node_id, None))

    # -- the dispatch -----------------------------------------------------------------------------

    async def run(self, placements: list[Placement]) -> DistTimings:
        """`placements`: the router's for this combine node (`Router.place`)."""
        start = time.monotonic()
        try:
            await self._dispatch([p for p in placements if p.kind != "local"], set())
            while self._pending:
                await self._next_event()
        finally:
            self._release_all()
            await self._cancel_leftovers()
        return self._timings(start, len(placements), sum(p.kind == "local" for p in placements))

    async def _dispatch(self, placements: list[Placement], tried: set[int]) -> None:
        now = time.monotonic()
        fresh = [_Pending(p, next(self._transfer_ids), now + self._timeout_s, set(tried)) for p in placements]
        for pending in fresh:
            self._track(pending)
        remote = [p for p in fresh if p.source != self.combine.node_id]
        if remote:
            await self._send(self.combine, Expect(self.request_id, [_job(p, with_tokens=False) for p in remote]))
        groups: dict[tuple[str, int], list[_Pending]] = {}  # one message per source, its jobs in order
        for pending in fresh:
            groups.setdefault((pending.placement.kind, pending.source), []).append(pending)
        for (kind, source), group in groups.items():
            await self._send_jobs(kind, source, group)

    def _track(self, pending: _Pending) -> None:
        key = pending.placement.segment.key
        self._pending[key] = pending
        self._keys[pending.transfer_id] = key
        self._involved.add(pending.source)
        self._tally.sources.add(pending.source)
        if pending.placement.kind == "build":
            self._router.directory.add(key, pending.source)  # pulls by other requests wait on this build
            self._charge(pending)

    async def _send_jobs(self, kind: str, source: int, group: list[_Pending]) -> None:
        node = self._cluster.nodes.get(source)
        jobs = [_job(p, with_tokens=kind == "build") for p in group]
        cls = Build if kind == "build" else Pull
        message = cls(self.request_id, self.combine.node_id, self.combine.hello.data_address, jobs)
        if node is None or not await self._send(node, message, fatal=False):
            self._events.put_nowait((source, None))  # gone before its jobs went out

    async def _send(self, node: NodeHandle, message: Any, *, fatal: bool = True) -> bool:
        try:
            await node.link.send(message)
            return True
        except ConnectionError:
            if fatal:
                raise CombineLost(f"{node.name} is gone") from None
            return False

    # -- events -----------------------------------------------------------------------------------

    async def _next_event(self) -> None:
        wait = min(p.deadline for p in self._pending.values()) - time.monotonic()
        try:
            node_id, message = await asyncio.wait_for(self._events.get(), max(wait, 0.0))
        except TimeoutError:
            await self._expire()
            return
        if message is None:
            await self._node_down(node_id)
        elif isinstance(message, Arrived):
            self._arrived(node_id, message)
        else:
            await self._progress(node_id, message)

    def _arrived(self, node_id: int, message: Arrived) -> None:
        key = self._keys.get(message.transfer_id)
        if node_id != self.combine.node_id or key is None:
            return
        self._tally.last_arrived = time.monotonic()
        self._tally.transfer_bytes += message.nbytes
        if message.stored:
            self._router.directory.add(key, node_id)
        pending = self._pending.pop(key, None)  # any transfer of the key will do, a late original included
        self._tally.pulled += pending is not None and pending.placement.kind == "pull"

    async def _progress(self, node_id: int, message: Progress) -> None:
        key = self._keys.get(message.transfer_id)
        pending = self._pending.get(key) if key is not None else None
        if message.event == "built":
            self._release(message.transfer_id)
            self._tally.built += 1
            self._tally.remote += node_id != self.combine.node_id
            self._tally.last_built = time.monotonic()
        elif message.event in ("failed", "missing"):
            self._release(message.transfer_id)
            self._tally.errors += 1
            if key is not None:
                self._router.directory.drop(key, node_id)
            if pending is not None and pending.transfer_id == message.transfer_id:
                log.warning("%s: segment %s on node %d (%s)", self.request_id, message.event, node_id,
                            message.error.message if message.error else message.event)
                await self._retry([pending])

    async def _node_down(self, node_id: int) -> None:
        if node_id == self.combine.node_id:
            raise CombineLost(f"combine node {node_id} went down")
        for transfer_id in [t for t, (n, _) in self._charged.items() if n.node_id == node_id]:
            self._release(transfer_id)
        await self._retry([p for p in self._pending.values() if p.source == node_id])

    async def _expire(self) -> None:
        now = time.monotonic()
        overdue = [p for p in self._pending.values() if p.deadline <= now]
        self._tally.timeouts += len(overdue)
        for pending in overdue:
            log.warning("%s: segment from node %d is %.0f s late; placing it again", self.request_id,
                        pending.source, self._timeout_s)
            self._release(pending.transfer_id)
        await self._retry(overdue)

    async def _retry(self, failed: list[_Pending]) -> None:
        """Place the segments again, each away from the sources that failed it; the combine node
        is always a candidate, and when it failed a segment itself, the segment is given up (its
        engine prefills it when the request runs)."""
        for pending in failed:
            pending.tried.add(pending.source)
            del self._pending[pending.placement.segment.key]
        for tried, group in itertools.groupby(sorted(failed, key=_tried_key), key=_tried_key):
            if self.combine.node_id in tried:
                continue
            nodes = self._candidates(set(tried))
            segments = [p.placement.segment for p in group]
            placements = [p for p in self._router.place(segments, self.combine.node_id, nodes) if p.kind != "local"]
            self._tally.redispatched += len(placements)
            await self._dispatch(placements, set(tried))

    def _candidates(self, tried: set[int]) -> list[NodeLoad]:
        """Loads of the usable nodes not in `tried`; the combine node always among them."""
        nodes = [n for n in self._cluster.usable() if n.node_id not in tried]
        if self.combine not in nodes:
            nodes.append(self.combine)
        return [n.load() for n in nodes]

    # -- load accounting and the end --------------------------------------------------------------

    def _charge(self, pending: _Pending) -> None:
        node = self._cluster.nodes.get(pending.source)
        if node is not None:
            tokens = len(pending.placement.segment.token_ids)
            node.pending_tokens += tokens
            self._charged[pending.transfer_id] = (node, tokens)

    def _release(self, transfer_id: int) -> None:
        charged = self._charged.pop(transfer_id, None)
        if charged is not None:
            charged[0].pending_tokens -= charged[1]

    def _release_all(self) -> None:
        for transfer_id in list(self._charged):
            self._release(transfer_id)

    async def _cancel_leftovers(self) -> None:
        """Every node involved drops what is left of this request's segment work and buffers."""
        for node_id in self._involved:
            node = self._cluster.nodes.get(node_id)
            if node is not None:
                await self._send(node, Cancel(self.request_id), fatal=False)

    def _timings(self, start: float, segments: int, local: int) -> DistTimings:
        t = self._tally
        built_at = t.last_built if t.last_built is not None else start
        arrived_at = t.last_arrived if t.last_arrived is not None else built_at
        return DistTimings(
            combine_node=self.combine.node_id, dispatch_s=built_at - start, comm_s=max(arrived_at - built_at, 0.0),
            segments=segments, segments_local=local, segments_pulled=t.pulled, segments_built=t.built,
            segments_remote=t.remote, segments_redispatched=t.redispatched, segment_errors=t.errors,
            segment_timeouts=t.timeouts, workers=len(t.sources), transfer_bytes=t.transfer_bytes)


def _job(pending: _Pending, *, with_tokens: bool) -> Job:
    return Job(planned_job(pending.placement.segment, with_tokens=with_tokens), pending.transfer_id)


def _tried_key(pending: _Pending) -> tuple[int, ...]:
    return tuple(sorted(pending.tried))
