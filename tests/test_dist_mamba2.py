"""Segment parallelism (CPU) serving a Mamba2 hybrid: two engine processes joined by TCP give the
single engine's tokens and logprobs (the Qwen cluster tests' claims, in brief, on Nemotron-H)."""
from __future__ import annotations

import asyncio

import pytest

from engine_util import collect
from hypic import AsyncEngine
from hypic.dist.config import DistConfig
from hypic.dist.client import start_cluster
from test_dist_cluster import PARAMS, LoopThread, assert_idle, assert_same, generate
from pic_util import DOCS, pic_config, prompt
from test_pic_mamba2 import nemotron_dir  # noqa: F401 (the fixture)

pytestmark = pytest.mark.timeout(600)


def test_segment_parallel_cluster_matches_one_engine(nemotron_dir) -> None:
    """Two engine processes (TCP): a cold request's segments are built on both nodes, shipped (S0,
    log-decay T, conv tails, K/V) and composed, and give the single engine's tokens and logprobs."""
    text = prompt(*DOCS)

    async def one_engine():
        async with AsyncEngine(pic_config(nemotron_dir)) as engine:
            return await collect(engine, text, PARAMS)
    reference = asyncio.run(one_engine())
    loop = LoopThread()
    # round robin: the nodes' reported loads (what LPT weighs) depend on timing on shared cores
    dist = DistConfig(min_remote_tokens=0, assignment="round_robin", heartbeat_s=0.2, node_timeout_s=10.0,
                      segment_timeout_s=120.0)
    client = start_cluster(pic_config(nemotron_dir), 2, None, "cpu", dist)
    try:
        loop.run(client.start(), timeout=300)
        got = generate(loop, client, text, "cold")
        assert_same(got, reference)
        assert got.metrics.dist.segments == 3 and got.metrics.dist.segments_remote >= 1
        assert_idle(loop, client)
    finally:
        loop.run(client.shutdown(0.0), timeout=120)
        loop.close()
