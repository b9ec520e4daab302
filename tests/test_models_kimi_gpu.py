"""Kimi-Linear on CUDA (FLA chunk_kda, the Triton KDA decode, the Triton latent MLA kernel, the
DeepSeek-style MoE) against the CPU path on the same weights: prefill chunks, mixed batches and
decodes per dtype; a decode step replayed from a CUDA graph; the whole engine in every cache mode."""
from __future__ import annotations

import pytest
import torch

import kimi_models
from models_util import assert_cuda_graph_decode_replays, assert_cuda_matches_cpu, save_checkpoint
from pic_util import assert_gpu_engine_matches_cpu_engine

pytestmark = pytest.mark.gpu
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 0.3}  # tiny random nets are touchy in bf16 (see test_models_gpu)
CASES = {"release": {}, "q-lora": {"q_lora_rank": 16}}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    return save_checkpoint(kimi_models.make(seed=11, **CASES[request.param]), tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_chunks_batches_and_decodes_match_cpu(checkpoint, dtype) -> None:
    assert_cuda_matches_cpu(checkpoint, dtype, TOLERANCE[dtype])


def test_decode_step_replays_from_a_cuda_graph(checkpoint) -> None:
    assert_cuda_graph_decode_replays(checkpoint)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return kimi_models.make_model_dir(tmp_path_factory.mktemp("kimi_gpu"), slow_decay=True)


@pytest.mark.parametrize("mode", ["none", "hypic", "naive"])
def test_gpu_engine_matches_cpu_engine(model_dir, mode) -> None:
    assert_gpu_engine_matches_cpu_engine(model_dir, mode)
