"""Tokenizer-test helpers: tiny Hugging Face tokenizer directories trained here, in two styles.

- byte-level BPE (Qwen/GPT-2 style): no BOS, ChatML template, eos <|im_end|>; non-ASCII text
  ("héllo 世界 🙂") splits into tokens carrying partial UTF-8 bytes.
- metaspace BPE with byte fallback (Llama-2 style): "▁" for spaces, <0xNN> byte tokens for
  characters it never saw, BOS added by the post-processor, a decoder that strips the leading space.
"""
from __future__ import annotations

import base64
import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

CORPUS = (
    "héllo 世界 🙂 hello world, the quick brown fox jumps over the lazy dog.",
    "Grüße aus Köln! naïve café résumé — ünïcödé 日本語のテキスト 😀👍🏽 Ελληνικά русский",
    "Position-independent caching reuses documents at any position in the prompt.",
    "A segment is tokenized on its own; the separator is removed. 1234 5678 90",
)
CHATML = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unsupported role ' + message['role']) }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
BYTE_LEVEL_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def write_byte_level(path: Path, *, config: dict | None = None, vocab_size: int = 400) -> Path:
    """A trained byte-level BPE directory; `config` entries replace tokenizer_config.json ones."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(BYTE_LEVEL_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 3, trainer=trainer)
    base = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
            "chat_template": CHATML, "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": _added_tokens(BYTE_LEVEL_SPECIALS)}
    return _save(path, tokenizer, {**base, **(config or {})})


def write_metaspace(path: Path) -> Path:
    """A Llama-2-style directory: metaspace, byte fallback for unseen characters, BOS <s> prepended."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    trained.train_from_iterator([c.encode("ascii", "ignore").decode() for c in CORPUS] * 3, trainer=trainer)
    state = json.loads(trained.to_str())["model"]
    vocab = dict(state["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", 1 + max(vocab.values()))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(content=" ", left=1, right=0)])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", vocab["<s>"])])
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
              "clean_up_tokenization_spaces": False, "chat_template": CHATML,
              "added_tokens_decoder": _added_tokens(("<unk>", "<s>", "</s>"))}
    return _save(path, tokenizer, config)


def _added_tokens(specials: tuple[str, ...]) -> dict[str, dict]:
    return {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": True} for i, t in enumerate(specials)}


def _save(path: Path, tokenizer: Tokenizer, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


# --- a Kimi-style tiktoken directory --------------------------------------------------------------

KIMI_NAMED = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
              6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
              17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]"}
"""The release's named special tokens by offset past the ranks (163584 + offset in the 48B release)."""
KIMI_TEMPLATE = (
    "{%- if tools %}{{- '<|im_system|>tool_declare<|im_middle|>' + tools | tojson + '<|im_end|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- set role = 'im_' + ('system' if message['role'] == 'system' else 'user' "
    "if message['role'] == 'user' else 'assistant') %}"
    "{{- '<|' + role + '|>' + message['role'] + '<|im_middle|>' + message['content'] + '<|im_end|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_assistant|>assistant<|im_middle|>' }}{%- endif %}"
)


def write_kimi_tiktoken(path: Path, *, vocab_size: int = 400) -> dict[bytes, int]:
    """`tiktoken.model` ranked from a byte-level BPE trained here under Kimi's split regex, plus the
    release's tokenizer_config.json shape (auto_map, added_tokens_decoder, chat template). No
    tokenizer.json. Returns the ranks."""
    from hypic.engine.text.tiktoken_bpe import KIMI

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI.pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    trained.train_from_iterator(CORPUS * 3, trainer=trainer)
    to_byte = {char: byte for byte, char in enumerate(_gpt2_alphabet())}
    ranks = {bytes(to_byte[c] for c in token): i for token, i in trained.get_vocab().items()}
    path.mkdir(parents=True, exist_ok=True)
    lines = (f"{base64.b64encode(token).decode()} {rank}" for token, rank in sorted(ranks.items(), key=lambda t: t[1]))
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    (path / "tokenizer_config.json").write_text(json.dumps(kimi_config(len(ranks))))
    return ranks


def kimi_config(base: int) -> dict:
    added = {str(base + offset): {"content": text, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True} for offset, text in KIMI_NAMED.items()}
    return {"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
            "tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "<|im_end|>",
            "pad_token": "[PAD]", "unk_token": "[UNK]", "added_tokens_decoder": added,
            "chat_template": KIMI_TEMPLATE, "clean_up_tokenization_spaces": False}


def _gpt2_alphabet() -> list[str]:
    """The byte -> character table, written out independently of hypic's (printable bytes as themselves)."""
    keep = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    moved = [b for b in range(256) if b not in keep]
    table = {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(moved)}
    return [table[b] for b in range(256)]
