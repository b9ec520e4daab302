"""HybridConfig parsing: every supported model type, nested text configs, derived values, errors."""
from __future__ import annotations

import json

import pytest
import torch

from hypic.errors import UnsupportedModelError
from hypic.models.config import HybridConfig
from hypic.models.qwen3_next import HybridModel

BASE = dict(vocab_size=320, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8,
            linear_value_head_dim=12, linear_conv_kernel_dim=4, intermediate_size=96)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32)


def test_layer_roles_from_full_attention_interval() -> None:
    config = HybridConfig.from_dict({**BASE, "model_type": "qwen3_5_text", "full_attention_interval": 4})
    assert config.full_layers == (3, 7)
    assert config.linear_layers == (0, 1, 2, 4, 5, 6)
    assert config.moe_layers == ()


def test_layer_roles_from_layer_types() -> None:
    types = ["full_attention", "linear_attention"] * 4
    config = HybridConfig.from_dict({**BASE, "model_type": "qwen3_5_text", "layer_types": types})
    assert config.full_layers == (0, 2, 4, 6)
    assert config.linear_layers == (1, 3, 5, 7)


def test_qwen3_next_moe_layers_follow_sparse_step_and_mlp_only_layers() -> None:
    config = HybridConfig.from_dict({**BASE, **MOE, "model_type": "qwen3_next", "decoder_sparse_step": 2,
                                     "mlp_only_layers": [3]})
    assert config.moe_layers == (1, 5, 7)


def test_qwen3_5_moe_text_is_moe_everywhere() -> None:
    config = HybridConfig.from_dict({**BASE, **MOE, "model_type": "qwen3_5_moe_text"})
    assert config.moe_layers == tuple(range(8))


def test_nested_text_config_of_a_multimodal_checkpoint() -> None:
    text = {**BASE, **MOE, "model_type": "qwen3_5_moe_text", "eos_token_id": 7,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                "mrope_interleaved": True, "mrope_section": [11, 11, 10]}}
    config = HybridConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": text,
                                     "vision_config": {"depth": 2}, "tie_word_embeddings": True})
    assert (config.model_type, config.multimodal, config.tie_word_embeddings) == ("qwen3_5_moe_text", True, True)
    assert (config.rope_theta, config.rotary_dim, config.eos_token_ids) == (1e7, 4, (7,))


def test_legacy_top_level_rope_fields_and_defaults() -> None:
    config = HybridConfig.from_dict({**BASE, "model_type": "qwen3_next", "rope_theta": 5e6, "rope_scaling": None})
    assert (config.rope_theta, config.partial_rotary_factor) == (5e6, 0.25)  # transformers' default factor
    assert config.attn_output_gate


def test_cache_shape() -> None:
    with torch.device("meta"):
        shape = HybridModel(HybridConfig.from_dict({**BASE, "model_type": "qwen3_5_text"})).cache_shape()
    assert (shape.full_layers, shape.num_kv_heads, shape.head_dim) == ((3, 7), 2, 16)
    for linear in shape.linear:
        assert linear.family.name == "gdn"
        assert (linear.value_heads, linear.key_dim, linear.value_dim) == (6, 8, 12)
        assert (linear.conv_dim, linear.conv_kernel) == (2 * 2 * 8 + 6 * 12, 4)
    assert len(shape.linear) == len(shape.linear_layers) and shape.conv_kernel == 4


def test_generation_config_eos_ids_are_added(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "model_type": "qwen3_5_text", "eos_token_id": 5}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [6, 5]}))
    assert HybridConfig.from_pretrained(tmp_path).eos_token_ids == (5, 6)


def test_unknown_model_type_names_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModelError, match="qwen3_next.*qwen3_5_text"):
        HybridConfig.from_dict({**BASE, "model_type": "llama"})


@pytest.mark.parametrize("change, message", [
    ({"linear_num_value_heads": 5}, "multiple of linear_num_key_heads"),
    ({"hidden_act": "gelu"}, "silu"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
])
def test_invalid_configs_are_rejected(change: dict, message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        HybridConfig.from_dict({**BASE, "model_type": "qwen3_5_text", **change})


def test_missing_text_config_is_reported() -> None:
    with pytest.raises(UnsupportedModelError, match="text_config"):
        HybridConfig.from_dict({"model_type": "qwen3_5"})
