"""Tiny random Kimi-Linear checkpoints built by transformers (float32).

Traps in every config: 1-based linear_attn_config layer lists with an MLA layer in the middle and a
KDA layer last; KDA heads x head_dim (4 x 16) != hidden (64); MLA with kv_lora_rank (16) != nope (16
+ rope 8) != v_head_dim (12); grouped routing (4 groups, 2 kept) with a score-correction bias, a
routed scaling factor and a shared expert; a dense first layer; vocabulary padded past the
"tokenizer" (320 rows); norm weights, A_log and dt_bias moved off their defaults.
"""
from __future__ import annotations

import torch

from hypic.models.random_weights import slow_decay as set_slow_decay

COMMON = dict(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
              kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
              intermediate_size=48, moe_intermediate_size=24, num_local_experts=8, num_experts_per_tok=3, n_group=4,
              topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, initializer_range=0.08,
              linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3], "head_dim": 16, "num_heads": 4,
                                  "short_conv_kernel_size": 4},
              pad_token_id=0, bos_token_id=1, eos_token_id=299)


def make(seed: int = 0, **overrides: object) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    fields = {**COMMON, **overrides}
    model = tf.KimiLinearForCausalLM(tf.KimiLinearConfig(**fields))
    return _finish(model, seed)


def _finish(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Norm weights off 1, the router bias off 0; A_log, dt_bias so that per-key gates spread widely
    (exp(g) from ~0.3 to ~1 a token): a wrong gate layout or a missed dt_bias shows."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                param.add_(torch.randn(param.shape, generator=generator) * 0.3)
            elif name.endswith("A_log"):
                param.copy_(torch.rand(param.shape, generator=generator) * 2 - 2)
            elif name.endswith("dt_bias"):
                param.copy_(torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)
    return model.eval()


def make_model_dir(path, *, slow_decay: bool = False, eos_token_id: int = 2, **overrides: object):
    """A tiny random checkpoint with a trained byte-level tokenizer beside it. slow_decay: KDA layers
    remember hundreds of tokens (per-key log gates ~ -2e-3 a token), so that errors early in a
    prompt still show in the final state."""
    from models_util import save_checkpoint
    from tokenizer_util import write_byte_level

    model = make(eos_token_id=eos_token_id, **overrides)
    if slow_decay:
        set_slow_decay(model)
    save_checkpoint(model, path)
    write_byte_level(path, vocab_size=300)
    return path
