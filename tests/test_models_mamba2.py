"""The Mamba2 hybrids (nemotron_h, granitemoehybrid, bamba) against transformers' full forward without
a cache (its cached decode clamps dt differently from its prefill): logits to 1e-4 relative on tiny
random checkpoints, greedy tokens, prefill + decode = one forward, chunked prefill and batching.

Traps and the cases that would fail without them: plain RMSNorm w.x and the gated norm (gate first,
groups of intermediate / n_groups; every case, norm weights moved off 1); n_groups 1 and > 1
(bamba vs the rest); attention without q/k norm or gate, NoPE (nemotron_h, granite-dense) or RoPE
(bamba: half the head, granite-moe-rope: all of it); Granite's multipliers (granite-*); relu2
experts and MLPs and the DeepSeek router (nemotron_h-*); dt_bias, D, conv bias (all), time_step_limit
(bamba-clamped); tied embeddings; MTP weights skipped; both expert layouts.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache

import pytest
import torch

import mamba2_models
from hypic.errors import UnsupportedModelError
from hypic.models.mamba2_config import Mamba2HybridConfig
from hypic.models.registry import load_model
from models_util import (BatchBuilder, assert_chunks_beside_other_sequences_change_nothing,
                         assert_greedy_decode_tracks_full_forward, hf_logits, random_ids, rel_err, run,
                         save_checkpoint)

CPU = torch.device("cpu")


def nemotron_fused(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory layout: model.* names, experts fused [E, I, H] / [E, H, I]; plus MTP."""
    out, experts = {"mtp.layers.0.mixer.in_proj.weight": torch.randn(8, 64)}, {}
    for name, tensor in tensors.items():
        name = name.replace("backbone.", "model.", 1)
        if ".mixer.experts." in name:
            prefix, rest = name.split(".mixer.experts.")
            expert, proj = rest.split(".")[:2]
            experts.setdefault((prefix, proj), {})[int(expert)] = tensor
        else:
            out[name] = tensor
    for (prefix, proj), by_expert in experts.items():
        out[f"{prefix}.mixer.experts.{proj}"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def granite_fused(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    renames = {"block_sparse_moe.input_linear.weight": "block_sparse_moe.experts.gate_up_proj",
               "block_sparse_moe.output_linear.weight": "block_sparse_moe.experts.down_proj",
               "block_sparse_moe.router.layer.weight": "block_sparse_moe.router.weight"}
    out = {}
    for name, tensor in tensors.items():
        for old, new in renames.items():
            name = name.replace(old, new)
        out[name] = tensor
    return out


CASES: dict[str, tuple[str, dict, Callable | None]] = {
    "nemotron_h": ("nemotron_h", {}, None),
    "nemotron_h-fused-tied-one-group": ("nemotron_h", {"n_groups": 1, "tie_word_embeddings": True}, nemotron_fused),
    "nemotron_h-odd-pattern-dense": ("nemotron_h", {"hybrid_override_pattern": "M-M*M--"}, None),
    "granite-moe-rope": ("granitemoehybrid", {"position_embedding_type": "rope"}, None),
    "granite-dense-nope-tied": ("granitemoehybrid", {"num_local_experts": 0, "tie_word_embeddings": True}, None),
    "granite-fused": ("granitemoehybrid", {}, granite_fused),
    "bamba": ("bamba", {}, None),
    "bamba-groups-clamped": ("bamba", {"mamba_n_groups": 2, "time_step_limit": (0.0, 0.5)}, None),
}


@cache
def hf_model(case: str) -> torch.nn.Module:
    kind, overrides, _ = CASES[case]
    return mamba2_models.make(kind, **overrides)


@cache
def loaded(case: str, tmp_root: str) -> torch.nn.Module:
    from pathlib import Path

    path = save_checkpoint(hf_model(case), Path(tmp_root) / case, rewrite=CASES[case][2])
    return load_model(str(path), device=CPU, dtype=torch.float32)


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("mamba2"))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case: str, tmp_root: str) -> None:
    model = loaded(case, tmp_root)
    builder = BatchBuilder(model.config)
    ids = random_ids(75, seed=1)  # 75 tokens: two chunks of the reference, ten of transformers'
    assert rel_err(run(model, builder, [(builder.new_seq(slot=5), ids)]), hf_logits(hf_model(case), ids)) < 1e-4


def test_time_step_limit_clamps(tmp_root: str) -> None:
    """The clamped case differs from the same weights unclamped by ten times the logits tolerance:
    the limit is live, and followed (the logits test passes)."""
    config = loaded("bamba-groups-clamped", tmp_root).config
    assert config.time_step_limit == (0.0, 0.5) and config.n_groups == 2
    unclamped = mamba2_models.make("bamba", mamba_n_groups=2)
    ids = random_ids(30, seed=4)
    assert rel_err(hf_logits(unclamped, ids), hf_logits(hf_model("bamba-groups-clamped"), ids)) > 1e-3


@pytest.mark.parametrize("case", ["nemotron_h", "granite-moe-rope", "bamba"])
def test_greedy_decode_equals_full_forward(case: str, tmp_root: str) -> None:
    """Prefill, then one token a step: every step's logits are transformers' full forward's last
    row (no cache) and the greedy tokens are the same."""
    assert_greedy_decode_tracks_full_forward(loaded(case, tmp_root), hf_model(case), steps=6)


@pytest.mark.parametrize("case", ["nemotron_h", "granite-moe-rope", "bamba"])
def test_chunked_prefill_and_batching_change_nothing(case: str, tmp_root: str) -> None:
    assert_chunks_beside_other_sequences_change_nothing(loaded(case, tmp_root))


# ---- configs ---------------------------------------------------------------------------------------

@cache
def saved_config(kind: str) -> dict:
    import tempfile

    path = tempfile.mkdtemp()
    mamba2_models.make(kind).config.save_pretrained(path)
    with open(f"{path}/config.json") as f:
        return json.load(f)


def test_nemotron_blocks_from_pattern_list_and_legacy_names() -> None:
    base = {k: v for k, v in saved_config("nemotron_h").items() if k not in ("layers_block_type", "layer_types")}
    legacy = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}
    from_pattern = Mamba2HybridConfig.from_dict({**base, "hybrid_override_pattern": "ME*M-EM"})
    from_legacy = Mamba2HybridConfig.from_dict({**base, "layers_block_type": [legacy[c] for c in "ME*M-EM"]})
    assert from_pattern.blocks == from_legacy.blocks == ("mamba", "moe", "attention", "mamba", "mlp", "moe", "mamba")
    assert from_pattern.linear_layers == (0, 3, 6) and from_pattern.full_layers == (2,)


def test_granite_and_bamba_layers_are_mixer_then_mlp() -> None:
    granite = Mamba2HybridConfig.from_dict({**saved_config("granitemoehybrid"),
                                            "layer_types": ["mamba", "attention", "mamba", "mamba"]})
    assert granite.blocks == ("mamba", "moe", "attention", "moe", "mamba", "moe", "mamba", "moe")
    assert granite.rotary_dim == 0 and granite.attention_scale == 0.2 and granite.mamba_head_dim == 16
    bamba = Mamba2HybridConfig.from_dict(saved_config("bamba"))
    assert bamba.blocks == ("mamba", "mlp", "attention", "mlp", "mamba", "mlp") and bamba.rotary_dim == 8


@pytest.mark.parametrize("kind,change,field", [
    ("nemotron_h", {"moe_latent_size": 32}, "moe_latent_size"),
    ("nemotron_h", {"sliding_window": 128}, "sliding_window"),
    ("granitemoehybrid", {"mamba_proj_bias": True}, "mamba_proj_bias"),
    ("nemotron_h", {"n_groups": 3}, "n_groups"),
    ("nemotron_h", {"hybrid_override_pattern": "M*X-"}, "hybrid_override_pattern"),
    ("granitemoehybrid", {"layer_types": ["mamba", "sliding_attention", "mamba", "mamba"]}, "layer_types"),
    ("bamba", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type"),
])
def test_unsupported_variants_fail_at_load_naming_the_field(kind: str, change: dict, field: str, tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**saved_config(kind), **change}))
    with pytest.raises(UnsupportedModelError, match=field):
        load_model(str(tmp_path), device=CPU, dtype=torch.float32)
