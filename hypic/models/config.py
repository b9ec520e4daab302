"""HybridConfig: the text model's shape, parsed from a Hugging Face config.json of any supported type."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

from hypic.errors import UnsupportedModelError

TEXT_MODEL_TYPES: tuple[str, ...] = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
MULTIMODAL_MODEL_TYPES: dict[str, str] = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = TEXT_MODEL_TYPES + tuple(MULTIMODAL_MODEL_TYPES)
LAYER_TYPES: tuple[str, ...] = ("linear_attention", "full_attention")

# transformers' defaults for fields a config.json may leave out (Qwen3NextConfig / Qwen3_5TextConfig).
_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "head_dim": 256, "attention_bias": False,
    "attn_output_gate": True, "max_position_embeddings": 32768, "tie_word_embeddings": False,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "intermediate_size": None,
    "num_experts": 0, "num_experts_per_tok": 0, "moe_intermediate_size": 0,
    "shared_expert_intermediate_size": 0, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": (), "bos_token_id": None, "pad_token_id": None,
}
ConfigT = TypeVar("ConfigT")
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


class LayerIds:
    """full_layers / linear_layers: the ids of a config's attention layers and of its linear-mixer
    layers, read from its list of layer kinds (`layer_types`; a subclass may name another list)."""

    FULL, LINEAR = "full_attention", "linear_attention"

    def layer_kinds(self) -> tuple[str, ...]:
        return self.layer_types

    @cached_property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds()) if k == self.FULL)

    @cached_property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds()) if k == self.LINEAR)


@dataclass(frozen=True)
class HybridConfig(LayerIds):
    """One hybrid (Gated DeltaNet + gated full attention) text model. Model-type differences live here,
    never in `if model_type` branches scattered through the layers."""

    model_type: str  # the text model type: one of TEXT_MODEL_TYPES
    multimodal: bool  # the checkpoint is a vision-language one; only its text model is served
    vocab_size: int  # rows of the embedding / lm head (padded past the tokenizer's vocabulary)
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    hidden_act: str
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    attn_output_gate: bool
    rope_theta: float
    partial_rotary_factor: float
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MLP / MoE
    intermediate_size: int | None
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    # special tokens
    eos_token_ids: tuple[int, ...]  # config.json eos plus generation_config.json eos
    bos_token_id: int | None
    pad_token_id: int | None

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> HybridConfig:
        """Parse a config.json dict; a multimodal config's nested text_config gives the text model."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; hypic serves {', '.join(SUPPORTED_MODEL_TYPES)}")
        multimodal = model_type in MULTIMODAL_MODEL_TYPES
        text = _text_config(config) if multimodal else config
        if multimodal:
            text = {**text, "model_type": MULTIMODAL_MODEL_TYPES[model_type]}
        values = _parse_text(text, outer=config if multimodal else {})
        parsed = cls(multimodal=multimodal, **values)
        parsed._validate()
        return parsed

    @classmethod
    def from_pretrained(cls, path: str | Path) -> HybridConfig:
        """Read <path>/config.json; eos ids of generation_config.json are added when that file exists."""
        return with_generation_eos(cls.from_dict(read_config_json(path)), path)

    # ---- derived values -------------------------------------------------------------------------

    @cached_property
    def moe_layers(self) -> tuple[int, ...]:
        """Layers whose MLP is the sparse MoE block (transformers' rule for each model type)."""
        if self.model_type == "qwen3_5_text" or self.num_experts == 0:
            return ()
        if self.model_type == "qwen3_5_moe_text":
            return tuple(range(self.num_hidden_layers))
        return tuple(i for i in range(self.num_hidden_layers)
                     if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)

    @cached_property
    def attention_scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def attn_qk_norm(self) -> bool:
        return True

    @cached_property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @cached_property
    def linear_key_dim(self) -> int:
        """Width of the q (and of the k) projection of a linear layer: H * K."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @cached_property
    def linear_value_dim(self) -> int:
        """Width of the v (and of the z) projection of a linear layer: HV * V."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @cached_property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    def _validate(self) -> None:
        check_shape(self.model_type, _shape_problems(self))


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedModelError(
            f"model_type {config['model_type']!r} needs a nested text_config in config.json; none found")
    return text


def _parse_text(text: dict[str, Any], outer: dict[str, Any]) -> dict[str, Any]:
    require(text, _REQUIRED)
    values = {k: text[k] for k in _REQUIRED}
    values.update({k: text.get(k, default) for k, default in _DEFAULTS.items()})
    if "tie_word_embeddings" in outer:  # a multimodal model ties (or not) at its top level
        values["tie_word_embeddings"] = outer["tie_word_embeddings"]
    values["mlp_only_layers"] = tuple(values["mlp_only_layers"] or ())
    values["eos_token_ids"] = as_ids(text.get("eos_token_id", outer.get("eos_token_id")))
    values["model_type"] = text["model_type"]
    values["layer_types"] = _layer_types(text)
    values.update(_rope(text))
    return values


def _layer_types(text: dict[str, Any]) -> tuple[str, ...]:
    if text.get("layer_types"):
        return tuple(text["layer_types"])
    interval = text.get("full_attention_interval", 4)
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(text["num_hidden_layers"]))


def _rope(text: dict[str, Any]) -> dict[str, float]:
    """rope_parameters (or the older rope_scaling) first, then top-level fields, then defaults.
    Qwen3.5's interleaved M-RoPE equals plain RoPE for text, whose three position ids coincide."""
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported (only default RoPE)")
    theta = params.get("rope_theta", text.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    return {"rope_theta": float(theta), "partial_rotary_factor": float(factor)}


def read_config_json(path: str | Path) -> dict[str, Any]:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise UnsupportedModelError(f"{config_file} not found: a model directory needs a config.json")
    return json.loads(config_file.read_text())


def with_generation_eos(config: ConfigT, path: str | Path) -> ConfigT:
    """`config` with the eos ids of <path>/generation_config.json added, when that file exists."""
    generation_file = Path(path) / "generation_config.json"
    if not generation_file.is_file():
        return config
    extra = as_ids(json.loads(generation_file.read_text()).get("eos_token_id"))
    return replace(config, eos_token_ids=config.eos_token_ids + tuple(i for i in extra if i not in config.eos_token_ids))


def as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def pick(config: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of `names` present (a field and its aliases: legacy or another release's), else `default`."""
    return next((config[n] for n in names if config.get(n) is not None), default)


def require(config: dict[str, Any], names: tuple[str, ...], *, null_is_missing: bool = False) -> None:
    missing = [k for k in names if k not in config or (null_is_missing and config[k] is None)]
    if missing:
        raise UnsupportedModelError(f"config.json lacks {', '.join(missing)}")


def check_shape(model_type: str, problems: list[str]) -> None:
    if problems:
        raise UnsupportedModelError(f"unsupported {model_type} config: {'; '.join(problems)}")


def expert_problems(c: Any, has_moe: bool, what: str) -> list[str]:
    """MoE layers need experts to route to and a width for them."""
    if has_moe and not (0 < c.num_experts_per_tok <= c.num_experts and c.moe_intermediate_size > 0):
        return [f"MoE {what} need 0 < num_experts_per_tok <= num_experts and moe_intermediate_size"]
    return []


def group_problems(c: Any, has_moe: bool) -> list[str]:
    """The grouped router picks topk_group of n_group equal groups of experts."""
    if has_moe and (c.num_experts % c.n_group or not 0 < c.topk_group <= c.n_group):
        return [f"n_group {c.n_group} must divide the {c.num_experts} experts, 0 < topk_group <= n_group"]
    return []


def _shape_problems(c: HybridConfig) -> list[str]:
    problems = []
    if c.hidden_act != "silu":
        problems.append(f"hidden_act {c.hidden_act!r} (only silu)")
    if len(c.layer_types) != c.num_hidden_layers or set(c.layer_types) - set(LAYER_TYPES):
        problems.append(f"layer_types must list {c.num_hidden_layers} entries of {LAYER_TYPES}")
    if c.num_attention_heads % c.num_key_value_heads:
        problems.append("num_attention_heads must be a multiple of num_key_value_heads")
    if c.linear_num_value_heads % c.linear_num_key_heads:
        problems.append("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if c.rotary_dim % 2 or c.rotary_dim > c.head_dim:
        problems.append(f"rotary dim {c.rotary_dim} must be even and at most head_dim {c.head_dim}")
    problems += expert_problems(c, bool(c.moe_layers), "layers")
    if len(c.moe_layers) < c.num_hidden_layers and not c.intermediate_size:
        problems.append("dense MLP layers need intermediate_size")
    return problems
