"""Segment parallelism on GPUs: CUDA tensors over the TCP data plane (staged after their event),
NCCL point-to-point between two GPUs, and clusters of engines on GPUs against one engine."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from engine_util import GPU_SHARE, collect, greedy
from test_dist_cluster import COLD, MIXED, WARM, LoopThread, assert_idle, generate
from pic_util import pic_config

from hypic import AsyncEngine
from hypic.dist.config import DistConfig
from hypic.dist.client import start_cluster
from hypic.dist.tcp_transport import TcpTransport
from hypic.dist.transport import allocate, spec_of

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]


def two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    pytest.importorskip("cupy")


def payload(device: str) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(1024, 1024, device=device, generator=g).to(torch.bfloat16),
            torch.randn(3, 5, device=device, generator=g),
            torch.randint(0, 1 << 30, (77,), device=device, generator=g)]


def test_cuda_tensors_cross_tcp_after_the_event_that_completes_them():
    async def main() -> None:
        a, b = TcpTransport(), TcpTransport()
        await a.start("tcp://127.0.0.1:0")
        await b.start("tcp://127.0.0.1:0")
        source = payload("cuda")
        written = [torch.empty_like(t) for t in source]
        torch.cuda._sleep(50_000_000)  # the copies below finish long after the host moves on
        for dst, src in zip(written, source):
            dst.copy_(src)
        ready = torch.cuda.current_stream().record_event()
        arrival = b.expect(1, "r", allocate([spec_of(t) for t in source], torch.device("cpu")))
        await a.send(b.address, 1, "r", written, ready=ready)
        got = await arrival
        assert all(torch.equal(x, y.cpu()) for x, y in zip(got.tensors, source))
        await a.close(); await b.close()
    asyncio.run(main())


def test_nccl_moves_tensors_between_two_gpus_into_preallocated_destinations():
    two_gpus()
    from hypic.dist.nccl_transport import NcclTransport

    async def main() -> None:
        a, b = NcclTransport(torch.device("cuda:0")), NcclTransport(torch.device("cuda:1"))
        await a.start("tcp://127.0.0.1:0")
        await b.start("tcp://127.0.0.1:0")
        for transfer_id in (1, 2):  # the second reuses the communicator
            source = payload("cuda:0")
            ready = torch.cuda.current_stream(torch.device("cuda:0")).record_event()
            dests = allocate([spec_of(t) for t in source], torch.device("cuda:1"))
            arrival = b.expect(transfer_id, "r", dests)
            await a.send(b.address, transfer_id, "r", source, ready=ready)
            got = await arrival
            assert got.preallocated and got.tensors[0].data_ptr() == dests[0].data_ptr()
            assert all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(got.tensors, source))
        await a.close(); await b.close()
    asyncio.run(main())


@pytest.mark.parametrize("layout", ["two_nodes_one_gpu_tcp", "two_gpus_nccl"])
def test_a_gpu_cluster_matches_one_engine(layout, slow_decay_model_dir):
    if layout == "two_gpus_nccl":
        two_gpus()
    config = dataclasses.replace(pic_config(slow_decay_model_dir), device="cuda", dtype="float32",
                                 gpu_memory_utilization=GPU_SHARE)

    async def reference():
        async with AsyncEngine(config) as engine:
            return [await collect(engine, p, greedy(4, logprobs=0)) for p in (COLD, WARM, MIXED)]
    want = asyncio.run(reference())
    torch.cuda.empty_cache()  # the nodes size their caches from what is free
    gpus = [0] if layout == "two_nodes_one_gpu_tcp" else [0, 1]
    loop = LoopThread()
    client = start_cluster(config, 2, gpus, "cuda", DistConfig(min_remote_tokens=0))
    try:
        loop.run(client.start(), timeout=600)
        for text, expected in zip((COLD, WARM, MIXED), want):
            got = generate(loop, client, text, f"gpu-{len(text)}")
            assert got.tokens == expected.tokens
            assert [x.logprob for x in got.logprobs[0]] == pytest.approx(
                [x.logprob for x in expected.logprobs[0]], abs=2e-3)
        assert client.stats().dist.segments_remote >= 1
        assert_idle(loop, client)
    finally:
        loop.run(client.shutdown(0.0), timeout=120)
        loop.close()
