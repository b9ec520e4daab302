"""Kimi-Linear on CUDA (FLA chunk_kda, the Triton KDA decode, the Triton latent MLA kernel, the
DeepSeek-style MoE) against the CPU path on the same weights: prefill chunks, mixed batches and
decodes per dtype; a decode step replayed from a CUDA graph; the whole engine in every cache mode."""
from __future__ import annotations

import pytest
import torch

import kimi_models
from engine_util import greedy
from hypic.models.registry import load_model
from models_util import (BatchBuilder, assert_decode_replays, mixed_steps_logits, random_ids, rel_err, run,
                         save_checkpoint)
from pic_util import DOCS, prompt
from test_pic_gpu import engine_run

pytestmark = pytest.mark.gpu
CUDA, CPU = torch.device("cuda"), torch.device("cpu")
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 0.3}  # tiny random nets are touchy in bf16 (see test_models_gpu)
CASES = {"release": {}, "q-lora": {"q_lora_rank": 16}}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    return save_checkpoint(kimi_models.make(seed=11, **CASES[request.param]), tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_chunks_batches_and_decodes_match_cpu(checkpoint, dtype) -> None:
    _, expected = mixed_steps_logits(load_model(str(checkpoint), device=CPU, dtype=torch.float32), CPU, torch.float32)
    _, actual = mixed_steps_logits(load_model(str(checkpoint), device=CUDA, dtype=dtype), CUDA, dtype)
    for b, (got, want) in enumerate(zip(actual, expected)):
        assert rel_err(got, want) < TOLERANCE[dtype], f"sequence {b}"


def test_decode_step_replays_from_a_cuda_graph(checkpoint) -> None:
    model = load_model(str(checkpoint), device=CUDA, dtype=torch.bfloat16)
    builder = BatchBuilder(model.config, block_size=16, num_blocks=32, num_slots=8, dtype=torch.bfloat16,
                           device=CUDA)
    seqs = [builder.new_seq(slot=s) for s in (2, 6, 3)]
    run(model, builder, [(seq, random_ids(20 + 9 * i, seed=i)) for i, seq in enumerate(seqs)])
    assert_decode_replays(model, builder, builder.batch([(seq, [7 + i]) for i, seq in enumerate(seqs)]))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return kimi_models.make_model_dir(tmp_path_factory.mktemp("kimi_gpu"), slow_decay=True)


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
