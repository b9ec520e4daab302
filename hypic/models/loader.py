"""Build a HybridModel's weights from checkpoint tensors.

Each model parameter has a recipe: the canonical checkpoint names it is made of and how they combine
(q/k/v -> qkv_proj, gate/up -> gate_up_proj, per-expert -> stacked experts, Qwen3-Next's grouped
in_proj_qkvz/in_proj_ba -> the flat in_proj). Missing and unexpected names fail loudly, listed.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from hypic.errors import UnsupportedModelError
from hypic.models.checkpoint import LM_HEAD, CheckpointReader
from hypic.models.config import HybridConfig
from hypic.models.layers import router_rows

ModelT = TypeVar("ModelT", bound=nn.Module)
# decay parameters (and Mamba2's D, the DeepSeek-style router) stay float32 in any model dtype
FLOAT32_PARAMS: tuple[str, ...] = ("A_log", "dt_bias", "D", "router_weight", "e_score_correction_bias")
Tensors = list[torch.Tensor]
RecipesFn = Callable[[Any, Iterable[str]], dict[str, "Recipe"]]  # (config, checkpoint names) -> recipes


def _first(tensors: Tensors) -> torch.Tensor:
    return tensors[0]


def concat_rows(tensors: Tensors) -> torch.Tensor:
    return torch.cat(tensors, dim=0)


@dataclass(frozen=True)
class Recipe:
    sources: tuple[str, ...]  # canonical checkpoint names
    build: Callable[[Tensors], torch.Tensor] = _first


def load_weights(model_cls: type[ModelT], config: Any, reader: CheckpointReader, device: torch.device,
                 dtype: torch.dtype, recipes_fn: RecipesFn) -> ModelT:
    """Instantiate model_cls on the meta device, then assign every parameter from its recipe."""
    recipes = recipes_fn(config, reader.names.keys())
    _check_names(recipes, reader, config)
    with torch.device("meta"):
        model = model_cls(config)
    state = {name: _build(name, recipe, reader, device, dtype) for name, recipe in recipes.items()}
    _check_shapes(model, state)
    model.load_state_dict(state, strict=True, assign=True)
    return model.requires_grad_(False).eval()


def _build(name: str, recipe: Recipe, reader: CheckpointReader, device: torch.device,
           dtype: torch.dtype) -> torch.Tensor:
    try:
        tensor = recipe.build([reader.get(source) for source in recipe.sources])
    except RuntimeError as e:  # shapes that do not fit the config
        raise UnsupportedModelError(f"cannot build {name} from {_listing(list(recipe.sources))}: {e}") from e
    wanted = torch.float32 if name.rsplit(".", 1)[-1] in FLOAT32_PARAMS else dtype
    return tensor.to(device=device, dtype=wanted).contiguous()


def _check_names(recipes: dict[str, Recipe], reader: CheckpointReader, config: Any) -> None:
    needed = {source for recipe in recipes.values() for source in recipe.sources}
    present = set(reader.names)
    tied_head = {LM_HEAD} if config.tie_word_embeddings else set()  # ignored: the embedding serves as head
    missing = sorted(needed - present)
    unexpected = sorted(present - needed - tied_head) + reader.strays
    if missing or unexpected:
        raise UnsupportedModelError(
            f"checkpoint does not match the {config.model_type} config: "
            f"{len(missing)} missing weights {_listing(missing)}, "
            f"{len(unexpected)} unexpected weights {_listing(unexpected)}")


def _check_shapes(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    wrong = [f"{name} {tuple(state[name].shape)} (config says {tuple(param.shape)})"
             for name, param in model.named_parameters() if state[name].shape != param.shape]
    if wrong:
        raise UnsupportedModelError(f"checkpoint weights do not fit the config: {_listing(wrong)}")


def _listing(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}]"


# ---- recipes ---------------------------------------------------------------------------------------

def weight_recipes(config: HybridConfig, names: Iterable[str]) -> dict[str, Recipe]:
    """Our parameter name -> Recipe. `names` (canonical checkpoint names) picks the expert layout."""
    recipes = {"embed_tokens.weight": Recipe(("embed_tokens.weight",)), "norm.weight": Recipe(("norm.weight",))}
    if not config.tie_word_embeddings:
        recipes["lm_head.weight"] = Recipe((LM_HEAD,))
    for i in range(config.num_hidden_layers):
        recipes.update(_layer_recipes(config, i, set(names)))
    return recipes


def _layer_recipes(config: HybridConfig, i: int, names: set[str]) -> dict[str, Recipe]:
    p = f"layers.{i}."
    recipes = _same(p, ("input_layernorm.weight", "post_attention_layernorm.weight"))
    if config.layer_types[i] == "linear_attention":
        recipes.update(_gdn_recipes(config, p + "linear_attn.", names))
    else:
        recipes.update(_attention_recipes(config, p + "self_attn."))
    if i in config.moe_layers:
        recipes.update(_moe_recipes(config, p + "mlp.", names))
    else:
        recipes.update(_mlp_recipes(p + "mlp."))
    return recipes


def _same(prefix: str, names: tuple[str, ...]) -> dict[str, Recipe]:
    return {prefix + n: Recipe((prefix + n,)) for n in names}


def _gdn_recipes(config: HybridConfig, p: str, names: set[str]) -> dict[str, Recipe]:
    recipes = _same(p, ("A_log", "dt_bias", "norm.weight", "out_proj.weight"))
    recipes[p + "conv1d_weight"] = Recipe((p + "conv1d.weight",), lambda t: t[0].reshape(t[0].shape[0], -1))
    if p + "in_proj_qkvz.weight" in names:  # Qwen3-Next: projections grouped per key head
        recipes[p + "in_proj.weight"] = Recipe((p + "in_proj_qkvz.weight", p + "in_proj_ba.weight"),
                                               lambda t: _ungroup_qkvz_ba(config, *t))
    else:  # Qwen3.5: flat projections
        sources = tuple(p + f"in_proj_{n}.weight" for n in ("qkv", "z", "b", "a"))
        recipes[p + "in_proj.weight"] = Recipe(sources, concat_rows)
    return recipes


def _ungroup_qkvz_ba(config: HybridConfig, qkvz: torch.Tensor, ba: torch.Tensor) -> torch.Tensor:
    """Qwen3-Next stores, per key head g, rows [q_g | k_g | v_g (r heads) | z_g (r heads)] and [b_g | a_g]
    (r = HV / H). Our in_proj wants [q | k | v | z | b | a], each flat over heads in head order."""
    c = config
    heads, ratio, hidden = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads, qkvz.shape[1]
    k_dim, rv_dim = c.linear_key_head_dim, ratio * c.linear_value_head_dim
    q, k, v, z = qkvz.reshape(heads, -1, hidden).split((k_dim, k_dim, rv_dim, rv_dim), dim=1)
    b, a = ba.reshape(heads, -1, hidden).split((ratio, ratio), dim=1)
    return torch.cat([x.reshape(-1, hidden) for x in (q, k, v, z, b, a)], dim=0)


def _attention_recipes(config: HybridConfig, p: str) -> dict[str, Recipe]:
    recipes = _same(p, ("q_norm.weight", "k_norm.weight", "o_proj.weight"))
    kinds = ("weight", "bias") if config.attention_bias else ("weight",)
    for kind in kinds:
        sources = tuple(f"{p}{n}_proj.{kind}" for n in ("q", "k", "v"))
        recipes[f"{p}qkv_proj.{kind}"] = Recipe(sources, concat_rows)
    if config.attention_bias:
        recipes.update(_same(p, ("o_proj.bias",)))
    return recipes


def _mlp_recipes(p: str) -> dict[str, Recipe]:
    return {p + "gate_up_proj.weight": Recipe((p + "gate_proj.weight", p + "up_proj.weight"), concat_rows),
            p + "down_proj.weight": Recipe((p + "down_proj.weight",))}


def _moe_recipes(config: HybridConfig, p: str, names: set[str]) -> dict[str, Recipe]:
    recipes = {p + "gate.weight": Recipe((p + "gate.weight",), _router)}
    if config.shared_expert_intermediate_size:  # the shared expert's gate as the router's row E: one GEMM
        recipes.update(_mlp_recipes(p + "shared_expert."))
        recipes[p + "gate.weight"] = Recipe((p + "gate.weight", p + "shared_expert_gate.weight"), _router)
    if p + "experts.gate_up_proj" in names:  # fused 3-D experts
        recipes[p + "experts_gate_up"] = Recipe((p + "experts.gate_up_proj",), lambda t: _oriented(t[0], config, 2))
        recipes[p + "experts_down"] = Recipe((p + "experts.down_proj",), lambda t: _oriented(t[0], config, 1))
    else:  # one module per expert
        experts = range(config.num_experts)
        gate_up = tuple(f"{p}experts.{e}.{n}_proj.weight" for e in experts for n in ("gate", "up"))
        recipes[p + "experts_gate_up"] = Recipe(gate_up, lambda t: torch.stack(
            [torch.cat(t[j:j + 2], dim=0) for j in range(0, len(t), 2)]))
        down = tuple(f"{p}experts.{e}.down_proj.weight" for e in experts)
        recipes[p + "experts_down"] = Recipe(down, torch.stack)
    return recipes


def _router(tensors: Tensors) -> torch.Tensor:
    """The router's rows (and the shared expert's gate), zero rows after them to `router_rows`."""
    rows = concat_rows(tensors)
    return F.pad(rows, (0, 0, 0, router_rows(rows.shape[0]) - rows.shape[0]))


def _oriented(weight: torch.Tensor, config: HybridConfig, out_factor: int) -> torch.Tensor:
    """Fused experts come as [E, out, in] (transformers) or transposed [E, in, out] (some exports):
    gate_up out = 2I, in = H; down out = H, in = I. Transpose the latter when the shape says so."""
    inter, hidden = config.moe_intermediate_size, config.hidden_size
    out_dim, in_dim = (out_factor * inter, hidden) if out_factor == 2 else (hidden, inter)
    if weight.shape[1:] == (out_dim, in_dim):
        return weight
    if weight.shape[1:] == (in_dim, out_dim):
        return weight.transpose(1, 2)
    raise UnsupportedModelError(
        f"fused expert weight of shape {tuple(weight.shape)} fits neither [E, {out_dim}, {in_dim}] nor its transpose")
