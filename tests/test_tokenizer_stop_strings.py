"""Stop strings on a text stream: the result never depends on how the text was cut into deltas."""
from __future__ import annotations

import random
from pathlib import Path

from hypic.engine.text.detokenizer import IncrementalDetokenizer
from hypic.engine.text.stop import StopStringMatcher
from hypic.engine.text.tokenizer import Tokenizer
from tokenizer_util import write_byte_level


def _reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Brute force: the first end position where some stop string ends; the longest one there."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return (text[:end] if include else text[:end - len(stop)]), stop
    return text, None


def _stream(chunks: list[str], stops: list[str], include: bool) -> tuple[str, str | None]:
    matcher = StopStringMatcher(stops, include)
    out = []
    for chunk in chunks:
        check = matcher.push(chunk)
        out.append(check.text)
        if check.stopped:
            return "".join(out), check.stop_str
    return "".join(out) + matcher.flush(), None


def _random_cut(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, len(text) - 1))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_matches_brute_force_for_every_cut() -> None:
    rng = random.Random(0)
    for trial in range(3000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 20)))
        include = trial % 2 == 1
        assert _stream(_random_cut(text, rng), stops, include) == _reference(text, stops, include), (text, stops)


def test_partial_match_is_held_back_until_decided() -> None:
    matcher = StopStringMatcher(["</end>"])
    assert matcher.push("value </e").text == "value "
    assert matcher.push("n").text == ""
    assert matcher.push("x").text == "</enx"  # it was not the stop string after all
    check = matcher.push(" then </end> more")
    assert (check.text, check.stop_str) == (" then ", "</end>")
    assert matcher.push("ignored").text == ""


def test_include_stop_str_emits_at_once_and_ends_after_the_stop() -> None:
    matcher = StopStringMatcher(["</end>"], include_stop_str_in_output=True)
    assert matcher.push("value </e").text == "value </e"
    check = matcher.push("nd> more")
    assert (check.text, check.stopped) == ("nd>", True)


def test_no_stop_strings_is_a_pass_through() -> None:
    matcher = StopStringMatcher([])
    assert [matcher.push(t).text for t in ("a", "b")] == ["a", "b"] and matcher.flush() == ""


def test_stop_strings_across_token_boundaries(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(write_byte_level(tmp_path))
    text = "héllo 世界 🙂 the quick brown fox"
    for stop in ("界 🙂", "🙂", "ll", "x"):
        detok, matcher, out = IncrementalDetokenizer(tokenizer, []), StopStringMatcher([stop]), []
        for token in tokenizer.encode(text):
            check = matcher.push(detok.push([token]))
            out.append(check.text)
            if check.stopped:
                break
        assert "".join(out) == text[: text.index(stop)]
