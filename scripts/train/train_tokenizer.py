"""Trains the bundled model's byte-level BPE tokenizer on the notes task's own text.

    python scripts/train/train_tokenizer.py --out hypic/assets/default_model --vocab-size 3072

Writes tokenizer.json and tokenizer_config.json (ChatML chat template, eos <|im_end|>, pad
<|endoftext|>). Pre-tokenization follows Qwen2/3 (single digits, words keep their leading space),
so a name inside a note and in the reply "Answer: <name>" has the same tokens. The PIC separator
is not a token: hypic splits prompts on it before tokenizing.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from hypic.data import lexicon
from hypic.data.tasks import EVAL_SPEC, TaskSpec, make_prompts

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2/3's pre-tokenizer pattern: contractions, words with one leading non-letter, single digits.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CORPUS_SPECS = (
    TaskSpec(min_notes=2, max_notes=4, min_note_tokens=32, max_note_tokens=96, rich_names=False, questions=4),
    TaskSpec(min_notes=2, max_notes=6, min_note_tokens=64, max_note_tokens=192, questions=4),
    replace(EVAL_SPEC, restate=False),  # the bundled tokenizer's corpus predates restated replies
)


def corpus(prompts_per_spec: int) -> Iterator[str]:
    """Prompt texts (separator removed: it never reaches the tokenizer) and their answer turns."""
    for spec in CORPUS_SPECS:
        for prompt in make_prompts(spec, "train", prompts_per_spec, seed=1234):
            yield from prompt.segments
            yield from (text for text, _ in prompt.training_pieces())
    # Every common entity several times with its leading space, so each becomes one token.
    for words in (lexicon.FIRST_NAMES, lexicon.CITIES, lexicon.COMPANIES, lexicon.JOBS):
        yield " ".join(f" {w}" for w in words for _ in range(50))


def build(vocab_size: int, prompts_per_spec: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus(prompts_per_spec), trainer=trainer)
    return tokenizer


def tokenizer_config() -> dict:
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    return {"added_tokens_decoder": added, "bos_token": None, "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>", "unk_token": None, "add_bos_token": False,
            "add_prefix_space": False, "clean_up_tokenization_spaces": False, "errors": "replace",
            "model_max_length": 16384, "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer", "chat_template": CHAT_TEMPLATE}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab-size", type=int, default=3072)
    parser.add_argument("--prompts-per-spec", type=int, default=1500)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = build(args.vocab_size, args.prompts_per_spec)
    tokenizer.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    print(f"vocab {tokenizer.get_vocab_size()} -> {args.out}")


if __name__ == "__main__":
    main()
