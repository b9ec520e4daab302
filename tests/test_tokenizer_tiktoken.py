"""A Kimi-style tiktoken directory (tiktoken.model + tokenizer_config.json, no tokenizer.json):
encode/decode equal tiktoken's own encoding under the release's regex, special tokens at their ids,
the chat template renders, bad directories are refused, and a tiny Kimi-Linear checkpoint with only
these tokenizer files serves a request through the engine."""
from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
import tiktoken

import kimi_models
from engine_util import collect, cpu_config, greedy, hf_greedy
from hypic import AsyncEngine, SamplingParams
from hypic.engine.text.tiktoken_bpe import KIMI, recover_merges
from hypic.engine.text.tokenizer import Tokenizer
from hypic.errors import InvalidRequestError, UnsupportedModelError
from hypic.structured_outputs import StructuredOutputs
from models_util import save_checkpoint
from tokenizer_util import CORPUS, KIMI_NAMED, KIMI_TEMPLATE, write_byte_level, write_kimi_tiktoken

SPECIAL_COUNT = 258


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[bytes, int]]:
    path = tmp_path_factory.mktemp("kimi_tiktoken")
    return path, write_kimi_tiktoken(path)


def _tiktoken(path: Path, ranks: dict[bytes, int]) -> tiktoken.Encoding:
    """The release's own construction: tiktoken with config-named ids, the rest <|reserved_token_N|>."""
    decoder = json.loads((path / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    names = {int(i): entry["content"] for i, entry in decoder.items()}
    base = len(ranks)
    specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + SPECIAL_COUNT)}
    return tiktoken.Encoding("kimi-test", pat_str=KIMI.pattern, mergeable_ranks=ranks, special_tokens=specials)


def _texts() -> list[str]:
    """The training corpus, edge cases of the regex (Han runs, cased words, contractions, digit groups,
    whitespace runs), special tokens inside text, and seeded shuffles of corpus characters."""
    edge = ["", " ", "Hello WORLD I'm DON'T we'LL", "世界你好 日本語のテキスト 中文English混合", "1234567 89",
            "  \n\n\t x   y\r\n", "naïve ÉCOLE Ελληνικά русский 😀👍🏽", "<|im_user|>user<|im_middle|>hé<|im_end|>",
            "[BOS]a[EOS]<|reserved_token_999|>"]
    rng, chars = random.Random(0), list("".join(CORPUS))
    shuffled = ["".join(rng.choices(chars, k=rng.randint(1, 60))) for _ in range(200)]
    return [*CORPUS, *edge, *shuffled]


def test_encode_decode_equal_tiktoken(kimi_dir: tuple[Path, dict[bytes, int]]) -> None:
    path, ranks = kimi_dir
    ours, theirs = Tokenizer.from_dir(path), _tiktoken(path, ranks)
    for text in _texts():
        ids = ours.encode(text)
        assert ids == theirs.encode(text, allowed_special="all"), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids) == text


def test_special_tokens_take_their_ids(kimi_dir: tuple[Path, dict[bytes, int]]) -> None:
    path, ranks = kimi_dir
    tokenizer, base = Tokenizer.from_dir(path), len(ranks)
    for offset, text in KIMI_NAMED.items():
        assert tokenizer.encode(text) == [base + offset] and tokenizer.id_to_token(base + offset) == text
    assert tokenizer.encode("<|reserved_token_%d|>" % (base + 5)) == [base + 5]
    assert tokenizer.vocab_size == base + SPECIAL_COUNT
    assert tokenizer.eos_token_ids == {base + 2}
    assert tokenizer.special_ids == set(range(base, base + SPECIAL_COUNT))
    assert tokenizer.special_prefix == tokenizer.special_suffix == ()  # tokenization_kimi adds no BOS
    assert tokenizer.decode(tokenizer.encode("[BOS]hé<|im_end|>")) == "hé"


def test_chat_template_renders(kimi_dir: tuple[Path, dict[bytes, int]]) -> None:
    path, ranks = kimi_dir
    tokenizer, base = Tokenizer.from_dir(path), len(ranks)
    text = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "héllo 世界"}])
    assert text == ("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>héllo 世界"
                    "<|im_end|><|im_assistant|>assistant<|im_middle|>")
    ids = tokenizer.encode(text)
    assert [i - base for i in ids if i >= base] == [10, 17, 2, 3, 17, 2, 4, 17]


def test_tool_keys_are_sorted_as_the_release_does(kimi_dir: tuple[Path, dict[bytes, int]], tmp_path: Path) -> None:
    """tokenization_kimi sorts the tools' keys at every depth before rendering; a tokenizer.json model does not."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                            "properties": {"b": {}, "a": {}}}}}]
    kimi, plain = Tokenizer.from_dir(kimi_dir[0]), Tokenizer.from_dir(write_byte_level(tmp_path))
    plain.use_chat_template(KIMI_TEMPLATE)
    messages = [{"role": "user", "content": "hi"}]
    assert json.dumps(tools, sort_keys=True) in kimi.apply_chat_template(messages, tools=tools)
    assert json.dumps(tools) in plain.apply_chat_template(messages, tools=tools)


def test_merges_are_every_two_token_split_by_the_rank_they_make() -> None:
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5}
    assert recover_merges(ranks) == [(b"a", b"b"), (b"b", b"c"), (b"a", b"bc"), (b"ab", b"c")]


@pytest.mark.parametrize("change,message", [
    (lambda p: (p / "tiktoken.model").unlink(), "neither tokenizer.json nor tiktoken.model"),
    (lambda p: _append(p / "tiktoken.model", "not-base64!! 7\n"), "line 401 is not 'base64-token rank'"),
    (lambda p: _append(p / "tiktoken.model", "eHl6 9000\n"), "not the distinct ids 0..400"),
    (lambda p: _set_config(p, auto_map={"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", None]}),
     "'tokenization_qwen'"),
])
def test_bad_directories_are_refused(change, message: str, tmp_path: Path) -> None:
    write_kimi_tiktoken(tmp_path)
    change(tmp_path)
    with pytest.raises(UnsupportedModelError, match=message):
        Tokenizer.from_dir(tmp_path)


def _append(file: Path, line: str) -> None:
    file.write_text(file.read_text() + line)


def _set_config(path: Path, **entries: object) -> None:
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, **entries}))


def test_kimi_checkpoint_with_only_tiktoken_files_serves_a_request(tmp_path: Path) -> None:
    """As in the release, the tokenizer knows 2 ids past the embedding's rows: a prompt using one is
    refused and the engine goes on to serve text in, transformers' greedy tokens out, and the text they
    decode to; beside it a regex-constrained request (llguidance reads the converted backend)."""
    base = len(write_kimi_tiktoken(tmp_path))
    rows = base + SPECIAL_COUNT - 2
    save_checkpoint(kimi_models.make(vocab_size=rows, eos_token_id=base + 2), tmp_path)
    assert not (tmp_path / "tokenizer.json").exists()
    tokenizer = Tokenizer.from_dir(tmp_path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "héllo 世界, the quick brown fox"}])
    choice = SamplingParams(temperature=0.0, max_tokens=8, structured=StructuredOutputs("regex", "(yes|no|世界)"))

    async def main() -> list:
        async with AsyncEngine(cpu_config(tmp_path)) as engine:
            with pytest.raises(InvalidRequestError, match=f"prompt token id {rows + 1} has no embedding row"):
                await collect(engine, f"hi <|reserved_token_{rows + 1}|>", greedy(2))
            return await asyncio.gather(collect(engine, prompt, greedy(6)), collect(engine, prompt, choice))

    done, constrained = asyncio.run(main())
    expected, _ = hf_greedy(tmp_path, tokenizer.encode(prompt), 6, rows)
    assert done.tokens == expected
    assert done.text[0] == tokenizer.decode(expected)
    assert constrained.text[0] in {"yes", "no", "世界"} and constrained.finish_reason[0] == "stop"
