"""Splitting a prompt into independently tokenized segments."""
from __future__ import annotations

import array
from pathlib import Path

import pytest

from hypic.config import PIC_SEPARATOR
from hypic.engine.pic.segments import LMCACHE_SEPARATOR, SegmentedPrompt, encode_segments, split_segments
from hypic.engine.sequence import RequestInfo, Sequence
from hypic.engine.text.tokenizer import Tokenizer
from hypic.errors import InvalidRequestError
from hypic.sampling_params import SamplingParams
from tokenizer_util import write_byte_level, write_metaspace

DOCS = ["You answer from the notes.\n", " Doc one: héllo 世界.", " Doc two 🙂 the quick fox.", "\nQ: who?"]


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    write = write_byte_level if request.param == "byte_level" else write_metaspace
    return Tokenizer.from_dir(write(tmp_path_factory.mktemp(request.param)))


def test_split_is_str_split_keeping_empty_segments() -> None:
    assert split_segments("a|b||c", "|") == ["a", "b", "", "c"]
    assert split_segments("|doc|", "|") == ["", "doc", ""]
    assert split_segments("plain", "|") == ["plain"]
    with pytest.raises(InvalidRequestError):
        split_segments("a", "")


@pytest.mark.parametrize("separator", [PIC_SEPARATOR, LMCACHE_SEPARATOR])
def test_each_segment_is_tokenized_on_its_own(tokenizer: Tokenizer, separator: str) -> None:
    prompt = SegmentedPrompt.build(tokenizer, separator.join(DOCS), separator=separator)
    prefix, suffix = list(tokenizer.special_prefix), list(tokenizer.special_suffix)
    expected = [tokenizer.encode(d) for d in DOCS]
    expected[0], expected[-1] = prefix + expected[0], expected[-1] + suffix
    assert [list(s) for s in prompt.segments] == expected
    assert list(prompt.token_ids) == [t for s in expected for t in s]
    assert prompt.boundaries[0] == 0 and prompt.boundaries[-1] == prompt.num_tokens == len(prompt.token_ids)
    for i, segment in enumerate(prompt.segments):
        assert prompt.token_ids[prompt.boundaries[i]:prompt.boundaries[i + 1]] == segment
    assert len(prompt.segments) == len(DOCS) > 1


def test_a_prompt_without_separator_is_an_ordinary_encode(tokenizer: Tokenizer) -> None:
    text = "".join(DOCS)
    prompt = SegmentedPrompt.build(tokenizer, text, separator=PIC_SEPARATOR)
    assert list(prompt.token_ids) == tokenizer.encode(text, add_special_tokens=True)
    assert len(prompt.segments) == 1 and prompt.boundaries == (0, prompt.num_tokens)
    plain = SegmentedPrompt.build(tokenizer, text, separator=PIC_SEPARATOR, add_special_tokens=False)
    assert list(plain.token_ids) == tokenizer.encode(text)


def test_a_list_of_segments_equals_the_joined_string(tokenizer: Tokenizer) -> None:
    from_list = SegmentedPrompt.build(tokenizer, DOCS, separator=PIC_SEPARATOR)
    assert from_list == SegmentedPrompt.build(tokenizer, PIC_SEPARATOR.join(DOCS), separator=PIC_SEPARATOR)
    assert encode_segments(tokenizer, DOCS) == [list(s) for s in from_list.segments]


def test_warm_up_prompt_keeps_empty_prefix_and_query(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(write_metaspace(tmp_path))  # adds BOS: it goes into the empty prefix
    prompt = SegmentedPrompt.build(tokenizer, f"{PIC_SEPARATOR}doc{PIC_SEPARATOR}", separator=PIC_SEPARATOR)
    assert prompt.segments == (tokenizer.special_prefix, tuple(tokenizer.encode("doc")), ())
    assert prompt.boundaries == (0, 1, 1 + len(prompt.segments[1]), 1 + len(prompt.segments[1]))


def test_token_ids_are_one_verbatim_segment(tokenizer: Tokenizer) -> None:
    prompt = SegmentedPrompt.build(tokenizer, [5, 6, 7], separator=PIC_SEPARATOR)
    assert prompt.segments == ((5, 6, 7),) and prompt.token_ids == (5, 6, 7)


@pytest.mark.parametrize("prompt, match", [
    ("", "empty"),
    (PIC_SEPARATOR * 3, "empty"),
    ([], "empty"),
    (["", ""], "empty"),
    ([f"a{PIC_SEPARATOR}b"], "contains the separator"),
    ([1, "a"], "only strings or only token ids"),
    ([1, True], "only strings or only token ids"),
    ([1, 10**9], "outside the vocabulary"),
    ([-1], "outside the vocabulary"),
])
def test_bad_prompts_raise_invalid_request(tokenizer: Tokenizer, prompt: object, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        SegmentedPrompt.build(tokenizer, prompt, separator=PIC_SEPARATOR)  # type: ignore[arg-type]


def test_token_bytes_convert_the_ids_once_and_slice_per_segment() -> None:
    """Reference: each id as an 8-byte native int (array 'q'), the encoding keys were built on."""
    prompt = SegmentedPrompt(((1, 2), (), (300, 70000, 5), (2**40,)))
    assert prompt.token_bytes == array.array("q", prompt.token_ids).tobytes()
    for i, segment in enumerate(prompt.segments):
        assert prompt.segment_bytes(i) == array.array("q", segment).tobytes()


def test_sequence_token_bytes_cover_prompt_and_output() -> None:
    prompt = SegmentedPrompt(((7, 8, 9), (10, 11)))
    seq = Sequence(RequestInfo("r", SamplingParams(), prompt, None, "prefix"), 0)
    seq.append(12)
    seq.append(13)
    for length in range(len(seq.token_ids) + 1):
        assert seq.token_bytes(length) == array.array("q", seq.token_ids[:length]).tobytes()
