"""A tiktoken BPE directory (Kimi's `tiktoken.model` + `tokenization_kimi.py`) as a `tokenizers` backend.

tiktoken merges, inside each pre-token, the adjacent pair whose concatenation has the lowest rank, and
takes a pre-token that is itself a token whole. A byte-level BPE reproduces that when its merges are every
split (left, right) of every token into two tokens, ordered by the rank of the token they make, and
`ignore_merges` is on. The pre-tokenizer regex and the reserved special-token range live in the release's
Python code, not in its files, so they are kept here per remote-code module (`auto_map`).

Not reproduced: tokenization_kimi cuts a text every 400,000 characters, and inside runs of more than
25,000 whitespace or non-whitespace characters, before encoding (a guard against a tiktoken crash);
ids differ from the release's only across such cuts.
"""
from __future__ import annotations

import base64
import binascii
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from hypic.errors import UnsupportedModelError

TIKTOKEN_FILE = "tiktoken.model"


@dataclass(frozen=True)
class TiktokenScheme:
    """What a release's tokenizer code fixes: its split regex, how many special ids follow the ranks,
    and whether it sorts the keys of `tools` (recursively) before the chat template sees them."""

    pattern: str
    special_count: int
    sorts_tool_keys: bool


KIMI = TiktokenScheme(
    pattern="|".join((  # tokenization_kimi.py's pat_str: Han runs apart, cased words, 1-3 digit groups
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    )),
    special_count=256 + 2,  # num_reserved_special_tokens + 2: ids unnamed in the config read <|reserved_token_N|>
    sorts_tool_keys=True,  # its apply_chat_template deep-sorts the tool dicts
)
SCHEMES: dict[str, TiktokenScheme] = {"tokenization_kimi": KIMI}
"""Remote-code module (tokenizer_config.json auto_map) -> its scheme."""


def backend_from_tiktoken(path: Path, config: Mapping[str, Any], scheme: TiktokenScheme) -> _Backend:
    """The byte-level BPE equal to the directory's tiktoken encoding, special tokens at their ids."""
    ranks = read_ranks(path / TIKTOKEN_FILE)
    vocab = {_byte_text(token): rank for token, rank in ranks.items()}
    merges = [(_byte_text(left), _byte_text(right)) for left, right in recover_merges(ranks)]
    backend = _Backend(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(scheme.pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, len(ranks), scheme.special_count, config.get("added_tokens_decoder", {}))
    return backend


def read_ranks(path: Path) -> dict[bytes, int]:
    """`tiktoken.model`: one "base64-token rank" a line (a non-ASCII byte fails its line); ranks 0..n-1 (the ids)."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_text(encoding="ascii", errors="replace").splitlines(), start=1):
        if line.strip():
            token, rank = _parse_line(path, number, line)
            ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise UnsupportedModelError(f"{path}: the {len(ranks)} ranks are not the distinct ids 0..{len(ranks) - 1}")
    return ranks


def recover_merges(ranks: Mapping[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split of every token into two tokens, by the rank of the token made (then by the parts' ranks)."""
    keyed = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                keyed.append((rank, ranks[left], ranks[right], left, right))
    keyed.sort()
    return [(left, right) for *_, left, right in keyed]


def tiktoken_scheme(path: Path, config: Mapping[str, Any]) -> TiktokenScheme:
    auto_map = config.get("auto_map", {}).get("AutoTokenizer") or [None]
    module = (auto_map[0] or "").split(".")[0]
    if module not in SCHEMES:
        raise UnsupportedModelError(
            f"{path} has {TIKTOKEN_FILE} but tokenizer_config.json's auto_map names the tokenizer code "
            f"{module or 'nothing'!r}; hypic knows the split regex of {sorted(SCHEMES)} only")
    return SCHEMES[module]


def _parse_line(path: Path, number: int, line: str) -> tuple[bytes, int]:
    fields = line.split()
    try:
        if len(fields) != 2:
            raise ValueError(f"{len(fields)} fields")
        return base64.b64decode(fields[0], validate=True), int(fields[1])
    except (ValueError, binascii.Error) as error:
        raise UnsupportedModelError(f"{path} line {number} is not 'base64-token rank': {error}") from error


def _add_special_tokens(backend: _Backend, first_id: int, count: int, decoder: Mapping[str, Any]) -> None:
    """Ids first_id.. in order (the backend numbers added tokens after the vocabulary); named ones take
    their config flags, the reserved rest are special."""
    tokens = [_special_token(i, decoder.get(str(i))) for i in range(first_id, first_id + count)]
    backend.add_special_tokens(tokens)
    for token_id, token in enumerate(tokens, start=first_id):
        if backend.token_to_id(token.content) != token_id:
            raise UnsupportedModelError(
                f"special token {token.content!r} should have id {token_id} but the vocabulary already holds it")


def _special_token(token_id: int, entry: Mapping[str, Any] | None) -> AddedToken:
    if entry is None:
        return AddedToken(f"<|reserved_token_{token_id}|>", special=True, normalized=False)
    return AddedToken(entry["content"], special=entry.get("special", True), normalized=False,
                      lstrip=entry.get("lstrip", False), rstrip=entry.get("rstrip", False),
                      single_word=entry.get("single_word", False))


@functools.cache
def _byte_alphabet() -> tuple[str, ...]:
    """GPT-2's byte -> printable character table, which `ByteLevel` pre-tokenizers and decoders use:
    printable Latin-1 bytes stand for themselves, the rest map to U+0100 onwards in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    return tuple(chr(b) if b in printable else chr(next(shifted)) for b in range(256))


def _byte_text(token: bytes) -> str:
    alphabet = _byte_alphabet()
    return "".join(alphabet[b] for b in token)
