"""Random checkpoint-named weights for a config, built on any device from a seed (benchmarks on real
released shapes without downloading weights). Names and layout are those of a Qwen3.5 text-only save
(prefix "model.", flat in_proj_qkv/z/b/a, fused 3-D experts) or, for a Mamba2 hybrid or Kimi-Linear, of
transformers' in-memory model (prefix "model.", fused experts: the loader takes those tensors as they are,
no second copy of the experts); load them with load_model(state_dict=...)."""
from __future__ import annotations

import math

import torch

from hypic.models.config import HybridConfig
from hypic.models.kimi_config import KimiLinearConfig
from hypic.models.mamba2_config import Mamba2HybridConfig

Shapes = dict[str, tuple[int, ...]]


def random_state_dict(config: HybridConfig | Mamba2HybridConfig | KimiLinearConfig, *, device: torch.device,
                      dtype: torch.dtype,
                      seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Linear weights ~ N(0, std); norms at their identity (Qwen's zero offsets, plain and gated-norm
    weights 1); A_log = log U(1, 16), dt_bias = 1, D = 1 as transformers initialises them."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if isinstance(config, Mamba2HybridConfig):
        shapes, norm_identity = mamba2_checkpoint_shapes(config), 1.0
    elif isinstance(config, KimiLinearConfig):
        shapes, norm_identity = kimi_checkpoint_shapes(config), 1.0
    else:
        shapes, norm_identity = checkpoint_shapes(config), 0.0
    return {name: _init(name, shape, gen, device, dtype, std, norm_identity) for name, shape in shapes.items()}


def slow_decay(model: torch.nn.Module) -> None:
    """Linear layers remember hundreds of tokens (random init forgets within a few), so that errors
    early in a prompt still show in the final state: exp(A_log) = 0.018, softplus(dt_bias) ~ 0.13."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.fill_(-4.0)
            elif name.endswith("dt_bias"):
                param.fill_(-2.0)


def checkpoint_shapes(config: HybridConfig) -> Shapes:
    c = config
    shapes = _ends_shapes(c)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(_layer_norm_shapes(c, p))
        linear = c.layer_types[i] == "linear_attention"
        shapes.update(_gdn_shapes(c, p + "linear_attn.") if linear else _attention_shapes(c, p + "self_attn."))
        moe = i in c.moe_layers
        mlp = _moe_shapes(c, p + "mlp.") if moe else _mlp_shapes(c.hidden_size, c.intermediate_size, p + "mlp.")
        shapes.update(mlp)
    return shapes


def _ends_shapes(c: HybridConfig | Mamba2HybridConfig | KimiLinearConfig, embed: str = "embed_tokens",
                 final_norm: str = "norm") -> Shapes:
    """The embedding, the final norm and (untied) the lm head, in that order (the seed draws in it)."""
    shapes: Shapes = {f"model.{embed}.weight": (c.vocab_size, c.hidden_size),
                      f"model.{final_norm}.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def _layer_norm_shapes(c: HybridConfig | KimiLinearConfig, p: str) -> Shapes:
    return {p + "input_layernorm.weight": (c.hidden_size,), p + "post_attention_layernorm.weight": (c.hidden_size,)}


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


def mamba2_checkpoint_shapes(config: Mamba2HybridConfig) -> Shapes:
    """transformers' in-memory names of each model type (the loader reads them as it reads the releases')."""
    c, names = config, _MAMBA2_NAMES[config.model_type]
    shapes = _ends_shapes(c, names["embed"], names["final_norm"])
    for j, kind in enumerate(c.blocks):
        layer = f"model.layers.{j}." if c.model_type == "nemotron_h" else f"model.layers.{j // 2}."
        shapes[layer + names["norms"][j % len(names["norms"])] + ".weight"] = (c.hidden_size,)
        shapes.update(_MAMBA2_BLOCKS[kind](c, layer + names[kind]))
    return shapes


_MAMBA2_NAMES = {  # module names: embedding, final norm, block norms, each block kind's module
    "nemotron_h": {"embed": "embeddings", "final_norm": "norm_f", "norms": ("norm",), "mamba": "mixer.",
                   "attention": "mixer.", "mlp": "mixer.", "moe": "mixer."},
    "granitemoehybrid": {"embed": "embed_tokens", "final_norm": "norm", "mamba": "mamba.", "attention": "self_attn.",
                         "norms": ("input_layernorm", "post_attention_layernorm"), "mlp": "shared_mlp.", "moe": ""},
    "bamba": {"embed": "embed_tokens", "final_norm": "final_layernorm", "norms": ("input_layernorm", "pre_ff_layernorm"),
              "mamba": "mamba.", "attention": "self_attn.", "mlp": "feed_forward.", "moe": ""}}


def _mamba2_mixer_shapes(c: Mamba2HybridConfig, p: str) -> Shapes:
    heads, inner, conv = c.mamba_num_heads, c.mamba_intermediate, c.mamba_conv_dim
    shapes = {p + "in_proj.weight": (inner + conv + heads, c.hidden_size), p + "conv1d.weight": (conv, 1, c.conv_kernel),
              p + "A_log": (heads,), p + "dt_bias": (heads,), p + "D": (heads,), p + "norm.weight": (inner,),
              p + "out_proj.weight": (c.hidden_size, inner)}
    if c.conv_bias:
        shapes[p + "conv1d.bias"] = (conv,)
    return shapes


def _mamba2_attention_shapes(c: Mamba2HybridConfig, p: str) -> Shapes:
    hidden, q_dim, kv_dim = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {p + "q_proj.weight": (q_dim, hidden), p + "k_proj.weight": (kv_dim, hidden),
            p + "v_proj.weight": (kv_dim, hidden), p + "o_proj.weight": (hidden, q_dim)}


def _mamba2_mlp_shapes(c: Mamba2HybridConfig, p: str, width: int | None = None) -> Shapes:
    width = width or c.intermediate_size
    if c.mlp_act == "relu2":
        return {p + "up_proj.weight": (width, c.hidden_size), p + "down_proj.weight": (c.hidden_size, width)}
    if c.model_type == "granitemoehybrid":
        return {p + "input_linear.weight": (2 * width, c.hidden_size), p + "output_linear.weight": (c.hidden_size, width)}
    return _mlp_shapes(c.hidden_size, width, p)


def _mamba2_moe_shapes(c: Mamba2HybridConfig, p: str) -> Shapes:
    hidden, inter, experts = c.hidden_size, c.moe_intermediate_size, c.num_experts
    if c.router == "sigmoid_grouped":  # Nemotron: relu2 experts [E, I, H], DeepSeek router, shared expert
        shapes = {p + "gate.weight": (experts, hidden), p + "gate.e_score_correction_bias": (experts,),
                  p + "experts.up_proj": (experts, inter, hidden), p + "experts.down_proj": (experts, hidden, inter)}
        if c.shared_intermediate_size:
            shapes.update(_mamba2_mlp_shapes(c, p + "shared_experts.", c.shared_intermediate_size))
        return shapes
    moe = p + "block_sparse_moe."
    return {moe + "router.weight": (experts, hidden), moe + "experts.gate_up_proj": (experts, 2 * inter, hidden),
            moe + "experts.down_proj": (experts, hidden, inter), **_mamba2_mlp_shapes(c, p + "shared_mlp.")}


_MAMBA2_BLOCKS = {"mamba": _mamba2_mixer_shapes, "attention": _mamba2_attention_shapes, "mlp": _mamba2_mlp_shapes,
                  "moe": _mamba2_moe_shapes}


def kimi_checkpoint_shapes(config: KimiLinearConfig) -> Shapes:
    """transformers' in-memory names of Kimi-Linear (conv1d over [q|k|v], forget_gate.*, mlp.*, fused experts)."""
    c = config
    shapes = _ends_shapes(c)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(_layer_norm_shapes(c, p))
        mixer = _kda_shapes if c.layer_types[i] == "linear_attention" else _mla_shapes
        shapes.update(mixer(c, p + "self_attn."))
        shapes.update(_kimi_moe_shapes(c, p + "mlp.") if i in c.moe_layers else
                      _mlp_shapes(c.hidden_size, c.intermediate_size, p + "mlp."))
    return shapes


def _kda_shapes(c: KimiLinearConfig, p: str) -> Shapes:
    hidden, heads, dim = c.hidden_size, c.linear_num_heads, c.linear_head_dim
    qkv = heads * dim
    shapes = {p + f"{n}_proj.weight": (qkv, hidden) for n in "qkv"}
    shapes.update({p + "conv1d.weight": (3 * qkv, 1, c.linear_conv_kernel_dim), p + "b_proj.weight": (heads, hidden),
                   p + "forget_gate.f_a_proj.weight": (dim, hidden), p + "forget_gate.f_b_proj.weight": (qkv, dim),
                   p + "forget_gate.A_log": (1, 1, heads, 1), p + "forget_gate.dt_bias": (qkv,),
                   p + "g_a_proj.weight": (dim, hidden), p + "g_b_proj.weight": (qkv, dim),
                   p + "o_norm.weight": (dim,), p + "o_proj.weight": (hidden, qkv)})
    return shapes


def _mla_shapes(c: KimiLinearConfig, p: str) -> Shapes:
    hidden, heads = c.hidden_size, c.num_attention_heads
    if c.q_lora_rank is None:
        shapes = {p + "q_proj.weight": (heads * c.qk_head_dim, hidden)}
    else:
        shapes = {p + "q_a_proj.weight": (c.q_lora_rank, hidden), p + "q_a_layernorm.weight": (c.q_lora_rank,),
                  p + "q_b_proj.weight": (heads * c.qk_head_dim, c.q_lora_rank)}
    shapes.update({p + "kv_a_proj_with_mqa.weight": (c.latent_dim, hidden), p + "kv_a_layernorm.weight": (c.kv_lora_rank,),
                   p + "kv_b_proj.weight": (heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
                   p + "o_proj.weight": (hidden, heads * c.v_head_dim)})
    return shapes


def _kimi_moe_shapes(c: KimiLinearConfig, p: str) -> Shapes:
    hidden, inter, experts = c.hidden_size, c.moe_intermediate_size, c.num_experts
    shapes = {p + "gate.weight": (experts, hidden), p + "gate.e_score_correction_bias": (experts,),
              p + "experts.gate_up_proj": (experts, 2 * inter, hidden), p + "experts.down_proj": (experts, hidden, inter)}
    if c.num_shared_experts:
        shapes.update(_mlp_shapes(hidden, inter * c.num_shared_experts, p + "shared_experts."))
    return shapes


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator, device: torch.device, dtype: torch.dtype,
          std: float, norm_identity: float) -> torch.Tensor:
    if name.endswith("A_log"):
        return torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=gen).log_()
    if name.endswith(("dt_bias", ".D", "linear_attn.norm.weight", "mamba.norm.weight", "mixer.norm.weight")):
        return torch.ones(shape, device=device, dtype=dtype)
    if name.endswith(("norm.weight", "norm_f.weight")):
        return torch.full(shape, norm_identity, device=device, dtype=dtype)
    if name.endswith((".bias", "e_score_correction_bias")):
        return torch.zeros(shape, device=device, dtype=dtype)
    if name.endswith("conv1d.weight"):  # depthwise conv: fan-in is the kernel width
        std = 1.0 / math.sqrt(shape[-1])
    return torch.empty(shape, device=device, dtype=dtype).normal_(0.0, std, generator=gen)
