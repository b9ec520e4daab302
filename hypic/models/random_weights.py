"""Random checkpoint-named weights for a config, built on any device from a seed (benchmarks on real
released shapes without downloading weights). Names and layout are those of a Qwen3.5 text-only save:
prefix "model.", flat in_proj_qkv/z/b/a, fused 3-D experts; load them with load_model(state_dict=...)."""
from __future__ import annotations

import math

import torch

from hypic.models.config import HybridConfig

Shapes = dict[str, tuple[int, ...]]


def random_state_dict(config: HybridConfig, *, device: torch.device, dtype: torch.dtype, seed: int = 0,
                      std: float = 0.02) -> dict[str, torch.Tensor]:
    """Linear weights ~ N(0, std); norms at their identity (zero offsets, gated-norm weights 1);
    A_log = log U(1, 16) and dt_bias = 1 as transformers initialises them."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return {name: _init(name, shape, gen, device, dtype, std) for name, shape in checkpoint_shapes(config).items()}


def checkpoint_shapes(config: HybridConfig) -> Shapes:
    c = config
    shapes: Shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
                      "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (c.hidden_size,),
                       p + "post_attention_layernorm.weight": (c.hidden_size,)})
        linear = c.layer_types[i] == "linear_attention"
        shapes.update(_gdn_shapes(c, p + "linear_attn.") if linear else _attention_shapes(c, p + "self_attn."))
        moe = i in c.moe_layers
        mlp = _moe_shapes(c, p + "mlp.") if moe else _mlp_shapes(c.hidden_size, c.intermediate_size, p + "mlp.")
        shapes.update(mlp)
    return shapes


def _gdn_shapes(c: HybridConfig, p: str) -> Shapes:
    hidden, heads = c.hidden_size, c.linear_num_value_heads
    return {p + "in_proj_qkv.weight": (c.linear_conv_dim, hidden), p + "in_proj_z.weight": (c.linear_value_dim, hidden),
            p + "in_proj_b.weight": (heads, hidden), p + "in_proj_a.weight": (heads, hidden),
            p + "conv1d.weight": (c.linear_conv_dim, 1, c.linear_conv_kernel_dim), p + "A_log": (heads,),
            p + "dt_bias": (heads,), p + "norm.weight": (c.linear_value_head_dim,),
            p + "out_proj.weight": (hidden, c.linear_value_dim)}


def _attention_shapes(c: HybridConfig, p: str) -> Shapes:
    hidden, q_dim, kv_dim = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {p + "q_proj.weight": (q_dim * (2 if c.attn_output_gate else 1), hidden),
              p + "k_proj.weight": (kv_dim, hidden), p + "v_proj.weight": (kv_dim, hidden),
              p + "o_proj.weight": (hidden, q_dim), p + "q_norm.weight": (c.head_dim,),
              p + "k_norm.weight": (c.head_dim,)}
    if c.attention_bias:
        shapes.update({p + "q_proj.bias": (shapes[p + "q_proj.weight"][0],), p + "k_proj.bias": (kv_dim,),
                       p + "v_proj.bias": (kv_dim,), p + "o_proj.bias": (hidden,)})
    return shapes


def _mlp_shapes(hidden: int, inter: int, p: str) -> Shapes:
    return {p + "gate_proj.weight": (inter, hidden), p + "up_proj.weight": (inter, hidden),
            p + "down_proj.weight": (hidden, inter)}


def _moe_shapes(c: HybridConfig, p: str) -> Shapes:
    hidden, inter, experts = c.hidden_size, c.moe_intermediate_size, c.num_experts
    shapes = {p + "gate.weight": (experts, hidden), p + "experts.gate_up_proj": (experts, 2 * inter, hidden),
              p + "experts.down_proj": (experts, hidden, inter)}
    if c.shared_expert_intermediate_size:
        shapes.update(_mlp_shapes(hidden, c.shared_expert_intermediate_size, p + "shared_expert."))
        shapes[p + "shared_expert_gate.weight"] = (1, hidden)
    return shapes


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator, device: torch.device, dtype: torch.dtype,
          std: float) -> torch.Tensor:
    if name.endswith("A_log"):
        return torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=gen).log_()
    if name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
        return torch.ones(shape, device=device, dtype=dtype)
    if name.endswith("norm.weight"):
        return torch.zeros(shape, device=device, dtype=dtype)
    if name.endswith(".bias"):
        return torch.zeros(shape, device=device, dtype=dtype)
    if name.endswith("conv1d.weight"):  # depthwise conv: fan-in is the kernel width
        std = 1.0 / math.sqrt(shape[-1])
    return torch.empty(shape, device=device, dtype=dtype).normal_(0.0, std, generator=gen)
