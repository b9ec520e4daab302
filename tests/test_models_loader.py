"""Weight loading: in-memory dicts, expert layouts, random benchmark weights, and the errors."""
from __future__ import annotations

import json
from functools import cache

import pytest
import torch

from hypic.errors import UnsupportedModelError
from hypic.models.config import HybridConfig
from hypic.models.random_weights import random_state_dict
from hypic.models.registry import load_model
from models_util import (BatchBuilder, fuse_experts, hf_logits, make_hf_model, random_ids, read_checkpoint,
                         rel_err, run, save_checkpoint)

CPU = torch.device("cpu")


@cache
def hf_model(kind: str) -> torch.nn.Module:
    return make_hf_model(kind, seed=7)


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    builder = BatchBuilder(model.config)
    return run(model, builder, [(builder.new_seq(slot=1), ids)])


def test_in_memory_state_dict_matches_transformers(tmp_path) -> None:
    """transformers' own in-memory names (fused experts, prefix model.) load with state_dict=."""
    hf = hf_model("qwen3_next")
    hf.config.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), device=CPU, dtype=torch.float32, state_dict=hf.state_dict())
    ids = random_ids(16, seed=8)
    assert rel_err(_logits(model, ids), hf_logits(hf, ids)) < 1e-4


def test_transposed_fused_experts_load(tmp_path) -> None:
    hf = hf_model("qwen3_5_moe_text")
    path = save_checkpoint(hf, tmp_path, rewrite=lambda t: fuse_experts(t, transposed=True))
    model = load_model(str(path), device=CPU, dtype=torch.float32)
    ids = random_ids(16, seed=9)
    assert rel_err(_logits(model, ids), hf_logits(hf, ids)) < 1e-4


def test_random_weights_are_transformers_compatible(tmp_path) -> None:
    """random_state_dict's names and shapes are exactly transformers' (strict load), and logits agree."""
    hf = hf_model("qwen3_5_moe_text")
    hf.config.save_pretrained(tmp_path)
    config = HybridConfig.from_pretrained(tmp_path)
    weights = random_state_dict(config, device=CPU, dtype=torch.float32, seed=3, std=0.1)
    reference = make_hf_model("qwen3_5_moe_text", seed=0)
    reference.load_state_dict(weights, strict=True)
    model = load_model(str(tmp_path), device=CPU, dtype=torch.bfloat16, state_dict=weights)
    assert model.layers[0].linear_attn.A_log.dtype == torch.float32  # decay parameters stay float32
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    model = load_model(str(tmp_path), device=CPU, dtype=torch.float32, state_dict=weights)
    ids = random_ids(16, seed=10)
    assert rel_err(_logits(model, ids), hf_logits(reference, ids)) < 1e-4


def _saved_tensors(tmp_path) -> dict[str, torch.Tensor]:
    save_checkpoint(hf_model("qwen3_5_text"), tmp_path)
    return read_checkpoint(tmp_path)


def test_missing_weights_are_listed(tmp_path) -> None:
    tensors = _saved_tensors(tmp_path)
    del tensors["model.layers.2.linear_attn.in_proj_z.weight"]
    with pytest.raises(UnsupportedModelError, match=r"1 missing weights \[layers.2.linear_attn.in_proj_z.weight\]"):
        load_model(str(tmp_path), device=CPU, dtype=torch.float32, state_dict=tensors)


def test_unexpected_weights_are_listed(tmp_path) -> None:
    tensors = _saved_tensors(tmp_path)
    tensors["model.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(2, 2)
    tensors["decoder.head.weight"] = torch.zeros(2)
    with pytest.raises(UnsupportedModelError, match=r"2 unexpected weights \[layers.0.mlp.experts.0.up_proj.weight, "
                                                    r"decoder.head.weight\]"):
        load_model(str(tmp_path), device=CPU, dtype=torch.float32, state_dict=tensors)


def test_wrong_shapes_are_reported(tmp_path) -> None:
    tensors = _saved_tensors(tmp_path)
    tensors["model.layers.3.self_attn.q_norm.weight"] = torch.zeros(7)
    with pytest.raises(UnsupportedModelError, match=r"layers.3.self_attn.q_norm.weight \(7,\) \(config says \(16,\)\)"):
        load_model(str(tmp_path), device=CPU, dtype=torch.float32, state_dict=tensors)


def test_directory_without_safetensors_is_reported(tmp_path) -> None:
    hf_model("qwen3_5_text").config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="no \\*.safetensors"):
        load_model(str(tmp_path), device=CPU, dtype=torch.float32)


def test_unsupported_model_type_is_reported(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba2"}))
    with pytest.raises(UnsupportedModelError, match="mamba2"):
        load_model(str(tmp_path), device=CPU, dtype=torch.float32)
