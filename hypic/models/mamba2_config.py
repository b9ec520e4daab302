"""Mamba2HybridConfig: the shape of a Mamba2 hybrid (Nemotron-H / Nemotron 3, Granite-4.0-H, Bamba),
parsed from a Hugging Face config.json.

Every model is read as a flat list of residual blocks, h += m * block(norm(h)), each one of
"mamba", "attention", "mlp" or "moe": Nemotron-H lists its blocks itself (`hybrid_override_pattern`
or `layers_block_type`); a Granite or Bamba decoder layer is two blocks, its mixer then its MLP.
Block indices are the cache's layer ids.

dt is clamped to `time_step_limit` (default (0, inf), no clamp), as Granite's and Bamba's
transformers code and the reference Mamba2 kernels do; transformers' Nemotron-H prefill alone clamps
at time_step_min instead (its own decode does not).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from hypic.errors import UnsupportedModelError
from hypic.models.config import LayerIds, as_ids, check_shape, expert_problems, group_problems, pick, require

MAMBA2_MODEL_TYPES: tuple[str, ...] = ("nemotron_h", "granitemoehybrid", "bamba")
BLOCK_KINDS: tuple[str, ...] = ("mamba", "attention", "mlp", "moe")
PATTERN_CHARS: dict[str, str] = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
# layer-type names of the new and the legacy transformers configs
LAYER_TYPE_NAMES: dict[str, str] = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention",
                                    "attention": "attention", "mlp": "mlp", "moe": "moe"}
_REQUIRED = ("vocab_size", "hidden_size", "num_attention_heads")


@dataclass(frozen=True)
class Mamba2HybridConfig(LayerIds):
    model_type: str  # one of MAMBA2_MODEL_TYPES
    vocab_size: int
    hidden_size: int
    blocks: tuple[str, ...]  # residual blocks in order, each one of BLOCK_KINDS
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # full attention: no q/k norm, no output gate; RoPE on rotary_dim channels (0: none)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    attention_scale: float
    rotary_dim: int
    rope_theta: float
    # Mamba2
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    conv_bias: bool
    time_step_limit: tuple[float, float]
    mamba_norm_eps: float
    # MLP / MoE: "relu2" (up, down) or "silu" (gated: gate, up, down)
    mlp_act: str
    intermediate_size: int  # dense MLP (Nemotron "-" blocks, Bamba) or Granite's shared MLP
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_intermediate_size: int  # Nemotron's shared expert (0: none); added ungated
    router: str  # "softmax" (top-k renormalised) or "sigmoid_grouped" (DeepSeek-V3 style)
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    # Granite's multipliers (1.0 elsewhere); logits are divided by logits_scaling
    embedding_multiplier: float
    residual_multiplier: float
    logits_scaling: float
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Mamba2HybridConfig:
        model_type = config.get("model_type")
        if model_type not in _PARSERS:
            raise UnsupportedModelError(f"model_type {model_type!r} is not a Mamba2 hybrid ({MAMBA2_MODEL_TYPES})")
        require(config, _REQUIRED)
        _refuse_variants(config)
        parsed = cls(**_common(config), **_PARSERS[model_type](config))
        parsed._validate()
        return parsed

    # ---- derived values -------------------------------------------------------------------------

    FULL, LINEAR = "attention", "mamba"

    def layer_kinds(self) -> tuple[str, ...]:
        return self.blocks

    @property
    def attn_qk_norm(self) -> bool:
        return False

    @property
    def attn_output_gate(self) -> bool:
        return False

    @cached_property
    def mamba_intermediate(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @cached_property
    def mamba_conv_dim(self) -> int:
        """Channels of the conv over [x | B | C]."""
        return self.mamba_intermediate + 2 * self.n_groups * self.ssm_state_size

    def _validate(self) -> None:
        check_shape(self.model_type, _shape_problems(self))


# ---- parsing ---------------------------------------------------------------------------------------

def _common(c: dict[str, Any]) -> dict[str, Any]:
    heads = c["num_attention_heads"]
    return {"model_type": c["model_type"], "vocab_size": c["vocab_size"], "hidden_size": c["hidden_size"],
            "num_attention_heads": heads, "num_key_value_heads": c.get("num_key_value_heads") or heads,
            "head_dim": c.get("head_dim") or c["hidden_size"] // heads,
            "eos_token_ids": as_ids(c.get("eos_token_id")), "bos_token_id": c.get("bos_token_id"),
            "pad_token_id": c.get("pad_token_id"),
            "time_step_limit": tuple(_as_float(x) for x in pick(c, "time_step_limit", "mamba_dt_limit",
                                                                 default=(0.0, math.inf)))}


def _as_float(value: float | dict[str, str]) -> float:
    """A number, or transformers' JSON form of a non-finite one ({"__float__": "Infinity"})."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def _nemotron_h(c: dict[str, Any]) -> dict[str, Any]:
    """NemotronHConfig: blocks from the pattern or the layer-type list; relu2 MLPs and experts, the
    DeepSeek router; no positional encoding in attention (transformers' NemotronHAttention)."""
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    eps = c.get("layer_norm_epsilon", 1e-5)
    experts = pick(c, "n_routed_experts", "num_local_experts", default=8)
    return {
        "blocks": _nemotron_blocks(c), "rms_norm_eps": eps,
        "tie_word_embeddings": False,  # transformers' NemotronHForCausalLM keeps lm_head even when asked to tie
        "max_position_embeddings": c.get(
            "max_position_embeddings", 4096), "attention_bias": False, "attention_scale": head_dim ** -0.5,
        "rotary_dim": 0, "rope_theta": 10000.0,
        "mamba_num_heads": c.get("mamba_num_heads", 128), "mamba_head_dim": c.get("mamba_head_dim", 64),
        "ssm_state_size": c.get("ssm_state_size", 128), "n_groups": pick(c, "n_groups", "mamba_n_groups", default=8),
        "conv_kernel": pick(c, "conv_kernel", "mamba_d_conv", default=4),
        "conv_bias": pick(c, "use_conv_bias", "mamba_conv_bias", default=True), "mamba_norm_eps": eps,
        "mlp_act": c.get("mlp_hidden_act", "relu2"), "intermediate_size": c.get("intermediate_size", 21504),
        "num_experts": experts, "num_experts_per_tok": c.get("num_experts_per_tok", 2),
        "moe_intermediate_size": c.get("moe_intermediate_size", 7688),
        "shared_intermediate_size": c.get("moe_shared_expert_intermediate_size", 7688)
        if c.get("n_shared_experts", 1) else 0,
        "router": "sigmoid_grouped", "n_group": c.get("n_group", 1), "topk_group": c.get("topk_group", 1),
        "routed_scaling_factor": float(c.get("routed_scaling_factor", 1.0)),
        "norm_topk_prob": c.get("norm_topk_prob", True),
        "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0}


def _nemotron_blocks(c: dict[str, Any]) -> tuple[str, ...]:
    pattern = c.get("hybrid_override_pattern")
    if pattern is not None:
        unknown = sorted(set(pattern) - set(PATTERN_CHARS))
        if unknown:
            raise UnsupportedModelError(
                f"hybrid_override_pattern has unknown characters {unknown}; hypic knows {sorted(PATTERN_CHARS)}")
        return tuple(PATTERN_CHARS[ch] for ch in pattern)
    return _named_blocks(pick(c, "layers_block_type", "layer_types"), "layers_block_type")


def _named_blocks(names: list[str] | None, field: str) -> tuple[str, ...]:
    if not names:
        raise UnsupportedModelError(f"config.json lacks {field} (the layer types)")
    unknown = sorted(set(names) - set(LAYER_TYPE_NAMES))
    if unknown:
        raise UnsupportedModelError(f"{field} has unknown layer types {unknown}; hypic knows {sorted(LAYER_TYPE_NAMES)}")
    return tuple(LAYER_TYPE_NAMES[n] for n in names)


def _granite_style(c: dict[str, Any], mixers: tuple[str, ...], mlp: str, rotary_dim: int) -> dict[str, Any]:
    """Fields Granite-4.0-H and Bamba share: the mamba_* names, silu MLPs, a (mixer, MLP) pair a layer."""
    hidden, heads = c["hidden_size"], c.get("mamba_n_heads", 128)
    head_dim = c.get("mamba_d_head", "auto")
    eps = c.get("rms_norm_eps", 1e-6 if c["model_type"] == "granitemoehybrid" else 1e-5)
    rope = c.get("rope_parameters") or {}
    return {
        "blocks": tuple(b for mixer in mixers for b in (mixer, mlp)), "rms_norm_eps": eps,
        "tie_word_embeddings": bool(c.get("tie_word_embeddings", False)),
        "max_position_embeddings": c.get("max_position_embeddings", 2048),
        "attention_bias": c.get("attention_bias", False), "rotary_dim": rotary_dim,
        "rope_theta": float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        "mamba_num_heads": heads,
        "mamba_head_dim": c.get("mamba_expand", 2) * hidden // heads if head_dim == "auto" else head_dim,
        "ssm_state_size": c.get("mamba_d_state", 256), "n_groups": c.get("mamba_n_groups", 1),
        "conv_kernel": c.get("mamba_d_conv", 4), "conv_bias": c.get("mamba_conv_bias", True), "mamba_norm_eps": eps,
        "mlp_act": c.get("hidden_act", "silu"), "router": "softmax", "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "norm_topk_prob": True}


def _granitemoehybrid(c: dict[str, Any]) -> dict[str, Any]:
    """GraniteMoeHybridConfig: MoE (num_local_experts > 0) beside an always-present shared MLP,
    RoPE only with position_embedding_type 'rope', attention scaled by attention_multiplier."""
    experts = c.get("num_local_experts", 8)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    rope = c.get("position_embedding_type") == "rope"
    mixers = _named_blocks(pick(c, "layer_types", "layers_block_type"), "layer_types")
    return {**_granite_style(c, mixers, "moe" if experts else "mlp", head_dim if rope else 0),
            "attention_scale": float(c.get("attention_multiplier", 1.0)),
            "intermediate_size": c.get("shared_intermediate_size", 1024), "num_experts": experts,
            "num_experts_per_tok": c.get("num_experts_per_tok", 2) if experts else 0,
            "moe_intermediate_size": c.get("intermediate_size", 11008) if experts else 0,
            "shared_intermediate_size": 0, "embedding_multiplier": float(c.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(c.get("residual_multiplier", 1.0)),
            "logits_scaling": float(c.get("logits_scaling", 1.0))}


def _bamba(c: dict[str, Any]) -> dict[str, Any]:
    """BambaConfig: full attention at attn_layer_indices, RoPE on half of each head (transformers
    fixes partial_rotary_factor at 0.5), dense SwiGLU MLPs."""
    layers, attention = c.get("num_hidden_layers", 32), set(c.get("attn_layer_indices") or ())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    mixers = tuple("attention" if i in attention else "mamba" for i in range(layers))
    return {**_granite_style(c, mixers, "mlp", head_dim // 2), "attention_scale": head_dim ** -0.5,
            "intermediate_size": c.get("intermediate_size", 14336), "num_experts": 0, "num_experts_per_tok": 0,
            "moe_intermediate_size": 0, "shared_intermediate_size": 0, "embedding_multiplier": 1.0,
            "residual_multiplier": 1.0, "logits_scaling": 1.0}


_PARSERS = {"nemotron_h": _nemotron_h, "granitemoehybrid": _granitemoehybrid, "bamba": _bamba}

# Fields that select a variant hypic does not implement: (field, value that is fine)
_REFUSED: tuple[tuple[str, Any], ...] = (
    ("moe_latent_size", None), ("sliding_window", None), ("mamba_proj_bias", False), ("use_bias", False),
    ("mlp_bias", False), ("residual_in_fp32", False))


def _refuse_variants(c: dict[str, Any]) -> None:
    for name, fine in _REFUSED:
        if c.get(name) not in (None, fine):
            raise UnsupportedModelError(f"{c['model_type']} with {name}={c[name]!r} is not supported "
                                        f"(hypic serves {name}={fine!r})")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise UnsupportedModelError(f"rope_type {rope.get('rope_type', rope.get('type'))!r} is not supported "
                                    "(only default RoPE)")


def _shape_problems(c: Mamba2HybridConfig) -> list[str]:
    problems = []
    if c.mamba_num_heads % c.n_groups:
        problems.append(f"mamba heads {c.mamba_num_heads} not divisible by n_groups {c.n_groups}")
    if c.num_attention_heads % c.num_key_value_heads:
        problems.append("num_attention_heads must be a multiple of num_key_value_heads")
    if c.mlp_act not in ("relu2", "silu"):
        problems.append(f"MLP activation {c.mlp_act!r} (hypic knows relu2 and silu)")
    if c.model_type == "nemotron_h" and c.mlp_act != "relu2":
        problems.append(f"mlp_hidden_act {c.mlp_act!r} (Nemotron-H blocks are relu2)")
    if c.rotary_dim % 2 or c.rotary_dim > c.head_dim:
        problems.append(f"rotary dim {c.rotary_dim} must be even and at most head_dim {c.head_dim}")
    problems += expert_problems(c, "moe" in c.blocks, "blocks")
    problems += group_problems(c, c.router == "sigmoid_grouped" and "moe" in c.blocks)
    if not c.linear_layers:
        problems.append("no Mamba2 block")
    return problems
