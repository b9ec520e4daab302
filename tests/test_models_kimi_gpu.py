"""Kimi-Linear on CUDA (FLA chunk_kda, the Triton KDA decode, the Triton latent MLA kernel, the
DeepSeek-style MoE) against the CPU path on the same weights: prefill chunks, mixed batches and
decodes per dtype; chunks long enough that MLA expands (flash attention over expanded K/V) beside
latent ones; a decode step replayed from a CUDA graph; the whole engine in every cache mode, and with the
fused KDA decode step against the unfused path."""
from __future__ import annotations

import pytest
import torch

import kimi_models
from engine_util import greedy
from hypic.models.kda import KimiDeltaAttention
from hypic.models.mixer import LinearMixer
from hypic.models.registry import load_model
from models_util import (BatchBuilder, assert_cuda_graph_decode_replays, assert_cuda_matches_cpu, random_ids, rel_err,
                         run, save_checkpoint)
from pic_util import DOCS, assert_gpu_engine_matches_cpu_engine, engine_run, logprobs, prompt

pytestmark = pytest.mark.gpu
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 0.3}  # tiny random nets are touchy in bf16 (see test_models_gpu)
CASES = {"release": {}, "q-lora": {"q_lora_rank": 16}}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    return save_checkpoint(kimi_models.make(seed=11, **CASES[request.param]), tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_chunks_batches_and_decodes_match_cpu(checkpoint, dtype) -> None:
    assert_cuda_matches_cpu(checkpoint, dtype, TOLERANCE[dtype])


def expanding_steps_logits(checkpoint, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """A 330-token prompt in chunks of 200 (expands: square) and 130 (expands over 330 keys) beside a
    short latent chunk of another sequence, then a decode of each: every step's logits."""
    model = load_model(str(checkpoint), device=device, dtype=dtype)
    mla = model.layers[model.config.full_layers[0]].mixer
    assert 30 < mla.expand_from <= 130
    builder = BatchBuilder(model.config, block_size=16, num_blocks=64, num_slots=8, dtype=dtype, device=device)
    long, short = builder.new_seq(slot=2), builder.new_seq(slot=6)
    prompt, other = random_ids(330, seed=21), random_ids(31, seed=22)
    steps = [[(long, prompt[:200]), (short, other[:30])], [(short, other[30:]), (long, prompt[200:])],
             [(long, [5]), (short, [9])]]
    return [run(model, builder, pieces).float().cpu() for pieces in steps]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_expanded_prefill_matches_cpu(checkpoint, dtype) -> None:
    expected = expanding_steps_logits(checkpoint, torch.device("cpu"), torch.float32)
    for step, (got, want) in enumerate(zip(expanding_steps_logits(checkpoint, torch.device("cuda"), dtype), expected)):
        assert rel_err(got, want) < TOLERANCE[dtype], f"step {step}"


def test_decode_step_replays_from_a_cuda_graph(checkpoint) -> None:
    assert_cuda_graph_decode_replays(checkpoint)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return kimi_models.make_model_dir(tmp_path_factory.mktemp("kimi_gpu"), slow_decay=True)


@pytest.mark.parametrize("mode", ["none", "hypic", "naive"])
def test_gpu_engine_matches_cpu_engine(model_dir, mode) -> None:
    assert_gpu_engine_matches_cpu_engine(model_dir, mode)


@pytest.mark.parametrize("mode", ["none", "hypic"])
def test_fused_kda_decode_serves_as_the_unfused_path(model_dir, mode, monkeypatch) -> None:
    """Greedy decodes (CUDA graphs replaying the fused step) pick the tokens, at the logprobs, that the
    mixer's unfused path (conv, operands, recurrence and norm apart) picks."""
    jobs = [(prompt(*DOCS), greedy(12, logprobs=0)), ("hello world, the quick brown fox", greedy(9, logprobs=0))]
    fused = engine_run(model_dir, "cuda", jobs, cache_mode=mode)
    monkeypatch.setattr(KimiDeltaAttention, "forward", LinearMixer.shared_path)
    unfused = engine_run(model_dir, "cuda", jobs, cache_mode=mode)
    for fused_outs, unfused_outs in zip(fused, unfused):
        for f, u in zip(fused_outs, unfused_outs):
            assert f.tokens == u.tokens
            assert logprobs(f) == pytest.approx(logprobs(u), abs=1e-4)
