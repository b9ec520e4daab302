"""Checkpoint names of Kimi-Linear -> KimiLinearModel parameters (loader Recipes).

Both layouts load: as the release ships them and transformers saves them (separate q/k/v_conv1d,
A_log [1, 1, H, 1], the MLPs under block_sparse_moe (dense layers too, when transformers saves),
per-expert w1 (gate) / w2 (down) / w3 (up)) and as transformers holds them in memory (conv1d,
forget_gate.*, mlp.*, fused experts.gate_up_proj / down_proj).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from hypic.models.checkpoint import LM_HEAD
from hypic.models.kimi_config import KimiLinearConfig
from hypic.models.loader import Recipe, concat_rows


def kimi_weight_recipes(config: KimiLinearConfig, names: Iterable[str]) -> dict[str, Recipe]:
    """Our parameter name -> Recipe. `names` (canonical checkpoint names) picks each layout."""
    recipes = {"embed_tokens.weight": Recipe(("embed_tokens.weight",)), "norm.weight": Recipe(("norm.weight",))}
    if not config.tie_word_embeddings:
        recipes["lm_head.weight"] = Recipe((LM_HEAD,))
    present = set(names)
    for i in range(config.num_hidden_layers):
        recipes.update(_layer_recipes(config, i, present))
    return recipes


def _layer_recipes(config: KimiLinearConfig, i: int, names: set[str]) -> dict[str, Recipe]:
    p, ours = f"layers.{i}.", f"layers.{i}."
    recipes = {ours + n: Recipe((p + n,)) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")}
    mixer = _kda if config.layer_types[i] == "linear_attention" else _mla
    recipes.update({ours + "mixer." + n: r for n, r in mixer(config, p + "self_attn.", names).items()})
    mlp = p + ("block_sparse_moe." if any(n.startswith(p + "block_sparse_moe.") for n in names) else "mlp.")
    parts = _moe(config, mlp, names) if i in config.moe_layers else _swiglu(mlp)
    recipes.update({ours + "mlp." + n: r for n, r in parts.items()})
    return recipes


def _same(p: str, names: tuple[str, ...]) -> dict[str, Recipe]:
    return {n: Recipe((p + n,)) for n in names}


def _kda(config: KimiLinearConfig, p: str, names: set[str]) -> dict[str, Recipe]:
    """Every projection of the input one in_proj; the low-rank gates' up halves stacked (one bmm)."""
    gate = p + ("forget_gate." if p + "forget_gate.A_log" in names else "")
    recipes = _same(p, ("o_norm.weight", "o_proj.weight"))
    recipes["dt_bias"] = Recipe((gate + "dt_bias",))
    recipes["A_log"] = Recipe((gate + "A_log",), lambda t: t[0].reshape(-1))
    rows = tuple(f"{p}{n}_proj.weight" for n in "qkvb") + (gate + "f_a_proj.weight", p + "g_a_proj.weight")
    recipes["in_proj.weight"] = Recipe(rows, concat_rows)
    recipes["low_rank_up"] = Recipe((gate + "f_b_proj.weight", p + "g_b_proj.weight"), torch.stack)
    fused = p + "conv1d.weight" in names
    convs = (p + "conv1d.weight",) if fused else tuple(f"{p}{n}_conv1d.weight" for n in "qkv")
    recipes["conv1d_weight"] = Recipe(convs, lambda t: torch.cat([w.reshape(w.shape[0], -1) for w in t]))
    return recipes


def _mla(config: KimiLinearConfig, p: str, names: set[str]) -> dict[str, Recipe]:
    q = ("q_proj.weight",) if config.q_lora_rank is None else (
        "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight") + (("q_a_proj.bias",) if config.attention_bias else ())
    bias = ("kv_a_proj_with_mqa.bias", "o_proj.bias") if config.attention_bias else ()
    return _same(p, q + bias + ("kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight",
                                "o_proj.weight"))


def _swiglu(p: str) -> dict[str, Recipe]:
    return {"gate_up_proj.weight": Recipe((p + "gate_proj.weight", p + "up_proj.weight"), concat_rows),
            "down_proj.weight": Recipe((p + "down_proj.weight",))}


def _moe(config: KimiLinearConfig, p: str, names: set[str]) -> dict[str, Recipe]:
    recipes = {"router.router_weight": Recipe((p + "gate.weight",)),
               "router.e_score_correction_bias": Recipe((p + "gate.e_score_correction_bias",))}
    if p + "experts.gate_up_proj" in names:  # transformers' in-memory [E, 2I, H] and [E, H, I]
        recipes.update({"experts_gate_up": Recipe((p + "experts.gate_up_proj",)),
                        "experts_down": Recipe((p + "experts.down_proj",))})
    else:
        experts = range(config.num_experts)
        gate_up = tuple(f"{p}experts.{e}.{w}.weight" for e in experts for w in ("w1", "w3"))
        recipes["experts_gate_up"] = Recipe(gate_up, lambda t: torch.stack(
            [torch.cat(t[j:j + 2]) for j in range(0, len(t), 2)]))
        recipes["experts_down"] = Recipe(tuple(f"{p}experts.{e}.w2.weight" for e in experts), torch.stack)
    if config.num_shared_experts:
        recipes.update({"shared." + n: r for n, r in _swiglu(p + "shared_experts.").items()})
    return recipes
