"""Tokenizer loading, encode/decode and special tokens, against transformers on the same directory."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from hypic.engine.text.tokenizer import Tokenizer
from hypic.errors import UnsupportedModelError
from tokenizer_util import CORPUS, write_byte_level, write_metaspace

TEXTS = (*CORPUS, "", " leading space", "tabs\tand\nnewlines  ", "<|im_start|>user\nhé<|im_end|>", "zq 🙂🙂 x")


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    write = write_byte_level if request.param == "byte_level" else write_metaspace
    return write(tmp_path_factory.mktemp(request.param))


def test_encode_decode_match_transformers(model_dir: Path) -> None:
    ours, theirs = Tokenizer.from_dir(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    for text in TEXTS:
        for special in (False, True):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
            for skip in (False, True):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
        assert ours.decode(ours.encode(text)) == _without(text, [ours.id_to_token(i) for i in ours.special_ids])


def test_special_tokens_and_sizes(model_dir: Path) -> None:
    ours, theirs = Tokenizer.from_dir(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    assert ours.vocab_size == len(theirs)
    assert ours.eos_token_ids == {theirs.eos_token_id}
    assert ours.special_ids >= set(theirs.all_special_ids)  # every added special token, named or not
    assert list(ours.special_prefix) + ours.encode("x") + list(ours.special_suffix) == theirs.encode("x")
    assert all(ours.id_to_token(i) == theirs.convert_ids_to_tokens(i) for i in range(ours.vocab_size))


def test_ids_past_the_vocabulary_decode_to_nothing(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(write_byte_level(tmp_path))
    ids = tokenizer.encode("héllo")
    assert tokenizer.decode([*ids, tokenizer.vocab_size, tokenizer.vocab_size + 7]) == "héllo"
    assert tokenizer.id_to_token(tokenizer.vocab_size) is None


def test_generation_config_eos_ids_are_merged(tmp_path: Path) -> None:
    path = write_byte_level(tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    assert Tokenizer.from_dir(path).eos_token_ids == {0, 2}


def test_add_bos_token_flag_wraps_encoded_text(tmp_path: Path) -> None:
    path = write_byte_level(tmp_path, config={"bos_token": "<|endoftext|>", "add_bos_token": True})
    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer.special_prefix == (0,) and tokenizer.special_suffix == ()
    assert tokenizer.encode("hi", add_special_tokens=True) == [0, *tokenizer.encode("hi")]


def test_tokenizer_json_truncation_is_ignored(tmp_path: Path) -> None:
    path = write_byte_level(tmp_path)
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    (path / "tokenizer.json").write_text(json.dumps(spec))
    assert len(Tokenizer.from_dir(path).encode(CORPUS[0])) > 4


def test_missing_tokenizer_json_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def _without(text: str, tokens: list[str]) -> str:
    for token in tokens:
        text = text.replace(token, "")
    return text
