"""The model on CUDA (FLA / Triton kernels): logits against transformers on the CPU, in float32 and
bfloat16, through prefill chunks, mixed batches and decode steps; a decode step captured in a CUDA graph."""
from __future__ import annotations

import pytest
import torch

from hypic.models.registry import load_model
from models_util import (assert_cuda_graph_decode_replays, hf_torch_logits, make_hf_model, mixed_steps_logits,
                         rel_err, save_checkpoint)

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
# A tiny random net is touchy in bf16: transformers' own bf16 logits are ~17% (relative L2) off its fp32
# ones on these checkpoints; a wrong kernel is off by ~100%.
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 0.3}


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe_text"])
def checkpoint(request, tmp_path_factory):
    hf = make_hf_model(request.param, seed=11)
    return hf, save_checkpoint(hf, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_chunks_batches_and_decodes_match_transformers(checkpoint, dtype) -> None:
    _, path = checkpoint
    prompts, logits = mixed_steps_logits(load_model(str(path), device=CUDA, dtype=dtype), CUDA, dtype)
    lengths = (150, 64, 33)
    expected = hf_torch_logits(path, [prompts[b][:n] for b, n in enumerate(lengths)])
    for b in range(len(lengths)):
        assert rel_err(logits[b], expected[b]) < TOLERANCE[dtype], f"sequence {b}"


def test_decode_step_replays_from_a_cuda_graph(checkpoint) -> None:
    assert_cuda_graph_decode_replays(checkpoint[1])
