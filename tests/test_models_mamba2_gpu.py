"""The Mamba2 hybrids on CUDA (FLA simple GLA, Triton decode, conv with bias, relu2 MoE) against the
CPU path on the same weights: prefill chunks, mixed batches and decodes per model type and dtype; a
decode step replayed from a CUDA graph; the whole engine in every cache mode."""
from __future__ import annotations

import pytest
import torch

import mamba2_models
from models_util import assert_cuda_graph_decode_replays, assert_cuda_matches_cpu, save_checkpoint
from pic_util import assert_gpu_engine_matches_cpu_engine

pytestmark = pytest.mark.gpu
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 0.3}  # tiny random nets are touchy in bf16 (see test_models_gpu)
# head dims of at least 16 everywhere: FLA's chunk kernels tile by 16
KINDS = {"nemotron_h": {"mamba_head_dim": 16}, "granitemoehybrid": {"position_embedding_type": "rope"}, "bamba": {}}


@pytest.fixture(scope="module", params=list(KINDS))
def checkpoint(request, tmp_path_factory):
    hf = mamba2_models.make(request.param, seed=11, **KINDS[request.param])
    return save_checkpoint(hf, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_chunks_batches_and_decodes_match_cpu(checkpoint, dtype) -> None:
    assert_cuda_matches_cpu(checkpoint, dtype, TOLERANCE[dtype])


def test_decode_step_replays_from_a_cuda_graph(checkpoint) -> None:
    assert_cuda_graph_decode_replays(checkpoint)


@pytest.fixture(scope="module", params=["nemotron_h", "bamba"])
def model_dir(request, tmp_path_factory):
    return mamba2_models.make_model_dir(tmp_path_factory.mktemp(request.param), request.param, slow_decay=True,
                                        **KINDS[request.param])


@pytest.mark.parametrize("mode", ["none", "hypic", "naive"])
def test_gpu_engine_matches_cpu_engine(model_dir, mode) -> None:
    assert_gpu_engine_matches_cpu_engine(model_dir, mode)
