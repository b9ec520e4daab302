"""Tiny random Mamba2-hybrid checkpoints built by transformers (float32), one builder per model type.

Traps in every config: n_groups > 1 unless asked (B/C shared by groups of heads), head_dim (8) !=
d_state (16), GQA attention, vocabulary padded past the "tokenizer" (320 rows), chunk_size 8 in
transformers (several chunks per prompt), norm weights and D moved off their defaults.
"""
from __future__ import annotations

import torch

COMMON = dict(vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, initializer_range=0.08, eos_token_id=299, pad_token_id=0)
MAMBA_GRANITE = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
                     mamba_chunk_size=8)


def nemotron_h(seed: int = 0, **overrides: object) -> torch.nn.Module:
    """Nemotron 3 style: M / E (DeepSeek router, relu2 experts + shared expert) / * (NoPE) / - blocks."""
    import transformers as tf

    fields = dict(COMMON, head_dim=16, hybrid_override_pattern="ME*M-EM", intermediate_size=48,
                  mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8,
                  n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
                  moe_shared_expert_intermediate_size=40, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                  norm_topk_prob=True, layer_norm_epsilon=1e-5)
    fields.update(overrides)
    return _finish(tf.NemotronHForCausalLM(tf.NemotronHConfig(**fields)), seed)


def granite(seed: int = 0, **overrides: object) -> torch.nn.Module:
    """Granite-4.0-H style: MoE beside a shared MLP, Granite's multipliers, NoPE unless rope is asked."""
    import transformers as tf

    fields = dict(COMMON, **MAMBA_GRANITE, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"],
                  intermediate_size=24, shared_intermediate_size=40, num_local_experts=6, num_experts_per_tok=2,
                  embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.5)
    fields.update(overrides)
    return _finish(tf.GraniteMoeHybridForCausalLM(tf.GraniteMoeHybridConfig(**fields)), seed)


def bamba(seed: int = 0, **overrides: object) -> torch.nn.Module:
    """Bamba: dense SwiGLU, RoPE on half of each head, one group unless asked."""
    import transformers as tf

    fields = dict(COMMON, **{**MAMBA_GRANITE, "mamba_n_groups": 1}, num_hidden_layers=3, attn_layer_indices=[1],
                  intermediate_size=48)
    fields.update(overrides)
    return _finish(tf.BambaForCausalLM(tf.BambaConfig(**fields)), seed)


BUILDERS = {"nemotron_h": nemotron_h, "granitemoehybrid": granite, "bamba": bamba}


def make(kind: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    torch.manual_seed(seed)
    return BUILDERS[kind](seed, **overrides)


def _finish(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Move the parameters transformers initialises to constants, so a wrong convention shows: norm
    weights, D, the router bias; dt_bias to [-1, 1], where softplus gives dt in [0.3, 1.3] (above
    transformers' Nemotron-H floor of time_step_min, which its prefill clamps to and we do not)."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "norm_f.weight", ".D")):
                param.add_(torch.randn(param.shape, generator=generator) * 0.3)
            elif name.endswith("dt_bias"):
                param.copy_(torch.rand(param.shape, generator=generator) * 2 - 1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)
    return model.eval()


def make_model_dir(path, kind: str, *, slow_decay: bool = False, eos_token_id: int = 2, **overrides: object):
    """A tiny random checkpoint of `kind` with a trained byte-level tokenizer beside it; slow_decay:
    Mamba2 layers remember hundreds of tokens (dt A ~ -2e-3 a token)."""
    from models_util import save_checkpoint, slow_decay as slow_down
    from tokenizer_util import write_byte_level

    model = make(kind, eos_token_id=eos_token_id, **overrides)
    if slow_decay:
        slow_down(model)
    save_checkpoint(model, path)
    write_byte_level(path, vocab_size=300)
    return path
