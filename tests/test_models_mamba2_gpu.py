"""The Mamba2 hybrids on CUDA (FLA simple GLA, Triton decode, conv with bias, relu2 MoE) against the
CPU path on the same weights: prefill chunks, mixed batches and decodes per model type and dtype; a
decode step replayed from a CUDA graph; the whole engine in every cache mode."""
from __future__ import annotations

import asyncio

import pytest
import torch

import mamba2_models
from engine_util import collect, greedy
from hypic import AsyncEngine, EngineConfig
from hypic.models.registry import load_model
from models_util import BatchBuilder, random_ids, rel_err, run, save_checkpoint
from test_pic_engine import DOCS, prompt

pytestmark = pytest.mark.gpu
CUDA, CPU = torch.device("cuda"), torch.device("cpu")
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 0.3}  # tiny random nets are touchy in bf16 (see test_models_gpu)
# head dims of at least 16 everywhere: FLA's chunk kernels tile by 16
KINDS = {"nemotron_h": {"mamba_head_dim": 16}, "granitemoehybrid": {"position_embedding_type": "rope"}, "bamba": {}}


@pytest.fixture(scope="module", params=list(KINDS))
def checkpoint(request, tmp_path_factory):
    hf = mamba2_models.make(request.param, seed=11, **KINDS[request.param])
    return save_checkpoint(hf, tmp_path_factory.mktemp(request.param))


def steps_logits(path, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """Two fresh prefills, then a decode beside a continued prefill and a third fresh one, then decodes:
    each sequence's logits, concatenated over the steps."""
    model = load_model(str(path), device=device, dtype=dtype)
    builder = BatchBuilder(model.config, block_size=16, num_blocks=64, num_slots=8, dtype=dtype, device=device)
    prompts = [random_ids(n, seed=n) for n in (150, 70, 33)]
    seqs = [builder.new_seq(slot=s) for s in (5, 1, 7)]
    logits: list[list[torch.Tensor]] = [[], [], []]
    steps = [[(seqs[0], prompts[0][:100]), (seqs[1], prompts[1][:60])],
             [(seqs[1], prompts[1][60:61]), (seqs[0], prompts[0][100:]), (seqs[2], prompts[2][:30])]]
    steps += [[(seqs[b], prompts[b][n:n + 1]) for b, n in ((1, 61 + i), (2, 30 + i))] for i in range(3)]
    for pieces in steps:
        out, start = run(model, builder, pieces).float().cpu(), 0
        for seq, tokens in pieces:
            logits[seqs.index(seq)].append(out[start:start + len(tokens)])
            start += len(tokens)
    return [torch.cat(per_seq) for per_seq in logits]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_chunks_batches_and_decodes_match_cpu(checkpoint, dtype) -> None:
    expected = steps_logits(checkpoint, CPU, torch.float32)
    for b, (got, want) in enumerate(zip(steps_logits(checkpoint, CUDA, dtype), expected)):
        assert rel_err(got, want) < TOLERANCE[dtype], f"sequence {b}"


def test_decode_step_replays_from_a_cuda_graph(checkpoint) -> None:
    model = load_model(str(checkpoint), device=CUDA, dtype=torch.bfloat16)
    builder = BatchBuilder(model.config, block_size=16, num_blocks=32, num_slots=8, dtype=torch.bfloat16,
                           device=CUDA)
    seqs = [builder.new_seq(slot=s) for s in (2, 6, 3)]
    run(model, builder, [(seq, random_ids(20 + 9 * i, seed=i)) for i, seq in enumerate(seqs)])
    batch = builder.batch([(seq, [7 + i]) for i, seq in enumerate(seqs)])
    config, caches = model.config, builder.caches
    tensors = [t for i in config.full_layers for t in caches.kv(i)]
    tensors += [t for i in config.linear_layers for t in caches.state(i)]
    saved = [t.clone() for t in tensors]

    def restore() -> None:
        for t, s in zip(tensors, saved):
            t.copy_(s)

    eager = model(batch, caches).clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        restore()
        model(batch, caches)  # warm-up (Triton compilation) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = model(batch, caches)
    restore()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, eager, rtol=1e-3, atol=1e-3)


@pytest.fixture(scope="module", params=["nemotron_h", "bamba"])
def model_dir(request, tmp_path_factory):
    return mamba2_models.make_model_dir(tmp_path_factory.mktemp(request.param), request.param, slow_decay=True,
                                        **KINDS[request.param])


def engine_run(path, device: str, jobs, **overrides):
    config = EngineConfig(model=str(path), device=device, dtype="float32", block_size=16, seam_width=4,
                          cpu_cache_bytes=64 << 20, gpu_memory_utilization=0.3, max_num_seqs=8, **overrides)

    async def main():
        async with AsyncEngine(config) as engine:
            firsts = await asyncio.gather(*(collect(engine, p, s) for p, s in jobs))  # cold, batched
            return firsts, [await collect(engine, p, s) for p, s in jobs]  # warm
    return asyncio.run(main())


@pytest.mark.parametrize("mode", ["none", "hypic", "naive"])
def test_gpu_engine_matches_cpu_engine(model_dir, mode) -> None:
    jobs = [(prompt(*DOCS), greedy(8, logprobs=0)), (prompt(DOCS[2], DOCS[0]), greedy(5, logprobs=0)),
            ("hello world, the quick brown fox", greedy(6, logprobs=0))]
    cpu = engine_run(model_dir, "cpu", jobs, cache_mode=mode)
    gpu = engine_run(model_dir, "cuda", jobs, cache_mode=mode)
    for cpu_outs, gpu_outs in zip(cpu, gpu):
        for c, g in zip(cpu_outs, gpu_outs):
            assert [x.logprob for x in g.logprobs[0]] == pytest.approx([x.logprob for x in c.logprobs[0]], abs=2e-3)
            assert g.tokens == c.tokens
    assert [g.metrics.cached_tokens for g in gpu[1]] == [c.metrics.cached_tokens for c in cpu[1]]
