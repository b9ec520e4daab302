"""hypic's logits equal transformers' on tiny random checkpoints of every supported model type and layout."""
from __future__ import annotations

from collections.abc import Callable
from functools import cache

import pytest
import torch

from hypic.models.registry import load_model
from models_util import (BatchBuilder, add_mtp_and_vision, fuse_experts, hf_logits, make_hf_model, random_ids,
                         rel_err, run, save_checkpoint)

CPU = torch.device("cpu")


@cache
def hf_model(kind: str, tied: bool = False) -> torch.nn.Module:
    return make_hf_model(kind, **({"tie_word_embeddings": True} if tied else {}))


def _fused_with_mtp(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return add_mtp_and_vision(fuse_experts(tensors))


CASES: dict[str, tuple[str, dict, Callable | None, int]] = {
    # name: (kind, save_checkpoint kwargs, rewrite, tokens); 75 tokens span two 64-token GDN chunks
    "qwen3_next-per-expert": ("qwen3_next", {}, None, 75),
    "qwen3_next-fused-experts": ("qwen3_next", {}, fuse_experts, 24),
    "qwen3_5_text-sharded": ("qwen3_5_text", {"max_shard_size": "40KB"}, None, 75),
    "qwen3_5_moe_text-per-expert-sharded": ("qwen3_5_moe_text", {"max_shard_size": "60KB"}, None, 24),
    "qwen3_5_moe_text-fused-mtp-vision": ("qwen3_5_moe_text", {}, _fused_with_mtp, 24),
    "qwen3_5-multimodal-mtp": ("qwen3_5", {}, add_mtp_and_vision, 24),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case: str, tmp_path) -> None:
    kind, save_kwargs, rewrite, length = CASES[case]
    hf = hf_model(kind)
    path = save_checkpoint(hf, tmp_path, rewrite=rewrite, **save_kwargs)
    if "sharded" in case:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    model = load_model(str(path), device=CPU, dtype=torch.float32)
    builder = BatchBuilder(model.config)
    ids = random_ids(length, seed=1)
    assert rel_err(run(model, builder, [(builder.new_seq(slot=5), ids)]), hf_logits(hf, ids)) < 1e-4


def test_tied_embeddings_match_transformers(tmp_path) -> None:
    hf = hf_model("qwen3_5_text", tied=True)
    model = load_model(str(save_checkpoint(hf, tmp_path)), device=CPU, dtype=torch.float32)
    assert model.config.tie_word_embeddings
    builder = BatchBuilder(model.config)
    ids = random_ids(20, seed=2)
    assert rel_err(run(model, builder, [(builder.new_seq(slot=0), ids)]), hf_logits(hf, ids)) < 1e-4
