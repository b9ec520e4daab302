"""Incremental detokenization: deltas concatenate to the full decode and never split a character."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from hypic.engine.text.detokenizer import IncrementalDetokenizer
from hypic.engine.text.tokenizer import Tokenizer
from tokenizer_util import CORPUS, write_byte_level, write_metaspace

ALPHABET = "ab é世界🙂👍🏽ü\n.Ωж日本"


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    write = write_byte_level if request.param == "byte_level" else write_metaspace
    return Tokenizer.from_dir(write(tmp_path_factory.mktemp(request.param)))


def _stream(tokenizer: Tokenizer, prompt: list[int], output: list[int], rng: random.Random,
            skip_special_tokens: bool = True) -> list[str]:
    """Deltas from pushing `output` in random chunks of 1-3 tokens, then the final flush."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
    deltas, i = [], 0
    while i < len(output):
        step = rng.randint(1, 3)
        deltas.append(detok.push(output[i:i + step]))
        i += step
    return [*deltas, detok.flush()]


def _reference(tokenizer: Tokenizer, prompt: list[int], output: list[int], skip: bool = True) -> str:
    """What the output adds to the text: decode(context + output) minus decode(context)."""
    context = prompt[-5:]
    full = tokenizer.decode(context + output, skip_special_tokens=skip)
    return full[len(tokenizer.decode(context, skip_special_tokens=skip)):]


def test_valid_text_streams_without_replacement_characters(tokenizer: Tokenizer) -> None:
    rng = random.Random(0)
    for trial in range(200):
        prompt = tokenizer.encode(rng.choice(CORPUS)[: rng.randint(0, 30)], add_special_tokens=True)
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40)))
        output = tokenizer.encode(text)
        deltas = _stream(tokenizer, prompt, output, rng)
        assert all("\ufffd" not in d for d in deltas), (trial, deltas)
        assert "".join(deltas) == _reference(tokenizer, prompt, output)
        if not prompt or tokenizer.special_prefix == tuple(prompt):
            assert "".join(deltas) == text or "".join(deltas) == text.removeprefix(" ")


def test_random_token_ids_match_the_full_decode(tmp_path: Path) -> None:
    """Byte-level only: a byte-fallback decoder rewrites a run of byte tokens once it turns invalid."""
    tokenizer = Tokenizer.from_dir(write_byte_level(tmp_path))
    rng = random.Random(1)
    for trial in range(300):
        output = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 30))]
        prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(0, 8))]
        skip = trial % 2 == 0
        deltas = _stream(tokenizer, prompt, output, rng, skip)
        assert "".join(deltas) == _reference(tokenizer, prompt, output, skip), trial


def test_byte_level_output_equals_decode_of_output_alone(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(write_byte_level(tmp_path))
    rng = random.Random(2)
    for _ in range(100):
        output = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 30))]
        prompt = tokenizer.encode(rng.choice(CORPUS))
        assert "".join(_stream(tokenizer, prompt, output, rng)) == tokenizer.decode(output)


def test_metaspace_first_output_token_keeps_its_space_after_a_prompt(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(write_metaspace(tmp_path))
    prompt, output = tokenizer.encode("the quick", add_special_tokens=True), tokenizer.encode(" brown fox")[1:]
    assert tokenizer.id_to_token(output[0]).startswith("▁")
    assert "".join(_stream(tokenizer, prompt, output, random.Random(3))) == " brown fox"


def test_special_tokens_are_skipped_or_kept(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(write_byte_level(tmp_path))
    output = tokenizer.encode("hé<|im_end|>llo")
    rng = random.Random(4)
    assert "".join(_stream(tokenizer, [], output, rng, skip_special_tokens=True)) == "héllo"
    assert "".join(_stream(tokenizer, [], output, rng, skip_special_tokens=False)) == "hé<|im_end|>llo"


def test_each_step_decodes_a_bounded_window(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(write_byte_level(tmp_path))
    decoded: list[int] = []
    original = tokenizer.decode
    tokenizer.decode = lambda ids, **kw: decoded.append(len(ids)) or original(ids, **kw)  # type: ignore[method-assign]
    output = tokenizer.encode(" ".join(CORPUS) * 20)
    detok = IncrementalDetokenizer(tokenizer, [], True)
    text = "".join(detok.push([t]) for t in output) + detok.flush()
    assert text == original(output)
    assert max(decoded) <= 12 and sum(decoded) <= 8 * len(output)
