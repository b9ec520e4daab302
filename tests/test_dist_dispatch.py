"""Gathering a request's segments, node by node, with faults: failures, missing pulls, dead, hung or
late sources, and the combine node itself going away. Nodes here are in-process fakes that record
what the dispatch sends them; the test plays their replies."""
from __future__ import annotations

import asyncio
import itertools

import pytest

from hypic.cache.prefix_cache import token_bytes
from hypic.cache.segment_store import SegmentKey
from hypic.dist.cluster import NodeHandle
from hypic.dist.config import DistConfig
from hypic.dist.dispatch import CombineLost, Dispatch
from hypic.dist.messages import Arrived, Build, Cancel, Expect, Hello, Progress, Pull
from hypic.dist.router import Router
from hypic.dist.segment_wire import key_of
from hypic.engine.pic.plan import SegmentJob


class FakeLink:
    def __init__(self, changed: asyncio.Condition) -> None:
        self.sent: list = []
        self.closed = asyncio.Event()
        self._changed = changed

    async def send(self, message) -> None:
        if self.closed.is_set():
            raise ConnectionError("gone")
        self.sent.append(message)
        async with self._changed:
            self._changed.notify_all()


class FakeCluster:
    def __init__(self, count: int) -> None:
        self.changed = asyncio.Condition()
        hello = Hello(0, 1, "cpu", "tcp://127.0.0.1:1", "tcp", "m", 64)
        self.nodes = {i: NodeHandle(i, hello, FakeLink(self.changed), stats={}) for i in range(count)}

    def usable(self) -> list[NodeHandle]:
        return [n for n in self.nodes.values() if n.usable]

    def jobs(self, node_id: int, kind: type) -> list:
        return [job for m in self.nodes[node_id].link.sent if isinstance(m, kind) for job in m.jobs]

    async def wait_sent(self, node_id: int | None, kind: type, count: int) -> list:
        """At least `count` jobs of `kind` sent to the node (None: to all nodes together)."""
        def sent() -> list:
            ids = self.nodes if node_id is None else [node_id]
            return [job for i in ids for job in self.jobs(i, kind)]
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: len(sent()) >= count), 5.0)
        return sent()


def seg(name: str, tokens: int = 300) -> SegmentJob:
    ids = tuple(range(tokens))
    return SegmentJob(SegmentKey.of("fp", 8, name, token_bytes(ids)), ids, (8, tokens - 8), False)


def setup(count: int = 3, timeout: float = 60.0) -> tuple[FakeCluster, Router, Dispatch]:
    cluster = FakeCluster(count)
    router = Router(DistConfig(min_remote_tokens=0))
    dispatch = Dispatch("r", cluster.nodes[0], router, cluster, itertools.count(1), timeout)
    return cluster, router, dispatch


def start(cluster: FakeCluster, router: Router, dispatch: Dispatch, segments: list[SegmentJob]) -> asyncio.Task:
    placements = router.place(segments, 0, [n.load() for n in cluster.usable()])
    return asyncio.create_task(dispatch.run(placements))


def deliver(cluster: FakeCluster, dispatch: Dispatch, source: int, job, *, built: bool = True) -> None:
    """The source built it (unless pulled) and sent it; the combine node stored it."""
    if built:
        dispatch.on_message(cluster.nodes[source], Progress("r", job.transfer_id, "built", 0.1))
    dispatch.on_message(cluster.nodes[0], Arrived("r", job.transfer_id, True, 0.01, 1000))


def test_segments_are_used_in_place_pulled_or_built_and_every_charge_and_buffer_is_released():
    async def main() -> None:
        cluster, router, dispatch = setup()
        local, pulled, cold = seg("local"), seg("pulled"), [seg("c1", 600), seg("c2", 500), seg("c3", 400)]
        router.directory.add(local.key, 0)
        router.directory.add(pulled.key, 2)
        run = start(cluster, router, dispatch, [local, pulled, *cold])
        expected = await cluster.wait_sent(0, Expect, 3)  # everything not built on the combine node
        [pull] = await cluster.wait_sent(2, Pull, 1)
        await cluster.wait_sent(None, Build, 3)
        builds = {n: cluster.jobs(n, Build) for n in range(3)}
        assert key_of(pull.segment.key) == pulled.key and pull.segment.token_ids == ()
        assert sorted(len(j.segment.token_ids) for js in builds.values() for j in js) == [400, 500, 600]
        assert {j.transfer_id for j in expected} == {pull.transfer_id} | {j.transfer_id for n in (1, 2) for j in builds[n]}
        assert sum(n.pending_tokens for n in cluster.nodes.values()) == 1500
        deliver(cluster, dispatch, 2, pull, built=False)
        for source, jobs in builds.items():
            for job in jobs:
                deliver(cluster, dispatch, source, job)
        timings = await asyncio.wait_for(run, 5.0)
        assert (timings.segments, timings.segments_local, timings.segments_pulled, timings.segments_built) == (5, 1, 1, 3)
        assert timings.segments_remote == 2 and timings.workers == 3 and timings.transfer_bytes == 4000
        assert all(n.pending_tokens == 0 for n in cluster.nodes.values())
        assert all(Cancel("r") in n.link.sent for n in cluster.nodes.values())  # leftovers dropped everywhere
        assert all(router.directory.holders(s.key) >= {0} for s in cold)
    asyncio.run(main())


def test_a_failed_or_missing_segment_is_placed_again_away_from_its_source():
    async def main() -> None:
        cluster, router, dispatch = setup()
        pulled, cold = seg("pulled"), seg("cold", 900)
        router.directory.add(pulled.key, 1)
        cluster.nodes[0].pending_tokens = 5000  # the cold one goes to a worker, not the combine node
        run = start(cluster, router, dispatch, [pulled, cold])
        [pull] = await cluster.wait_sent(1, Pull, 1)
        [build] = await cluster.wait_sent(None, Build, 1)
        worker = next(n for n in (1, 2) if cluster.jobs(n, Build))
        dispatch.on_message(cluster.nodes[1], Progress("r", pull.transfer_id, "missing"))
        dispatch.on_message(cluster.nodes[worker], Progress("r", build.transfer_id, "failed"))
        await cluster.wait_sent(None, Build, 3)
        placed = {key_of(j.segment.key): n for n in range(3) for j in cluster.jobs(n, Build) if j != build}
        assert placed[pulled.key] != 1 and placed[cold.key] != worker
        assert 1 not in router.directory.holders(pulled.key)
        for node_id in range(3):
            for job in cluster.jobs(node_id, Build):
                if job != build:
                    deliver(cluster, dispatch, node_id, job)
        timings = await asyncio.wait_for(run, 5.0)
        assert timings.segments_redispatched == 2 and timings.segment_errors == 2
        assert [n.pending_tokens for n in cluster.nodes.values()] == [5000, 0, 0]
    asyncio.run(main())


def test_a_dead_worker_s_segments_move_and_a_late_original_still_counts():
    async def main() -> None:
        cluster, router, dispatch = setup()
        segments = [seg(f"s{i}") for i in range(6)]
        run = start(cluster, router, dispatch, segments)
        await cluster.wait_sent(1, Build, 2)
        lost = cluster.jobs(1, Build)
        cluster.nodes[1].link.closed.set()
        dispatch.on_node_down(cluster.nodes[1])
        moved = [*await cluster.wait_sent(0, Build, 3), *cluster.jobs(2, Build)]
        for node_id in (0, 2):
            for job in cluster.jobs(node_id, Build):
                deliver(cluster, dispatch, node_id, job)
        timings = await asyncio.wait_for(run, 5.0)
        assert timings.segments_redispatched == 2 and len(moved) == 6
        assert {key_of(j.segment.key) for j in lost} <= {key_of(j.segment.key) for j in moved}
        assert cluster.nodes[1].pending_tokens == 0
    asyncio.run(main())


def test_a_source_past_the_deadline_is_replaced():
    async def main() -> None:
        cluster, router, dispatch = setup(count=2, timeout=0.05)
        cluster.nodes[0].pending_tokens = 5000
        run = start(cluster, router, dispatch, [seg("slow")])
        [late] = await cluster.wait_sent(1, Build, 1)
        [replacement] = await cluster.wait_sent(0, Build, 1)  # the combine node: the only other one
        deliver(cluster, dispatch, 1, late)  # the original wins after all: done, the replacement is moot
        timings = await asyncio.wait_for(run, 5.0)
        assert timings.segment_timeouts == 1 and replacement.transfer_id != late.transfer_id
    asyncio.run(main())


def test_a_segment_the_combine_node_itself_cannot_build_is_left_to_its_engine():
    async def main() -> None:
        cluster, router, dispatch = setup(count=2)
        cluster.nodes[1].pending_tokens = 5000
        run = start(cluster, router, dispatch, [seg("huge"), seg("fine")])
        jobs = await cluster.wait_sent(0, Build, 2)
        dispatch.on_message(cluster.nodes[0], Progress("r", jobs[0].transfer_id, "failed"))
        deliver(cluster, dispatch, 0, jobs[1])
        timings = await asyncio.wait_for(run, 5.0)
        assert timings.segments_redispatched == 0 and timings.segment_errors == 1
    asyncio.run(main())


def test_losing_the_combine_node_aborts_the_dispatch():
    async def main() -> None:
        cluster, router, dispatch = setup()
        run = start(cluster, router, dispatch, [seg("a"), seg("b"), seg("c")])
        await cluster.wait_sent(0, Expect, 1)
        dispatch.on_node_down(cluster.nodes[0])
        with pytest.raises(CombineLost):
            await asyncio.wait_for(run, 5.0)
        assert all(n.pending_tokens == 0 for n in cluster.nodes.values())
        assert Cancel("r") in cluster.nodes[1].link.sent
    asyncio.run(main())
