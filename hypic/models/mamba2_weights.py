"""Checkpoint names of the Mamba2 hybrids -> Mamba2HybridModel parameters (loader Recipes).

Names are canonical (the `backbone.` / `model.` prefix stripped by the reader). Both layouts load:
as the releases ship them and transformers saves them (Nemotron: one tensor per expert; Granite:
block_sparse_moe.input_linear / output_linear / router.layer) and as transformers holds them in
memory (fused experts.up_proj / gate_up_proj / down_proj, router.weight).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from hypic.models.checkpoint import LM_HEAD
from hypic.models.loader import Recipe, concat_rows
from hypic.models.mamba2_config import Mamba2HybridConfig

# per model type: (embedding, final norm, the norm of a layer's first block, of its second block)
_TOP_NAMES = {"nemotron_h": ("embeddings.weight", "norm_f.weight", "norm.weight", None),
              "granitemoehybrid": ("embed_tokens.weight", "norm.weight", "input_layernorm.weight",
                                   "post_attention_layernorm.weight"),
              "bamba": ("embed_tokens.weight", "final_layernorm.weight", "input_layernorm.weight",
                        "pre_ff_layernorm.weight")}
_MAMBA_SAME = ("in_proj.weight", "A_log", "dt_bias", "D", "norm.weight", "out_proj.weight")


def mamba2_weight_recipes(config: Mamba2HybridConfig, names: Iterable[str]) -> dict[str, Recipe]:
    """Our parameter name -> Recipe. `names` (canonical checkpoint names) picks the expert layout."""
    embed, final_norm = _TOP_NAMES[config.model_type][:2]
    recipes = {"embed_tokens.weight": Recipe((embed,)), "norm.weight": Recipe((final_norm,))}
    if not config.tie_word_embeddings:
        recipes["lm_head.weight"] = Recipe((LM_HEAD,))
    present = set(names)
    for j in range(len(config.blocks)):
        recipes.update(_block_recipes(config, j, present))
    return recipes


def _block_recipes(config: Mamba2HybridConfig, j: int, names: set[str]) -> dict[str, Recipe]:
    kind, ours = config.blocks[j], f"layers.{j}."
    src = _source_prefix(config, j)
    norm = _norm_name(config, j)
    recipes = {ours + "norm.weight": Recipe((norm,))}
    parts = {"mamba": _mamba, "attention": _attention, "mlp": _mlp, "moe": _moe}[kind](config, src, names)
    recipes.update({ours + "mixer." + name: recipe for name, recipe in parts.items()})
    return recipes


def _source_prefix(config: Mamba2HybridConfig, j: int) -> str:
    """Where block j's weights live: Nemotron's layers.j.mixer; a Granite / Bamba layer's module."""
    if config.model_type == "nemotron_h":
        return f"layers.{j}.mixer."
    module = {"mamba": "mamba", "attention": "self_attn", "moe": "", "mlp": "feed_forward"}[config.blocks[j]]
    if config.model_type == "granitemoehybrid" and config.blocks[j] == "mlp":
        module = "shared_mlp"
    return f"layers.{j // 2}." + (module + "." if module else "")


def _norm_name(config: Mamba2HybridConfig, j: int) -> str:
    first, second = _TOP_NAMES[config.model_type][2:]
    if config.model_type == "nemotron_h":
        return f"layers.{j}.{first}"
    return f"layers.{j // 2}.{first if j % 2 == 0 else second}"


def _same(p: str, names: tuple[str, ...]) -> dict[str, Recipe]:
    return {n: Recipe((p + n,)) for n in names}


def _mamba(config: Mamba2HybridConfig, p: str, names: set[str]) -> dict[str, Recipe]:
    recipes = _same(p, _MAMBA_SAME)
    recipes["conv1d_weight"] = Recipe((p + "conv1d.weight",), lambda t: t[0].reshape(t[0].shape[0], -1))
    if config.conv_bias:
        recipes["conv1d_bias"] = Recipe((p + "conv1d.bias",))
    return recipes


def _attention(config: Mamba2HybridConfig, p: str, names: set[str]) -> dict[str, Recipe]:
    recipes = _same(p, ("o_proj.weight",))
    kinds = ("weight", "bias") if config.attention_bias else ("weight",)
    for kind in kinds:
        recipes[f"qkv_proj.{kind}"] = Recipe(tuple(f"{p}{n}_proj.{kind}" for n in "qkv"), concat_rows)
    if config.attention_bias:
        recipes.update(_same(p, ("o_proj.bias",)))
    return recipes


def _mlp(config: Mamba2HybridConfig, p: str, names: set[str]) -> dict[str, Recipe]:
    """relu^2: up_proj, down_proj; SwiGLU: gate_proj + up_proj (Bamba) or the fused input_linear
    [gate | up] with output_linear (Granite's shared MLP)."""
    if config.mlp_act == "relu2":
        return _same(p, ("up_proj.weight", "down_proj.weight"))
    if p.endswith("shared_mlp."):
        return {"gate_up_proj.weight": Recipe((p + "input_linear.weight",)),
                "down_proj.weight": Recipe((p + "output_linear.weight",))}
    return {"gate_up_proj.weight": Recipe((p + "gate_proj.weight", p + "up_proj.weight"), concat_rows),
            "down_proj.weight": Recipe((p + "down_proj.weight",))}


def _moe(config: Mamba2HybridConfig, p: str, names: set[str]) -> dict[str, Recipe]:
    return _nemotron_moe(config, p, names) if config.router == "sigmoid_grouped" else _granite_moe(config, p, names)


def _nemotron_moe(config: Mamba2HybridConfig, p: str, names: set[str]) -> dict[str, Recipe]:
    recipes = {"router.router_weight": Recipe((p + "gate.weight",)),
               "router.e_score_correction_bias": Recipe((p + "gate.e_score_correction_bias",))}
    if p + "experts.up_proj" in names:  # fused [E, I, H] and [E, H, I]
        recipes.update({"experts_gate_up": Recipe((p + "experts.up_proj",)),
                        "experts_down": Recipe((p + "experts.down_proj",))})
    else:
        experts = range(config.num_experts)
        for ours, theirs in (("experts_gate_up", "up_proj"), ("experts_down", "down_proj")):
            recipes[ours] = Recipe(tuple(f"{p}experts.{e}.{theirs}.weight" for e in experts), torch.stack)
    if config.shared_intermediate_size:
        recipes.update({"shared." + n: Recipe((p + "shared_experts." + n,))
                        for n in ("up_proj.weight", "down_proj.weight")})
    return recipes


def _granite_moe(config: Mamba2HybridConfig, p: str, names: set[str]) -> dict[str, Recipe]:
    moe = p + "block_sparse_moe."
    fused = moe + "experts.gate_up_proj" in names  # transformers' in-memory names
    recipes = {
        "router.weight": Recipe((moe + ("router.weight" if fused else "router.layer.weight"),)),
        "experts_gate_up": Recipe((moe + ("experts.gate_up_proj" if fused else "input_linear.weight"),)),
        "experts_down": Recipe((moe + ("experts.down_proj" if fused else "output_linear.weight"),))}
    recipes.update({"shared." + n: r for n, r in _mlp(config, p + "shared_mlp.", names).items()})
    return recipes
