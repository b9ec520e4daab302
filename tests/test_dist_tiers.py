"""Segment tiers across a `--workers 2` cluster (CPU): a node holding a document only in its host
tier serves a pull from there (the directory knows the tier from the node's reports), and the pulling
node's output is the single engine's."""
from __future__ import annotations

import asyncio
import contextlib

import pytest
from engine_util import Finished
from test_dist_cluster import LoopThread, assert_same, generate
from test_engine_tiers import jobs, tier_config

from hypic import AsyncEngine
from hypic.dist.client import start_cluster
from hypic.dist.config import DistConfig
from engine_util import collect, greedy

pytestmark = pytest.mark.timeout(300)
PARAMS = greedy(4, logprobs=0)
FIRST, SECOND, AGAIN = jobs()[0], jobs()[1], jobs()[3]  # documents 0, 1, then 0 with another question


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> tuple[dict[str, Finished], int]:
    """One engine with an unbounded pool: the outputs, and the bytes of one document's entry."""
    async def main():
        async with AsyncEngine(tier_config(tiny_model_dir)) as engine:
            outs = {p: await collect(engine, p, PARAMS) for p in (FIRST, SECOND, AGAIN)}
            return outs, engine.core.store.stats().bytes // 2
    return asyncio.run(main())


def on_loop(loop: LoopThread, read):
    """read() on the cluster's event loop: the directory is that loop's, changed there by the nodes'
    tier reports (read from this thread, it could change mid-read)."""
    async def main():
        return read()
    return loop.run(main())


def settled(loop: LoopThread, client, read, timeout_s: float = 30.0):
    """read()'s value once truthy, re-read on the loop at each heartbeat (a node's tier report
    follows its heartbeat), or its value after timeout_s."""
    with contextlib.suppress(TimeoutError):
        loop.run(client.cluster.wait_until(lambda _: bool(read()), timeout_s), timeout=timeout_s + 10)
    return on_loop(loop, read)


def test_a_document_held_only_in_a_host_tier_is_pulled_from_there(tiny_model_dir, reference):
    ref, entry = reference
    config = tier_config(tiny_model_dir, segment_pool_bytes=entry * 3 // 2, segment_host_bytes=entry * 4)
    dist = DistConfig(min_remote_tokens=1 << 20, heartbeat_s=0.05, node_timeout_s=5.0)  # cold ones stay put
    loop, client = LoopThread(), start_cluster(config, 2, None, "cpu", dist)
    try:
        loop.run(client.start(), timeout=200)
        directory = client.router.directory
        # Routing is pinned, not left to what the nodes report on shared cores: their loads, and
        # whether their last heartbeat is fresh (a node 0.1 s late looks busy, and the request goes
        # straight to the other one, unplanned, without pulling from the holder)
        client.cluster.responsive = lambda nodes: nodes
        assert_same(generate(loop, client, FIRST, "first"), ref[FIRST])
        holders = on_loop(loop, lambda: [n for n in client.cluster.nodes if directory.held(n)])  # learnt as it ended
        assert len(holders) == 1
        holder, other = holders[0], next(n for n in client.cluster.nodes if n != holders[0])
        client.router.choose_combine = lambda *_: holder
        assert_same(generate(loop, client, SECOND, "second"), ref[SECOND])
        # the second document evicted the first from the holder's one-entry pool into its host tier
        demoted = settled(loop, client, lambda: [k for k, tier in directory.held(holder).items() if tier == "host"])
        assert len(demoted) == 1
        assert not on_loop(loop, lambda: directory.held(other))
        client.router.choose_combine = lambda *_: other  # steer the request away from its document
        again = generate(loop, client, AGAIN, "again")
        assert_same(again, ref[AGAIN])
        assert again.metrics.dist.segments_pulled == 1 and again.metrics.dist.segments_built == 0
        host = loop.run(client.probe(holder)).stats["segment_host"]
        assert host["hits"] == host["promotions"] == 1  # served from the host tier, not recomputed
        assert on_loop(loop, lambda: directory.tier(demoted[0], other)) == "pool"
    finally:
        loop.run(client.shutdown(0.0), timeout=60)
        loop.close()
