"""Kimi-Linear (KDA + MLA + DeepSeek-style MoE) against transformers' full forward: logits to 1e-4
relative on tiny random checkpoints, greedy tokens, prefill + decode = one forward, chunked prefill
and batching; latent-space (absorbed) MLA attention = the expanded form; latent page bytes.

Cases and the traps they hold: the release layout transformers saves (separate q/k/v convs,
block_sparse_moe, per-expert w1/w2/w3, A_log [1, 1, H, 1]) and transformers' in-memory layout
(conv1d, forget_gate.*, fused experts); q LoRA or not; MoE from layer 1 or layer 2 (first_k_dense_replace);
MLA in the middle or first (1-based full_attn_layers [3] / [1, 4]).
"""
from __future__ import annotations

import dataclasses
import json
from functools import cache
from pathlib import Path

import pytest
import torch

import kimi_models
from hypic.errors import UnsupportedModelError
from hypic.models.kimi_config import KimiLinearConfig
from hypic.models.kimi_linear import KimiLinearModel
from hypic.models.registry import load_model
from models_util import (BatchBuilder, assert_chunks_beside_other_sequences_change_nothing,
                         assert_greedy_decode_tracks_full_forward, guarded, hf_logits, random_ids, rel_err, run,
                         save_checkpoint)

CPU = torch.device("cpu")
MLA_FIRST = {"kda_layers": [2, 3], "full_attn_layers": [1, 4], "head_dim": 16, "num_heads": 4,
             "short_conv_kernel_size": 4}
CASES: dict[str, tuple[dict, bool]] = {  # overrides, saved in transformers' in-memory layout
    "release": ({}, False),
    "q-lora-in-memory-dense2": ({"q_lora_rank": 12, "first_k_dense_replace": 2}, True),
    "mla-first": ({"linear_attn_config": MLA_FIRST}, False),
}


@cache
def hf_model(case: str) -> torch.nn.Module:
    return kimi_models.make(**CASES[case][0])


@cache
def loaded(case: str, tmp_root: str) -> torch.nn.Module:
    hf = hf_model(case)
    in_memory = (lambda _: dict(hf.state_dict())) if CASES[case][1] else None
    path = save_checkpoint(hf, Path(tmp_root) / case, rewrite=in_memory)
    return load_model(str(path), device=CPU, dtype=torch.float32)


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("kimi"))


@pytest.mark.parametrize("case,length", [(case, 75) for case in CASES] + [("mla-first", 150)])
def test_logits_match_transformers(case: str, length: int, tmp_root: str) -> None:
    """75 tokens: two chunks of the KDA reference, MLA in the latent form; 150: MLA expands."""
    model = loaded(case, tmp_root)
    builder = BatchBuilder(model.config)
    ids = random_ids(length, seed=1)
    assert rel_err(run(model, builder, [(builder.new_seq(slot=5), ids)]), hf_logits(hf_model(case), ids)) < 1e-4


@pytest.mark.parametrize("case", ["release", "q-lora-in-memory-dense2"])
def test_greedy_decode_equals_full_forward(case: str, tmp_root: str) -> None:
    """Prefill, then one token a step (MLA decodes in the latent space): every step's logits are
    transformers' full forward's last row and the greedy tokens are the same."""
    assert_greedy_decode_tracks_full_forward(loaded(case, tmp_root), hf_model(case), steps=5)


def test_chunked_prefill_and_batching_change_nothing(tmp_root: str) -> None:
    assert_chunks_beside_other_sequences_change_nothing(loaded("release", tmp_root))


@pytest.mark.parametrize("case", ["release", "q-lora-in-memory-dense2"])
def test_latent_attention_equals_expanded(case: str, tmp_root: str) -> None:
    """The absorbed form (queries through W_uk, MQA over the latent rows, W_uv after) equals
    attention over per-head K/V expanded from the same pages, for every token of a prefill."""
    from hypic.kernels.mla_attention import write_latents

    model = loaded(case, tmp_root)
    layer = model.layers[model.config.full_layers[0]].mixer
    builder = BatchBuilder(model.config)
    batch = builder.batch([(builder.new_seq(slot=0), random_ids(30, seed=8))])
    pages = builder.caches.kv(model.config.full_layers[0])[0]
    hidden = torch.randn(30, model.config.hidden_size, generator=torch.Generator().manual_seed(9))
    write_latents(layer.latents(hidden), pages, batch.kv_write_slots)
    q = layer.queries(hidden)
    absorbed = layer.attend_absorbed(q, pages, batch, slice(0, 1), slice(0, 30))
    expanded = layer.attend_expanded(q, pages, batch, 0, slice(0, 30))
    assert rel_err(absorbed, expanded) < 1e-5 and expanded.shape == (30, 4, 12)
    assert 75 < layer.expand_from <= 150  # the logits tests' prompts take both forms


def test_forward_reads_no_device_tensor_on_the_host(tmp_root: str) -> None:
    """Model code never turns a batch tensor, or anything computed from it, into Python values (on the GPU
    a sync; in a CUDA-graph capture an error). A decode, a chunk long enough that MLA expands and a short
    one, eager and as captured into a graph (every sequence in one latent pass), run guarded against such
    reads and give the unguarded eager logits."""
    model = loaded("release", tmp_root)

    def last_step(wrap) -> torch.Tensor:
        builder = BatchBuilder(model.config)
        first, long, short = (builder.new_seq(slot=s) for s in (1, 2, 3))
        run(model, builder, [(first, random_ids(30, seed=3))])
        batch = builder.batch([(first, [7]), (long, random_ids(150, seed=4)), (short, random_ids(20, seed=5))])
        return model.compute_logits(model(wrap(batch), builder.caches))
    expected = last_step(lambda batch: batch)
    assert rel_err(last_step(guarded), expected) == 0.0
    # as captured, the host KV lengths would be the capture batch's: here there are none, so a reader fails
    graphed = last_step(lambda batch: guarded(dataclasses.replace(batch, in_graph=True, kv_lens_cpu=())))
    assert rel_err(graphed, expected) < 1e-5
    assert 20 < model.layers[model.config.full_layers[0]].mixer.expand_from <= 150  # eager: both MLA forms


def test_latent_pages_hold_rank_plus_rope_channels_a_token() -> None:
    """KV bytes per token per MLA layer, bf16, for the Kimi-Linear-48B-A3B shape: the latent row
    (512 + 64 channels) against per-head K (32 x 192) and V (32 x 128) expanded."""
    config = KimiLinearConfig.from_dict(json.loads((Path(__file__).parent / "data" / "kimi_linear_48b.json")
                                                   .read_text()))
    with torch.device("meta"):
        shape = KimiLinearModel(config).cache_shape()
    per_token_layer = shape.page_bytes(1, torch.bfloat16) // len(shape.full_layers)
    expanded = 2 * config.num_attention_heads * (config.qk_head_dim + config.v_head_dim)
    assert shape.full_layers == (3, 7, 11, 15, 19, 23, 26) and len(shape.linear_layers) == 20
    assert per_token_layer == 2 * (config.kv_lora_rank + config.qk_rope_head_dim) == 1152
    assert expanded == 20480  # the expanded cache a token and layer: 17.8x the latent
    from hypic.cache.segment_store import SegmentLayout

    layout = SegmentLayout.from_cache_shape(shape, torch.bfloat16, torch.bfloat16)
    assert layout.block_bytes(1024)[3] == 1024 * len(shape.full_layers) * per_token_layer  # cached segments too


# ---- configs ---------------------------------------------------------------------------------------

@cache
def saved_config() -> dict:
    import tempfile

    path = tempfile.mkdtemp()
    kimi_models.make().config.save_pretrained(path)
    return json.loads(Path(path, "config.json").read_text())


def test_layer_lists_are_one_based() -> None:
    release = {k: v for k, v in saved_config().items() if k not in ("layer_types", "mlp_layer_types")}
    config = KimiLinearConfig.from_dict(release)
    assert config.linear_layers == (0, 1, 3) and config.full_layers == (2,) and config.moe_layers == (1, 2, 3)
    assert config.num_experts == 8 and config.num_experts_per_tok == 3 and config.n_group == 4


@pytest.mark.parametrize("change,field", [
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
    ({"attn_residual_blocks": 4}, "attn_residual_blocks"),
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
    ({"linear_attn_config": {**MLA_FIRST, "gate_lower_bound": -5.0}}, "gate_lower_bound"),
    ({"linear_attn_config": {**MLA_FIRST, "kda_layers": [1, 2, 3]}}, "kda_layers"),
    ({"layer_types": ["full_attention"] * 4}, "layer_types"),
])
def test_unsupported_variants_fail_at_load_naming_the_field(change: dict, field: str, tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**saved_config(), **change}))
    with pytest.raises(UnsupportedModelError, match=field):
        load_model(str(tmp_path), device=CPU, dtype=torch.float32)


def test_random_weights_are_transformers_compatible_and_load_without_a_second_copy(tmp_path) -> None:
    """random_state_dict's Kimi names and shapes are transformers' in-memory ones (strict load), the
    logits agree, and the loaded experts are the very tensors given (the 48B benchmark's memory)."""
    from hypic.models.random_weights import random_state_dict

    hf = kimi_models.make(q_lora_rank=12)
    save_checkpoint(hf, tmp_path)
    weights = random_state_dict(KimiLinearConfig.from_dict(json.loads((tmp_path / "config.json").read_text())),
                                device=CPU, dtype=torch.float32, seed=3, std=0.1)
    hf.load_state_dict(weights, strict=True)
    model = load_model(str(tmp_path), device=CPU, dtype=torch.float32, state_dict=weights)
    assert model.layers[1].mlp.experts_gate_up.data_ptr() == weights["model.layers.1.mlp.experts.gate_up_proj"].data_ptr()
    builder, ids = BatchBuilder(model.config), random_ids(20, seed=10)
    assert rel_err(run(model, builder, [(builder.new_seq(slot=0), ids)]), hf_logits(hf, ids)) < 1e-4
