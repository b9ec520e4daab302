"""KimiLinearConfig: the shape of a Kimi-Linear model (KDA + MLA + DeepSeek-style MoE), parsed from a
Hugging Face config.json as the release ships it or as transformers saves it.

Traps: `linear_attn_config`'s `kda_layers` / `full_attn_layers` are 1-based; the release names MoE
fields after its own code (num_experts, num_experts_per_token, moe_renormalize, num_expert_group)
where transformers' in-memory config has the DeepSeek names; Kimi-Linear's MLA uses no positional
encoding at all (`mla_use_nope`), its decoupled "rope" key part is shared by the heads unrotated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypic.errors import UnsupportedModelError
from hypic.models.config import LayerIds, as_ids, check_shape, expert_problems, group_problems, pick, require

KIMI_MODEL_TYPES: tuple[str, ...] = ("kimi_linear",)
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_LINEAR_ATTN_KEYS = frozenset({"kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size"})


@dataclass(frozen=True)
class KimiLinearConfig(LayerIds):
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # "linear_attention" (KDA) or "full_attention" (MLA), 0-based
    moe_layers: tuple[int, ...]  # layers with a MoE MLP (the others: the dense intermediate_size MLP)
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # KDA
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    # MLA
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    # MLP / MoE (SwiGLU experts, sigmoid grouped top-k router with a score-correction bias)
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> KimiLinearConfig:
        if config.get("model_type") not in KIMI_MODEL_TYPES:
            raise UnsupportedModelError(f"model_type {config.get('model_type')!r} is not Kimi-Linear")
        require(config, _REQUIRED, null_is_missing=True)
        _refuse_variants(config)
        parsed = cls(**_fields(config))
        parsed._validate()
        return parsed

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rotary_dim(self) -> int:
        """No RoPE anywhere (NoPE MLA): PIC scatters cached latents unrotated."""
        return 0

    @property
    def rope_theta(self) -> float:
        return 10000.0  # unused without rotary channels; the PIC scatter asks for it

    @property
    def latent_dim(self) -> int:
        """Per-token width of an MLA page: the kv latent and the shared (unrotated) rope key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def _validate(self) -> None:
        check_shape(self.model_type, _shape_problems(self))


def _fields(c: dict[str, Any]) -> dict[str, Any]:
    linear = c.get("linear_attn_config") or {}
    layers = c["num_hidden_layers"]
    return {
        "model_type": c["model_type"], "vocab_size": c["vocab_size"], "hidden_size": c["hidden_size"],
        "num_hidden_layers": layers, "layer_types": _layer_types(c, linear, layers), "moe_layers": _moe_layers(c),
        "rms_norm_eps": c.get("rms_norm_eps", 1e-5),
        "max_position_embeddings": pick(c, "model_max_length", "max_position_embeddings", default=1048576),
        "tie_word_embeddings": bool(c.get("tie_word_embeddings", False)),
        "linear_num_heads": pick(linear, "num_heads", default=c.get("linear_num_heads", 32)),
        "linear_head_dim": pick(linear, "head_dim", default=c.get("linear_head_dim", 128)),
        "linear_conv_kernel_dim": pick(linear, "short_conv_kernel_size", default=c.get("linear_conv_kernel_dim", 4)),
        "num_attention_heads": c["num_attention_heads"], "q_lora_rank": c.get("q_lora_rank"),
        "kv_lora_rank": c["kv_lora_rank"], "qk_nope_head_dim": c["qk_nope_head_dim"],
        "qk_rope_head_dim": c["qk_rope_head_dim"], "v_head_dim": c["v_head_dim"],
        "attention_bias": bool(c.get("attention_bias", False)),
        "intermediate_size": c.get("intermediate_size", 9216), "moe_intermediate_size": c.get("moe_intermediate_size", 1024),
        "num_experts": pick(c, "num_experts", "num_local_experts", "n_routed_experts", default=256),
        "num_experts_per_tok": pick(c, "num_experts_per_token", "num_experts_per_tok", default=8),
        "num_shared_experts": pick(c, "num_shared_experts", "n_shared_experts", default=1),
        "n_group": pick(c, "num_expert_group", "n_group", default=1), "topk_group": c.get("topk_group") or 1,
        "norm_topk_prob": bool(pick(c, "moe_renormalize", "norm_topk_prob", default=True)),
        "routed_scaling_factor": float(c.get("routed_scaling_factor", 1.0)),
        "eos_token_ids": as_ids(c.get("eos_token_id")), "bos_token_id": c.get("bos_token_id"),
        "pad_token_id": c.get("pad_token_id")}


def _layer_types(c: dict[str, Any], linear: dict[str, Any], layers: int) -> tuple[str, ...]:
    """From the 1-based lists of linear_attn_config (checked against layer_types when both are given),
    else layer_types."""
    if "kda_layers" in linear or "full_attn_layers" in linear:
        kda, full = list(linear.get("kda_layers") or ()), list(linear.get("full_attn_layers") or ())
        if sorted(kda + full) != list(range(1, layers + 1)):
            raise UnsupportedModelError(
                f"linear_attn_config kda_layers {kda} and full_attn_layers {full} must together list the "
                f"1-based layers 1..{layers} once each")
        types = tuple("full_attention" if i + 1 in full else "linear_attention" for i in range(layers))
        if c.get("layer_types") and tuple(c["layer_types"]) != types:
            raise UnsupportedModelError(f"layer_types {c['layer_types']} disagree with linear_attn_config's "
                                        f"1-based kda_layers {kda} / full_attn_layers {full}")
        return types
    types = tuple(c.get("layer_types") or ())
    if len(types) != layers or set(types) - {"linear_attention", "full_attention"}:
        raise UnsupportedModelError(f"layer_types {list(types)} must name linear_attention or full_attention for "
                                    f"each of the {layers} layers (or give linear_attn_config's layer lists)")
    return types


def _moe_layers(c: dict[str, Any]) -> tuple[int, ...]:
    """mlp_layer_types ("dense" / "sparse") when given, else MoE from first_k_dense_replace on."""
    kinds = c.get("mlp_layer_types")
    if kinds is None:
        first = c.get("first_k_dense_replace", 1)
        return tuple(range(first, c["num_hidden_layers"]))
    if len(kinds) != c["num_hidden_layers"] or set(kinds) - {"dense", "sparse"}:
        raise UnsupportedModelError(f"mlp_layer_types {kinds} must be 'dense' or 'sparse' for every layer")
    return tuple(i for i, kind in enumerate(kinds) if kind == "sparse")


# Fields that select a variant hypic does not implement: (field, the values that are fine)
_REFUSED: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("mla_use_nope", (None, True)), ("hidden_act", (None, "silu")), ("moe_router_activation_func", (None, "sigmoid")),
    ("moe_layer_freq", (None, 1)), ("use_grouped_topk", (None, True)), ("num_nextn_predict_layers", (None, 0)),
    ("sliding_window", (None,)), ("rope_scaling", (None,)), ("attn_res", (None,)), ("attention_residual", (None,)),
    ("attn_residual_blocks", (None,)), ("num_mtp_layers", (None, 0)), ("pretraining_tp", (None, 1)))


def _refuse_variants(c: dict[str, Any]) -> None:
    for name, fine in _REFUSED:
        if c.get(name) not in fine:
            raise UnsupportedModelError(f"kimi_linear with {name}={c[name]!r} is not supported "
                                        f"(hypic serves {name} in {[v for v in fine if v is not None] or 'unset'})")
    unknown = sorted(set(c.get("linear_attn_config") or {}) - _LINEAR_ATTN_KEYS)
    if unknown:
        raise UnsupportedModelError(f"linear_attn_config fields {unknown} are not supported "
                                    f"(hypic knows {sorted(_LINEAR_ATTN_KEYS)})")


def _shape_problems(c: KimiLinearConfig) -> list[str]:
    problems = expert_problems(c, bool(c.moe_layers), "layers") + group_problems(c, bool(c.moe_layers))
    if not c.linear_layers:
        problems.append("no KDA layer")
    return problems
