"""Writes the model bundled in hypic (hypic/assets/default_model): a small Qwen3.5 text checkpoint.

    python scripts/train/make_default_model.py --out hypic/assets/default_model                 # random init
    python scripts/train/make_default_model.py --out hypic/assets/default_model --weights CKPT  # trained

The format is exactly a released Qwen3.5 text model's: config.json (model_type "qwen3_5_text",
Gated DeltaNet layers with full attention every 4th layer), model.safetensors in bf16 with names
`model.*` (embeddings tied to the LM head, so no `lm_head.weight`), generation_config.json, and the
tokenizer files (made by scripts/train/train_tokenizer.py) that must already sit in --out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

EOS_TOKEN_ID, PAD_TOKEN_ID = 2, 0  # <|im_end|>, <|endoftext|> (see scripts/train/train_tokenizer.py)


def model_config(vocab_size: int) -> dict:
    """About 7.6 M parameters: 8 layers of width 256, layers 3 and 7 full attention."""
    layers = 8
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": layers,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "full_attention_interval": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "linear_conv_kernel_dim": 4,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "max_position_embeddings": 16384,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "dtype": "bfloat16",
    }


def generation_config() -> dict:
    return {"bos_token_id": None, "eos_token_id": [EOS_TOKEN_ID, PAD_TOKEN_ID], "pad_token_id": PAD_TOKEN_ID,
            "do_sample": False, "max_new_tokens": 48}  # a restated reply: evidence, then the answer


def hf_model(config: dict, weights: dict[str, torch.Tensor] | None = None, seed: int = 0):
    """transformers' Qwen3_5ForCausalLM (needed by this script only): random, or loaded strictly."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**config)).float().eval()
    if weights is not None:
        model.load_state_dict({n: t.float() for n, t in weights.items()}, strict=False)
        missing = set(model.state_dict()) - set(weights) - {"lm_head.weight"}
        if missing or set(weights) - set(model.state_dict()):
            raise ValueError(f"weights do not fit the config: missing {sorted(missing)[:3]}")
    return model


def greedy_check(model, tokenizer_dir: Path, per_kind: int, names: str) -> dict[str, float]:
    """Exact match per kind on test requests, greedy decoding through transformers' generate."""
    from tokenizers import Tokenizer

    from hypic.data import EVAL_SPEC, EVAL_SPEC_SINGLE_NAMES, eval_prompts, is_correct

    tokenizer, hits = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")), {}
    for prompt in eval_prompts(per_kind, "test", EVAL_SPEC if names == "rich" else EVAL_SPEC_SINGLE_NAMES):
        ids = [i for s in prompt.segments for i in tokenizer.encode(s, add_special_tokens=False).ids]
        out = model.generate(torch.tensor([ids]), max_new_tokens=generation_config()["max_new_tokens"],
                             do_sample=False, eos_token_id=EOS_TOKEN_ID)
        reply = tokenizer.decode(out[0, len(ids):].tolist())
        hits.setdefault(prompt.kind, []).append(is_correct(reply, prompt.answer))
    return {kind: sum(v) / len(v) for kind, v in hits.items()}


def write_weights(out: Path, weights: dict[str, torch.Tensor]) -> None:
    tensors = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in sorted(weights.items())}
    tensors.pop("lm_head.weight", None)  # tied to model.embed_tokens.weight
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="holds tokenizer.json already")
    parser.add_argument("--weights", type=Path, help="safetensors with `model.*` names (a training checkpoint)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", type=int, default=0, help="greedy exact match on N test requests per kind")
    parser.add_argument("--names", default="rich", choices=("rich", "single"),
                        help="entity names of the check's requests (as eval_quality.py --names)")
    args = parser.parse_args()
    vocab_size = Tokenizer.from_file(str(args.out / "tokenizer.json")).get_vocab_size()
    config = model_config(vocab_size)
    weights = load_file(str(args.weights)) if args.weights else None
    model = hf_model(config, weights, args.seed)
    weights = weights or {n: t for n, t in model.state_dict().items() if n != "lm_head.weight"}
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (args.out / "generation_config.json").write_text(json.dumps(generation_config(), indent=2) + "\n")
    write_weights(args.out, weights)
    count = sum(t.numel() for t in weights.values() if t.ndim)
    print(f"{count / 1e6:.2f} M parameters -> {args.out}")
    if args.check:
        print("greedy exact match (transformers):", greedy_check(model, args.out, args.check, args.names))


if __name__ == "__main__":
    main()
